"""`sao pretrain-critic`: sample from the starting policy, fit the critic, save it for reuse.

    sao pretrain-critic [CONFIG.yaml] [key=value ...] --steps 50 --out critics/calc
    sao train critic.path=critics/calc        # start RL from the pretrained critic
"""

from __future__ import annotations

from pathlib import Path

from sao.algo.registry import Advantage, get_algorithm
from sao.config import Config, ConfigError
from sao.engine import make_engine
from sao.models.chat import ChatCodec
from sao.models.critic import build_critic, freeze_parameters, load_critic
from sao.models.lora import with_lora
from sao.models.tiny import load_model
from sao.models.tokenizer import load_tokenizer
from sao.runtime.episodes import limits_of, usable_batch
from sao.runtime.model_setup import prepare_base_model
from sao.runtime.preflight import preflight
from sao.runtime.threads import ThreadPlan
from sao.trainer.batch import collate
from sao.trainer.critic_pretrain import fit_critic


def pretrain_critic(cfg: Config, steps: int, out: Path, progress=None, environment=None) -> dict:
    """`environment`: what the caller's preflight returned (the CLI runs it first); without it, preflight
    runs here."""
    if out.exists():
        raise ConfigError(f"--out: {str(out)!r} exists already; choose another folder")
    algo = get_algorithm(cfg.algo.name)
    if not algo.uses_critic:
        raise ConfigError(f"algo.name: {algo.name} trains no critic; there is nothing to pretrain")
    environment = environment if environment is not None else preflight(cfg)
    model_path, _ = prepare_base_model(cfg, on_step=progress.sft_callback(cfg.sft.steps) if progress else None)
    codec = ChatCodec(load_tokenizer(model_path))
    actor = load_model(model_path)
    # the critic the run will use: critic.path (e.g. a smaller model) or the policy's own checkpoint,
    # with critic.lora adapters when set (saved as an adapter folder that `sao train critic.path=` takes)
    depth = {"num_layers": cfg.critic.num_layers, "depth": cfg.critic.depth}
    critic = load_critic(cfg.critic.path, **depth) if cfg.critic.path else build_critic(model_path, **depth)
    critic = with_lora(critic, cfg.critic.lora, value_head=True)
    if cfg.critic.freeze_attention if algo.freeze_attention is None else algo.freeze_attention:  # as the run will
        freeze_parameters(critic, cfg.critic.freeze_pattern)
    engine = make_engine(cfg.engine.model_copy(update={"name": "torch"}), model_path, pad_id=codec.tokenizer.pad_token_id,
                         max_batch=cfg.rollout.concurrency, seed=cfg.train.seed, model=actor)
    tasks, limits = environment.train_tasks(), limits_of(cfg)

    threads = ThreadPlan(cfg.runtime)

    def next_batch():
        threads.generate()
        trajs, _ = usable_batch(engine, environment, codec, tasks, limits, cfg.train.batch_size)
        threads.train_alone()
        return collate(trajs, codec.tokenizer.pad_token_id)

    def on_step(step: int, m: dict) -> None:
        if progress is not None:
            progress.log(f"critic step {step + 1}/{steps}: value loss {m['critic/value_loss']:.4f}  "
                         f"explained variance {m['critic/explained_variance']:.3f}")

    history = fit_critic(critic, next_batch, steps, cfg.critic.lr, cfg.critic.grad_clip, cfg.train.weight_decay,
                         cfg.algo.gamma, on_step, prompt_value=algo.advantage is Advantage.PROMPT_VALUE)
    tmp = out.with_name(out.name + ".partial")
    critic.save_pretrained(tmp)
    codec.tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return {"path": str(out), "steps": steps, "first": history[0] if history else {}, "last": history[-1] if history else {}}
