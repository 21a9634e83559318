"""Building the trainer from a config: the models (actor, critic; LoRA; a checkpoint's weights) and the
trainer shape around them. The runtime calls `build_trainer` once per run; spawned trainer processes
(follower ranks, the critic's process) call `rank_learner` / `critic_learner`, module-level so they
travel to spawned processes.

    build_trainer(cfg, model_path, ckpt)   a one-process Learner; at trainer.ranks=N a driver of N FSDP2
                                           ranks (sao/trainer/ranks.py; Ray actors with runtime.backend=ray,
                                           sao/trainer/ray_ranks.py, after the caller connected to Ray);
                                           with critic.placement=separate the critic on its own process(es)
    build_models(cfg, model_path, ckpt)    actor and critic on trainer.device, as every shape builds them
"""

from __future__ import annotations

from pathlib import Path

import torch

from sao.algo.registry import get_algorithm
from sao.config import Config
from sao.device import resolve_device, resolve_dtype
from sao.models.critic import build_critic, load_critic
from sao.models.lora import adapter_base, load_lora_critic, resume_lora, with_lora
from sao.models.tiny import load_model
from sao.trainer.learner import Learner


def build_trainer(cfg: Config, model_path: Path, ckpt: Path | None):
    """The trainer behind the seam (sao/trainer/protocol.py): a one-process Learner, or at trainer.ranks=N
    a driver of N FSDP2 ranks (this process is rank 0, sao/trainer/ranks.py; with runtime.backend=ray
    every rank is a Ray actor, sao/trainer/ray_ranks.py); with critic.placement=separate either one beside
    the critic's own ranks (`start_critic`). A checkpoint written at any number of ranks (DCP shards in
    trainer/, or a one-rank run's HF folders and plain optimizer states) loads into any number of ranks
    (preflight refuses the placements it cannot: sao/runtime/preflight.py check_ranks)."""
    sharded = ckpt is not None and (ckpt / "trainer").is_dir()
    algo = get_algorithm(cfg.algo.name)
    args = (cfg, str(model_path), str(ckpt) if ckpt is not None else None)
    critic = start_critic(cfg, args) if algo.uses_critic and cfg.critic.placement == "separate" else None
    try:
        if cfg.trainer.ranks > 1:
            if cfg.runtime.backend == "ray":  # Ray actors in a placement group; the caller connected to Ray
                from sao.trainer.ray_ranks import start_ray_ranks

                driver = start_ray_ranks(cfg.trainer, rank_learner, args, model_path)
            else:
                from sao.trainer.ranks import start_trainer_ranks

                driver = start_trainer_ranks(cfg.trainer.ranks, rank_learner, args, cfg.trainer.timeout_s, model_path)
            driver.critic = critic  # the ranks train the actor; the critic's results travel with each step
            return driver
        if critic is not None:  # steps 1-3 on the critic's own process(es)
            return Learner(build_actor(cfg, model_path, ckpt), None, algo, cfg.algo, cfg.critic, cfg.train,
                           dtype=resolve_dtype(cfg.engine.dtype), critic_group=critic)
    except BaseException:
        if critic is not None:
            critic.close(abort=True)
        raise
    actor, critic = build_models(cfg, model_path, ckpt)
    learner = Learner(actor, critic, algo, cfg.algo, cfg.critic, cfg.train, dtype=resolve_dtype(cfg.engine.dtype))
    if sharded:  # saved by N ranks: its shards hold weights, optimizer states and counters
        from sao.trainer.sharded_checkpoint import load_sharded

        load_sharded(learner, ckpt / "trainer")
    return learner


def start_critic(cfg: Config, args: tuple):
    """critic.placement=separate: the critic's critic.ranks processes (Ray actors with runtime.backend=ray, placed
    like trainer ranks; the caller connected to Ray), each built by `critic_learner(*args)`."""
    if cfg.runtime.backend == "ray":
        from sao.trainer.ray_ranks import start_ray_critic

        return start_ray_critic(cfg.trainer, cfg.critic.ranks, cfg.critic.threads, critic_learner, args)
    from sao.trainer.critic_ranks import start_critic_rank

    return start_critic_rank(critic_learner, args, cfg.critic.threads, cfg.critic.ranks, cfg.trainer.timeout_s)


def rank_learner(cfg: Config, model_path: str, ckpt: str | None):
    """One rank's DistributedLearner (every rank runs this; module-level: it travels to spawned ranks).
    Rank 0 reads the weights; ranks 1..N-1 build the models on the meta device and receive their
    shards from it, so no rank but rank 0 ever holds a whole model."""
    import torch.distributed as dist

    from sao.models.quiet import quiet_transformers
    from sao.trainer.distributed import DistributedLearner
    from sao.trainer.sharded_checkpoint import load_sharded

    quiet_transformers()  # a spawned rank starts with transformers' defaults
    ckpt = Path(ckpt) if ckpt is not None else None
    algo = get_algorithm(cfg.algo.name)
    elsewhere = algo.uses_critic and cfg.critic.placement == "separate"  # the critic has ranks of its own
    meta = dist.get_rank() != 0
    actor, critic = ((build_actor(cfg, Path(model_path), ckpt, meta), None) if elsewhere
                     else build_models(cfg, Path(model_path), ckpt, meta=meta))
    # one precision policy at 1 and N ranks: bf16 compute over fp32 master weights when engine.dtype says so
    learner = DistributedLearner(actor, critic, algo, cfg.algo, cfg.critic, cfg.train,
                                 mixed_precision=resolve_dtype(cfg.engine.dtype) == torch.bfloat16, from_rank0=True,
                                 critic_elsewhere=elsewhere)
    if ckpt is not None and (ckpt / "trainer").is_dir():
        load_sharded(learner, ckpt / "trainer")
    # else a one-rank checkpoint: weights from its HF folders (build_models); its optimizer states and
    # counters follow from rank 0 when the context loads trainer_state.pt (RankDriver.load_state_dict)
    return learner


def critic_learner(cfg: Config, model_path: str, ckpt: str | None) -> Learner:
    """A critic process's learner (critic.placement=separate; module-level: it travels to the spawned
    process): the critic alone, built as `build_models` builds it, no actor. At critic.ranks=M > 1 (this
    process is in the critic's process group) an FSDP2 `DistributedLearner` like `rank_learner`'s: critic
    rank 0 reads the weights, the others receive their shards from it."""
    import functools

    import torch.distributed as dist

    from sao.models.quiet import quiet_transformers

    quiet_transformers()  # a spawned process starts with transformers' defaults
    model_path, ckpt = Path(model_path), Path(ckpt) if ckpt is not None else None
    algo = get_algorithm(cfg.algo.name)
    if not dist.is_initialized():
        return Learner(None, build_critic_model(cfg, model_path, ckpt), algo, cfg.algo, cfg.critic, cfg.train,
                       dtype=resolve_dtype(cfg.engine.dtype))
    from sao.trainer.distributed import DistributedLearner

    critic = build_critic_model(cfg, model_path, ckpt, meta=dist.get_rank() != 0)
    learner = DistributedLearner(None, critic, algo, cfg.algo, cfg.critic, cfg.train,
                                 mixed_precision=resolve_dtype(cfg.engine.dtype) == torch.bfloat16, from_rank0=True)
    learner.rebuild_critic = functools.partial(build_critic_model, cfg, model_path, ckpt, True)
    return learner


def build_models(cfg: Config, model_path: Path, ckpt: Path | None, meta: bool = False):
    """Actor (LoRA when model.lora.r > 0) and, for critic algorithms, the critic (critic.path, a
    checkpoint's, or one built from the policy), on trainer.device; weights from `ckpt` when resuming.
    `meta`: the same models on the meta device, no weight read (a trainer rank that receives them)."""
    actor = build_actor(cfg, model_path, ckpt, meta)  # first: a LoRA actor draws its init before the critic's
    critic = build_critic_model(cfg, model_path, ckpt, meta) if get_algorithm(cfg.algo.name).uses_critic else None
    return actor, critic


def build_actor(cfg: Config, model_path: Path, ckpt: Path | None, meta: bool = False):
    device = torch.device("meta") if meta else resolve_device(cfg.trainer.device)
    actor = load_model(model_path, meta=meta).to(device)
    if ckpt is not None and adapter_base(ckpt / "actor"):
        return resume_lora(actor, ckpt / "actor")
    return with_lora(actor, cfg.model.lora)  # lora.r=0: the model itself


def build_critic_model(cfg: Config, model_path: Path, ckpt: Path | None, meta: bool = False):
    device = torch.device("meta") if meta else resolve_device(cfg.trainer.device)
    critic_path = ckpt / "critic" if ckpt is not None and (ckpt / "critic").is_dir() else cfg.critic.path
    if critic_path and adapter_base(critic_path):  # a LoRA critic's adapter (a checkpoint, or pretrained)
        return load_lora_critic(critic_path, device, meta=meta)
    depth = {"num_layers": cfg.critic.num_layers, "depth": cfg.critic.depth}
    critic = (load_critic(critic_path, meta=meta, **depth) if critic_path
              else build_critic(model_path, meta=meta, **depth))
    return with_lora(critic.to(device), cfg.critic.lora, value_head=True)
