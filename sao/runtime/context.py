"""The run context: everything one run is built from, built once (step 1 of sao/runtime/train.py).

    build(cfg, environment, progress, resume)
        run directory (new, or the one resumed), starting policy (cached SFT warm start), trainer
        (actor and critic on trainer.device, behind the seam of sao/trainer/protocol.py), queue, task
        stream, pacing, audit; with --resume, each part's state from the latest checkpoint

Each part saves and restores its own state (`state_dict`/`load_state_dict`); `RunContext.state_dict`
only gathers them for sao/runtime/checkpoint.py, which writes and reads the files.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sao.algo.registry import get_algorithm
from sao.config import Config, ConfigError
from sao.device import resolve_device, resolve_dtype
from sao.models.chat import ChatCodec
from sao.models.critic import build_critic, load_critic
from sao.models.lora import adapter_base, load_lora_critic, resume_lora, with_lora
from sao.models.tiny import load_model
from sao.models.tokenizer import load_tokenizer
from sao.rollout.agent_loop import EpisodeLimits
from sao.runtime import checkpoint
from sao.runtime.critic_watch import CriticWatch
from sao.runtime.episodes import PolicyCopy, limits_of
from sao.runtime.groups import make_queue, task_stream
from sao.runtime.model_setup import prepare_base_model
from sao.runtime.pacing import Pacing, batches_ahead
from sao.runtime.parity import LiveParity
from sao.runtime.progress import RunProgress
from sao.runtime.rollout_watch import RolloutWatch
from sao.runtime.run_dir import RunDir
from sao.runtime.scheduler import Audit, Scheduler, TaskStream
from sao.runtime.threads import ThreadPlan
from sao.trainer.learner import Learner
from sao.trainer.protocol import Trainer


@dataclass
class RunContext:
    cfg: Config
    progress: RunProgress
    environment: object
    limits: EpisodeLimits
    run: RunDir
    model_path: Path  # the starting policy's folder (engines load it, then receive the trainer's weights)
    codec: ChatCodec
    trainer: Trainer  # the seam (sao/trainer/protocol.py): the runtime asks nothing else of it
    queue: object  # TrajectoryQueue, or GroupQueue for group algorithms (sao/runtime/groups.py)
    tasks: TaskStream
    pacing: Pacing
    audit: Audit | None  # async runs: every episode's life (sao/runtime/scheduler.py)
    threads: ThreadPlan
    live_parity: LiveParity
    step: int = 0
    totals: dict = field(default_factory=lambda: {"dropped_stale": 0, "failed": 0, "wait_s": 0.0, "checkpoint_s": 0.0})
    setup: dict = field(default_factory=dict)  # summary.json: what the first run paid (SFT)
    scheduler: Scheduler | None = None  # async runs, once the backend is up
    pending: dict = field(default_factory=dict)  # a resumed scheduler's unfinished episodes
    resumed_from: str | None = None  # that checkpoint's actor/ is model_path: never pruned
    _policy: PolicyCopy | None = None
    critic_watch: CriticWatch = field(default_factory=CriticWatch)  # warns once on a critic that explains nothing
    rollout_watch: RolloutWatch | None = None  # warns once on all-truncated or failing rollouts; stops on failing ones
    stop_requested: str = ""  # the signal's name once Ctrl-C or SIGTERM arrived (sao/runtime/signals.py)

    def state_dict(self) -> dict:
        return {
            "step": self.step, "totals": dict(self.totals),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "trainer": self.trainer.state_dict(), "pacing": self.pacing.state_dict(),
            "tasks": self.tasks.state_dict(), "queue": self.queue.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else self.pending,
            "run": self.run.state_dict(), "audit": self.audit.state_dict() if self.audit is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.totals.update(state["totals"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if "sharded" not in state["trainer"]:  # else every rank loaded its shards when it was built
            self.trainer.load_state_dict(state["trainer"])
        self.pacing.load_state_dict(state["pacing"])
        self.tasks.load_state_dict(state["tasks"])
        self.queue.load_state_dict(state["queue"])
        self.pending = state["scheduler"]
        self.run.load_state_dict(state["run"])
        if self.audit is not None and state["audit"] is not None:
            self.audit.load_state_dict(state["audit"])

    def save(self, tag: str) -> Path:
        t0 = time.perf_counter()
        path = checkpoint.save(self.run.path, tag, self.state_dict(), self._write_models, self.cfg.output.keep_checkpoints,
                               protect=self.resumed_from)
        self.totals["checkpoint_s"] += time.perf_counter() - t0  # in summary.json: what checkpoints cost the run
        return path

    def _write_models(self, folder: Path) -> None:
        self.trainer.save_pretrained(folder, self.codec.tokenizer, merged=self.cfg.model.lora.save_merged)

    def save_at_exit(self, tag: str) -> Path:
        """The last checkpoint; the audit says which episodes it carries over, so they are not taken for lost."""
        if self.audit is not None and self.scheduler is not None:
            self.audit.write("unfinished_at_exit", self.scheduler.pending(), self.step, checkpoint=tag)
            self.audit.write("queued_at_exit", self.queue.items(), self.step, checkpoint=tag)
        return self.save(tag)

    def policy_copy(self) -> PolicyCopy:
        """The one engine-side copy of the policy this process keeps (parity gate, evaluation, sync
        generation; sao/runtime/episodes.py)."""
        if self._policy is None:
            self._policy = PolicyCopy(self.cfg, self.model_path)
        return self._policy

    def close(self) -> None:
        """Stop what the context started: the trainer's other processes (ranks N > 1, a separate critic).
        Idempotent."""
        self.trainer.close()

    def start_scheduler(self, backend) -> Scheduler:
        self.scheduler = Scheduler(backend, self.tasks, self.audit, self.pacing, self.rollout_watch)
        self.scheduler.load_state_dict(self.pending)
        return self.scheduler


def build(cfg: Config, environment, progress: RunProgress, resume: Path | None = None) -> RunContext:
    """Step 1. `environment` is what preflight (sao/runtime/preflight.py) returned for this config."""
    ckpt = checkpoint.latest(resume) if resume is not None else None
    setup = {}
    if ckpt is not None:
        # a LoRA run saved adapters: engines and the actor start from the base model they sit on
        model_path = Path(adapter_base(ckpt / "actor") or ckpt / "actor")
        if not (model_path / "config.json").is_file():
            raise ConfigError(f"--resume: {ckpt / 'actor'} is an adapter on {model_path}, which is gone")
        run = RunDir(resume, cfg)
    else:
        run = RunDir.create(cfg)
        t0 = time.perf_counter()
        model_path, built = prepare_base_model(cfg, on_step=progress.sft_callback(cfg.sft.steps))
        setup = {"sft_built": built, "sft_s": time.perf_counter() - t0}
    codec = ChatCodec(load_tokenizer(model_path))
    algo = get_algorithm(cfg.algo.name)
    ctx = RunContext(cfg, progress, environment, limits_of(cfg), run, model_path, codec,
                     build_trainer(cfg, model_path, ckpt), make_queue(algo, cfg),
                     TaskStream(task_stream(environment, algo, cfg)),
                     Pacing(cfg.train.batch_size, batches_ahead(cfg.runtime), cfg.runtime.sync_every),
                     Audit(run.path / "audit.jsonl") if cfg.runtime.mode == "async" else None,
                     ThreadPlan(cfg.runtime), LiveParity(cfg), setup=setup,
                     rollout_watch=RolloutWatch(progress.warn, cfg.runtime.failure_window, cfg.runtime.max_failed_frac))
    if ckpt is not None:
        ctx.resumed_from = ckpt.name
        ctx.load_state_dict(checkpoint.load(ckpt))
        if ctx.audit is not None:
            ctx.audit.note("resumed", ctx.step, checkpoint=ckpt.name)
    return ctx


def build_trainer(cfg: Config, model_path: Path, ckpt: Path | None):
    """The trainer behind the seam (sao/trainer/protocol.py): a one-process Learner, or at trainer.ranks=N
    a driver of N FSDP2 ranks (this process is rank 0, sao/trainer/ranks.py; with runtime.backend=ray
    every rank is a Ray actor, sao/trainer/ray_ranks.py). A checkpoint written at any number of ranks (DCP
    shards in trainer/, or a one-rank run's HF folders and plain optimizer states) loads into any number of ranks."""
    sharded = ckpt is not None and (ckpt / "trainer").is_dir()
    if cfg.trainer.ranks > 1:
        args = (cfg, str(model_path), str(ckpt) if ckpt is not None else None)
        if cfg.runtime.backend == "ray":  # the ranks as Ray actors in a placement group (sao/trainer/ray_ranks.py)
            from sao.runtime.ray_backend import connect
            from sao.trainer.ray_ranks import start_ray_ranks

            connect(cfg.runtime, cfg.trainer.ranks * cfg.trainer.rank_num_cpus)
            return start_ray_ranks(cfg.trainer, rank_learner, args, model_path)
        from sao.trainer.ranks import start_trainer_ranks

        return start_trainer_ranks(cfg.trainer.ranks, rank_learner, args, cfg.trainer.timeout_s, model_path)
    algo = get_algorithm(cfg.algo.name)
    if algo.uses_critic and cfg.critic.placement == "separate":  # steps 1-3 on the critic's own process
        from sao.trainer.critic_ranks import start_critic_rank

        group = start_critic_rank(critic_learner, (cfg, str(model_path), str(ckpt) if ckpt is not None else None),
                                  cfg.critic.threads)
        return Learner(build_actor(cfg, model_path, ckpt), None, algo, cfg.algo, cfg.critic, cfg.train,
                       dtype=resolve_dtype(cfg.engine.dtype), critic_group=group)
    actor, critic = build_models(cfg, model_path, ckpt)
    learner = Learner(actor, critic, algo, cfg.algo, cfg.critic, cfg.train, dtype=resolve_dtype(cfg.engine.dtype))
    if sharded:  # saved by N ranks: its shards hold weights, optimizer states and counters
        from sao.trainer.sharded_checkpoint import load_sharded

        load_sharded(learner, ckpt / "trainer")
    return learner


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
    actor, critic = build_models(cfg, Path(model_path), ckpt, meta=dist.get_rank() != 0)
    # one precision policy at 1 and N ranks: bf16 compute over fp32 master weights when engine.dtype says so
    learner = DistributedLearner(actor, critic, get_algorithm(cfg.algo.name), cfg.algo, cfg.critic, cfg.train,
                                 mixed_precision=resolve_dtype(cfg.engine.dtype) == torch.bfloat16, from_rank0=True)
    if ckpt is not None and (ckpt / "trainer").is_dir():
        load_sharded(learner, ckpt / "trainer")
    # else a one-rank checkpoint: weights from its HF folders (build_models); its optimizer states and
    # counters follow from rank 0 when the context loads trainer_state.pt (RankDriver.load_state_dict)
    return learner


def critic_learner(cfg: Config, model_path: str, ckpt: str | None) -> Learner:
    """The critic's process's learner (critic.placement=separate; module-level: it travels to the spawned
    process): the critic alone, built as `build_models` builds it, no actor."""
    from sao.models.quiet import quiet_transformers

    quiet_transformers()  # a spawned process starts with transformers' defaults
    critic = build_critic_model(cfg, Path(model_path), Path(ckpt) if ckpt is not None else None)
    return Learner(None, critic, get_algorithm(cfg.algo.name), cfg.algo, cfg.critic, cfg.train,
                   dtype=resolve_dtype(cfg.engine.dtype))


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
