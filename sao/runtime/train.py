"""`sao train`: the whole run, top to bottom.

    step 1  run directory, environment, starting policy (cached SFT warm start), critic;
            or, with --resume, everything a checkpoint holds (sao/runtime/checkpoint.py)
            the rollout workers start now (runtime.backend): they generate while steps 2-3 run
    step 2  parity gate: engine and trainer log-probs agree on the same tokens and weights
    step 3  held-out evaluation of the starting policy
    step 4  the loop (sao/runtime/loop.py): async over the backend, or sync (generate, then train)
    step 5  final evaluation, checkpoints, summary

This module knows no processes: the backend (sao/runtime/backend.py) owns them. Ctrl-C and
SIGTERM write a checkpoint, then exit.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sao.algo.registry import get_algorithm
from sao.config import Config, ConfigError
from sao.device import autocast, resolve_device, resolve_dtype, to_device
from sao.engine.torch_engine import TorchEngine
from sao.models.actor import sequence_logprobs
from sao.models.chat import ChatCodec
from sao.models.critic import build_critic, load_critic
from sao.models.lora import adapter_base, engine_parameters, load_lora_critic, resume_lora, with_lora
from sao.models.tiny import load_model
from sao.models.tokenizer import load_tokenizer
from sao.rollout.agent_loop import EpisodeLimits, run_episode
from sao.runtime import checkpoint
from sao.runtime.backend import flatten, make_backend
from sao.runtime.evaluate import evaluate
from sao.runtime.groups import make_queue, task_stream
from sao.runtime.loop import Interrupted, rollout_metrics, run_async, run_sync
from sao.runtime.model_setup import prepare_base_model
from sao.runtime.preflight import preflight
from sao.runtime.progress import RunProgress
from sao.runtime.queue import TrajectoryQueue
from sao.runtime.run_dir import RunDir, WriteError
from sao.runtime.scheduler import Audit, Scheduler, TaskStream
from sao.runtime.worker_host import quiet_transformers
from sao.trainer.batch import collate
from sao.trainer.learner import Learner
from sao.types import SamplingParams, Trajectory


class ParityError(RuntimeError):
    """Engine and trainer disagree on log-probs: training on such data would be silently wrong."""


@dataclass
class RunResult:
    run_dir: str
    accuracy_before: float
    accuracy_after: float
    steps: int
    wall_s: float
    extra: dict = field(default_factory=dict)


def limits_of(cfg: Config) -> EpisodeLimits:
    r = cfg.rollout
    return EpisodeLimits(r.max_turns, r.max_action_tokens, r.max_episode_tokens, r.step_timeout_s)


def generate_batch(engine, environment, codec, tasks, limits, n: int, params: SamplingParams,
                   trainer_step: int = 0) -> list[Trajectory]:
    """Run n episodes concurrently on one engine (sync mode and the parity gate)."""
    from sao.envs.base import EpisodeContext

    async def go():
        try:
            return await asyncio.gather(*(
                run_episode(environment.new_episode(EpisodeContext(engine.version, trainer_step)),
                            next(tasks), engine, codec, params, limits) for _ in range(n)))
        finally:
            await engine.close()

    return asyncio.run(go())


def usable_batch(engine, environment, codec, tasks, limits, n: int, trainer_step: int = 0, queue=None
                 ) -> tuple[list[Trajectory], int]:
    """n trainable episodes (generating more while some fail or are empty) and the number that failed.
    `queue` (sao/runtime/groups.py make_queue) decides what is usable: whole groups for group algorithms."""
    queue = queue if queue is not None else TrajectoryQueue()
    failed_before = sum(queue.failed.values())
    while True:
        if len(queue) < n:
            for traj in generate_batch(engine, environment, codec, tasks, limits, n - len(queue), SamplingParams(),
                                       trainer_step):
                queue.put(traj)
        batch, _ = queue.get_batch(n, engine.version, max_lag=1 << 30)  # one version: nothing is stale
        if batch:
            return batch, sum(queue.failed.values()) - failed_before


def parity_check(trainer_model, engine_model, codec, environment, limits, tol: float, n: int = 16,
                 seed: int = 0, dtype: torch.dtype = torch.float32) -> float:
    """Max |engine log-prob - trainer log-prob| over sampled action tokens; raises above `tol`.

    The engine model is a separate instance that received the trainer's weights through the same
    transport the rollout process uses, so the check covers weight transfer as well as numerics.
    """
    engine = TorchEngine(engine_model, codec.tokenizer.pad_token_id, max_batch=n, seed=seed, dtype=dtype)
    tasks = itertools.cycle(environment.eval_tasks(n))  # a small held-out set may hold fewer than n
    trajs = [t for t in generate_batch(engine, environment, codec, tasks, limits, n, SamplingParams())
             if t.num_action_tokens]
    batch = to_device(collate(trajs, codec.tokenizer.pad_token_id), next(trainer_model.parameters()).device)
    with torch.no_grad(), autocast(batch.input_ids.device, dtype):
        logprobs = sequence_logprobs(trainer_model, batch.input_ids, batch.attention_mask)
    diff = float(((logprobs - batch.behavior_logprobs).abs() * batch.action_mask).max())
    if not diff <= tol:
        raise ParityError(f"parity gate: engine and trainer log-probs differ by {diff:.2e} "
                          f"> runtime.parity_tol={tol:g}; refusing to train")
    return diff


def engine_copy(trainer: Trainer):
    """A fresh engine-side model loaded from disk, then given the trainer's weights as the one flat
    buffer every backend publishes."""
    model = load_model(trainer.model_path).to(trainer.device)
    flat, offset = flatten(engine_parameters(trainer.actor)), 0  # merged weights for a LoRA actor
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
    return model


class Trainer:
    """Holds what a run needs and the per-step bookkeeping shared by async and sync loops."""

    def __init__(self, cfg: Config, progress: RunProgress, resume: Path | None = None):
        self.cfg, self.progress = cfg, progress
        self.setup: dict = {}
        self.algo = get_algorithm(cfg.algo.name)
        self.environment = preflight(cfg, resume=resume)  # bad input fails before anything is written
        self.limits = limits_of(cfg)
        ckpt = checkpoint.latest(resume) if resume is not None else None
        if resume is not None:
            # a LoRA run saved adapters: engines and the actor start from the base model they sit on
            self.model_path = Path(adapter_base(ckpt / "actor") or ckpt / "actor")
            if not (self.model_path / "config.json").is_file():
                raise ConfigError(f"--resume: {ckpt / 'actor'} is an adapter on {self.model_path}, which is gone")
            self.run = RunDir(resume, cfg)
        else:
            self.run = RunDir.create(cfg)
            t0 = time.perf_counter()
            self.model_path, built = prepare_base_model(cfg, on_step=progress.sft_callback(cfg.sft.steps))
            self.setup = {"sft_built": built, "sft_s": time.perf_counter() - t0}  # summary.json: first-run cost
        self.codec = ChatCodec(load_tokenizer(self.model_path))
        # engine.device / engine.dtype: the trainer and the torch engines run there (sao/device.py)
        self.device, self.dtype = resolve_device(cfg.engine.device), resolve_dtype(cfg.engine.dtype)
        actor = load_model(self.model_path).to(self.device)
        if ckpt is not None and adapter_base(ckpt / "actor"):
            self.actor = resume_lora(actor, ckpt / "actor")
        else:
            self.actor = with_lora(actor, cfg.model.lora)  # lora.r=0: the model itself
        self.critic = None
        if self.algo.uses_critic:
            critic_path = ckpt / "critic" if ckpt is not None else cfg.critic.path
            if critic_path and adapter_base(critic_path):  # a LoRA critic's adapter (a checkpoint, or pretrained)
                self.critic = load_lora_critic(critic_path, self.device)
            else:
                critic = load_critic(critic_path) if critic_path else build_critic(self.model_path)
                self.critic = with_lora(critic.to(self.device), cfg.critic.lora, value_head=True)
        self.learner = Learner(self.actor, self.critic, self.algo, cfg.algo, cfg.critic, cfg.train, dtype=self.dtype)
        self.eval_tasks = self.environment.eval_tasks(cfg.eval.num_tasks)
        self.totals = {"dropped_stale": 0, "failed": 0, "wait_s": 0.0, "checkpoint_s": 0.0}
        self.step, self.unpublished, self.queue = 0, 0, make_queue(self.algo, cfg)  # whole groups for grpo
        state = checkpoint.load_state(ckpt) if ckpt is not None else None
        if state is not None:
            checkpoint.restore(self, state)  # truncates metrics/audit before they are appended to
        self.sched_state = state["scheduler"] if state else {}
        self.tasks = TaskStream(task_stream(self.environment, self.algo, cfg), self.sched_state.get("cursor", 0))
        self.audit = Audit(self.run.path / "audit.jsonl") if cfg.runtime.mode == "async" else None
        if self.audit is not None and state is not None:
            self.audit.note("resumed", self.step, checkpoint=ckpt.name)
        self.scheduler: Scheduler | None = None
        self.stop_requested = ""  # the signal's name once Ctrl-C or SIGTERM arrived

    def evaluate(self, step: int) -> float:
        torch.set_num_threads(max(self.cfg.runtime.trainer_threads, self.cfg.runtime.rollout_threads))
        t0 = time.perf_counter()
        res = evaluate(self.actor, self.codec, self.environment, self.eval_tasks, self.limits,
                       greedy=self.cfg.eval.greedy, seed=self.cfg.train.seed, version=self.learner.actor_version,
                       trainer_step=step)
        torch.set_num_threads(self.cfg.runtime.trainer_threads)
        row = {"eval/accuracy": res.accuracy, **{f"eval/{k}": v for k, v in res.metrics.items()},
               "eval/wall_s": time.perf_counter() - t0}  # lets `sao bench` take evaluations out of wall-clock
        self.run.log(step, row)
        self.run.write_trajectories(step, res.trajectories[: self.cfg.output.trajectories_per_dump],
                                    self.codec.decode, prefix="eval_step")
        self.progress.set_eval(res.accuracy, step=step)
        return res.accuracy

    def after_step(self, step: int, batch: list[Trajectory], version: int, metrics: dict, extra: dict) -> None:
        cfg = self.cfg
        self.step = step
        metrics.update(rollout_metrics(batch, version))
        metrics.update(extra)
        self._check_live_parity(metrics)
        metrics["async/dropped_stale_total"] = self.totals["dropped_stale"]
        metrics["async/failed_episodes_total"] = self.totals["failed"]
        metrics["async/env_error_episodes_total"] = self.queue.failed.get("env_error", 0)  # env faults, not the model's
        metrics["train/actor_version"] = self.learner.actor_version
        self.run.log(step, metrics)
        if step % cfg.output.trajectories_every == 0:
            self.run.write_trajectories(step, batch[: cfg.output.trajectories_per_dump], self.codec.decode)
        self.progress.step(metrics)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
            self.evaluate(step)
        if cfg.output.save_every and step % cfg.output.save_every == 0 and step < cfg.train.steps:  # final follows
            self.save(f"step_{step:06d}")

    def save(self, tag: str) -> Path:
        t0 = time.perf_counter()
        path = checkpoint.save(self, tag, self.step)
        self.totals["checkpoint_s"] += time.perf_counter() - t0  # in summary.json: what checkpoints cost the run
        return path

    def save_at_exit(self, tag: str) -> Path:
        """The last checkpoint; the audit says which episodes it carries over, so they are not taken for lost."""
        if self.audit is not None and self.scheduler is not None:
            self.audit.write("unfinished_at_exit", self.scheduler.pending(), self.step, checkpoint=tag)
            self.audit.write("queued_at_exit", self.queue.items(), self.step, checkpoint=tag)
        return self.save(tag)

    def _check_live_parity(self, metrics: dict) -> None:
        """The step-2 gate runs the torch engine; another engine (vLLM) is gated here instead, on the
        first batch holding tokens it sampled with the weights the trainer holds (usually step 1)."""
        diff = metrics.get("parity/live_max_abs_diff")
        if diff is None or self.cfg.engine.name == "torch" or getattr(self, "_live_parity_checked", False):
            return
        self._live_parity_checked = True
        if not diff <= self.cfg.runtime.parity_tol:
            raise ParityError(f"parity gate: engine.name={self.cfg.engine.name} and trainer log-probs differ by "
                              f"{diff:.2e} on {int(metrics['parity/live_tokens'])} tokens of the same weights "
                              f"> runtime.parity_tol={self.cfg.runtime.parity_tol:g}; refusing to train on")


class _Signals:
    """Ctrl-C and SIGTERM ask the loop to stop at the next step boundary (sao/runtime/loop.py
    `check_stop`), so the checkpoint written then is consistent; a second one interrupts at once."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.trainer.stop_requested:
            raise KeyboardInterrupt
        self.trainer.stop_requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _before_accuracy(trainer: Trainer) -> float:
    """On resume, the step-0 evaluation is already in metrics.jsonl."""
    for line in open(trainer.run.path / "metrics.jsonl"):
        row = json.loads(line)
        if row["step"] == 0 and "eval/accuracy" in row:
            return row["eval/accuracy"]
    return float("nan")


def issue_ahead(r) -> int:
    """Batches the rollout side may run ahead of the trainer: runtime.issue_ahead, within max_lag, and
    at least sync_every - 1 (pacing room only grows when weights are published)."""
    return min(r.max_lag, max(r.issue_ahead, r.sync_every - 1))


def train(cfg: Config, progress: RunProgress, resume: str | Path | None = None) -> RunResult:
    quiet_transformers()
    if cfg.runtime.mode == "async" and cfg.runtime.backend == "local":
        from sao.runtime.prewarm import prewarm

        prewarm()  # no-op when the CLI started it already
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(cfg.runtime.trainer_threads + cfg.runtime.rollout_threads)  # SFT has both cores
    t_start = time.perf_counter()
    trainer = Trainer(cfg, progress, Path(resume) if resume else None)  # step 1
    torch.set_num_threads(cfg.runtime.trainer_threads)
    progress.log(f"run directory: {trainer.run.path}")
    backend = None
    signals = _Signals(trainer).__enter__()
    try:
        if cfg.runtime.mode == "async":  # the workers pay their start-up while steps 2-3 run
            backend = make_backend(cfg, str(trainer.model_path), trainer.limits)
            backend.start(engine_parameters(trainer.actor), trainer.learner.actor_version)
            trainer.scheduler = Scheduler(backend, trainer.tasks, trainer.audit, cfg.train.batch_size,
                                          cfg.runtime.max_lag, trainer.sched_state, ahead=issue_ahead(cfg.runtime))
            trainer.scheduler.fill(trainer.step)
        diff = parity_check(trainer.actor, engine_copy(trainer), trainer.codec, trainer.environment,  # step 2
                            trainer.limits, cfg.runtime.parity_tol, seed=cfg.train.seed, dtype=trainer.dtype)
        trainer.run.log(trainer.step, {"parity/max_abs_diff": diff})
        before = trainer.evaluate(0) if trainer.step == 0 else _before_accuracy(trainer)  # step 3
        if backend is None and cfg.engine.name != "torch":
            progress.log(f"runtime.mode=sync generates with the trainer's own model (torch engine); "
                         f"engine.name={cfg.engine.name} serves the async rollout workers")
        progress.start_training(cfg.train.steps)
        run_async(trainer, backend) if backend is not None else run_sync(trainer)  # step 4
    except Interrupted:
        progress.stop_training()
        _stop(backend, trainer)
        ckpt = trainer.save_at_exit(f"step_{trainer.step:06d}")
        print(f"sao: {trainer.stop_requested}: checkpoint {ckpt} written; continue with "
              f"`sao train --resume {trainer.run.path}`", file=sys.stderr)
        raise KeyboardInterrupt from None
    except WriteError as exc:
        _stop(backend, trainer)
        ckpt = checkpoint.latest(trainer.run.path)
        raise WriteError(f"{exc}; " + (f"its latest checkpoint {ckpt.name} is intact: after freeing space, "
                                       f"`sao train --resume {trainer.run.path}`" if ckpt else
                                       "it has no checkpoint yet")) from None
    except BaseException:
        _stop(backend, trainer)
        raise
    finally:
        signals.__exit__()
        progress.stop_training()
    _stop(backend, trainer)
    after = trainer.evaluate(trainer.step)  # step 5
    ckpt = trainer.save_at_exit("final")
    wall = time.perf_counter() - t_start
    result = RunResult(str(trainer.run.path), before, after, trainer.step, wall,
                       {"checkpoint": str(ckpt), "parity_max_abs_diff": diff, **trainer.totals, **trainer.setup})
    trainer.run.write_json("summary.json", result.__dict__)
    trainer.run.close()
    return result


def _stop(backend, trainer: Trainer) -> None:
    """Stop the workers and record what was in flight (resume runs it again) or queued."""
    if backend is not None:
        backend.stop()
