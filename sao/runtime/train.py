"""`sao train`: the whole run, top to bottom.

    step 1  run directory, environment, starting policy (cached SFT warm start), critic
    step 2  parity gate: engine and trainer log-probs agree on the same tokens and weights
    step 3  held-out evaluation of the starting policy
    step 4  the loop: async (rollout process + trainer) or sync (generate a batch, then train)
    step 5  final evaluation, checkpoints, summary
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field

import torch

from sao.algo.registry import get_algorithm
from sao.config import Config
from sao.engine.torch_engine import TorchEngine
from sao.models.actor import sequence_logprobs
from sao.models.chat import ChatCodec
from sao.models.critic import build_critic, load_critic
from sao.models.tiny import load_model
from sao.models.tokenizer import load_tokenizer
from sao.rollout.agent_loop import EpisodeLimits, run_episode
from sao.runtime.evaluate import evaluate
from sao.runtime.local import RolloutProcess, WorkerSpec, quiet_transformers
from sao.runtime.model_setup import prepare_base_model
from sao.runtime.preflight import preflight
from sao.runtime.progress import RunProgress
from sao.runtime.queue import Pacer, TrajectoryQueue, queue_age_s
from sao.runtime.run_dir import RunDir
from sao.runtime.weight_sync import SharedWeights
from sao.trainer.batch import collate
from sao.trainer.learner import Learner
from sao.types import TRAINABLE, SamplingParams, Trajectory


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


def usable_batch(engine, environment, codec, tasks, limits, n: int, trainer_step: int = 0) -> tuple[list[Trajectory], int]:
    """n trainable episodes (generating more while some fail or are empty) and the number that failed."""
    batch: list[Trajectory] = []
    failed = 0
    while len(batch) < n:
        got = generate_batch(engine, environment, codec, tasks, limits, n - len(batch), SamplingParams(), trainer_step)
        usable = [t for t in got if t.status in TRAINABLE and t.num_action_tokens]
        failed += len(got) - len(usable)
        batch += usable
    return batch, failed


def parity_check(trainer_model, engine_model, codec, environment, limits, tol: float, n: int = 16,
                 seed: int = 0) -> float:
    """Max |engine log-prob - trainer log-prob| over sampled action tokens; raises above `tol`.

    The engine model is a separate instance that received the trainer's weights through the same
    transport the rollout process uses, so the check covers weight transfer as well as numerics.
    """
    engine = TorchEngine(engine_model, codec.tokenizer.pad_token_id, max_batch=n, seed=seed)
    tasks = itertools.cycle(environment.eval_tasks(n))  # a small held-out set may hold fewer than n
    trajs = [t for t in generate_batch(engine, environment, codec, tasks, limits, n, SamplingParams())
             if t.num_action_tokens]
    batch = collate(trajs, codec.tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = sequence_logprobs(trainer_model, batch.input_ids, batch.attention_mask)
    diff = float(((logprobs - batch.behavior_logprobs).abs() * batch.action_mask).max())
    if not diff <= tol:
        raise ParityError(f"parity gate: engine and trainer log-probs differ by {diff:.2e} "
                          f"> runtime.parity_tol={tol:g}; refusing to train")
    return diff


def engine_copy(trainer: Trainer):
    """A fresh engine-side model loaded from disk, then given the trainer's weights via shared memory."""
    model = load_model(trainer.model_path)
    weights = SharedWeights.for_model(trainer.actor)
    weights.publish(list(trainer.actor.parameters()), 0)
    weights.load_into([p.data for p in model.parameters()])
    return model


def rollout_metrics(batch: list[Trajectory], version: int) -> dict[str, float]:
    lags = [t.lag(version) for t in batch]
    m = {
        "async/lag_mean": sum(lags) / len(lags),
        "async/lag_max": float(max(lags)),
        "async/queue_age_s": queue_age_s(batch),
        "rollout/action_tokens_mean": sum(t.num_action_tokens for t in batch) / len(batch),
        "rollout/turns_mean": sum(t.turns for t in batch) / len(batch),
        "rollout/truncated_frac": sum(t.status.value == "truncated" for t in batch) / len(batch),
        "async/versions_per_traj": sum(len({v for v in t.token_versions if v >= 0}) for t in batch) / len(batch),
    }
    for k in sorted({k for t in batch for k in t.metrics}):
        m[f"env/{k}"] = sum(t.metrics.get(k, 0.0) for t in batch) / len(batch)
    return m


class Trainer:
    """Holds what a run needs and the per-step bookkeeping shared by async and sync loops."""

    def __init__(self, cfg: Config, progress: RunProgress):
        self.cfg, self.progress = cfg, progress
        self.algo = get_algorithm(cfg.algo.name)
        self.environment = preflight(cfg)  # every check that can fail on bad input, before anything is written
        self.run = RunDir.create(cfg)
        self.limits = limits_of(cfg)
        self.model_path, _ = prepare_base_model(cfg, on_step=progress.sft_callback(cfg.sft.steps))
        self.codec = ChatCodec(load_tokenizer(self.model_path))
        self.actor = load_model(self.model_path)
        self.critic = None
        if self.algo.uses_critic:
            self.critic = load_critic(cfg.critic.path) if cfg.critic.path else build_critic(self.model_path)
        self.learner = Learner(self.actor, self.critic, self.algo, cfg.algo, cfg.critic, cfg.train)
        self.eval_tasks = self.environment.eval_tasks(cfg.eval.num_tasks)
        self.totals = {"dropped_stale": 0, "failed": 0, "wait_s": 0.0}

    def evaluate(self, step: int) -> float:
        torch.set_num_threads(max(self.cfg.runtime.trainer_threads, self.cfg.runtime.rollout_threads))
        res = evaluate(self.actor, self.codec, self.environment, self.eval_tasks, self.limits,
                       greedy=self.cfg.eval.greedy, seed=self.cfg.train.seed, version=self.learner.actor_version,
                       trainer_step=step)
        torch.set_num_threads(self.cfg.runtime.trainer_threads)
        row = {"eval/accuracy": res.accuracy, **{f"eval/{k}": v for k, v in res.metrics.items()}}
        self.run.log(step, row)
        self.run.write_trajectories(step, res.trajectories[: self.cfg.output.trajectories_per_dump],
                                    self.codec.decode, prefix="eval_step")
        self.progress.set_eval(res.accuracy)
        return res.accuracy

    def after_step(self, step: int, batch: list[Trajectory], version: int, metrics: dict, extra: dict) -> None:
        cfg = self.cfg
        metrics.update(rollout_metrics(batch, version))
        metrics.update(extra)
        metrics["async/dropped_stale_total"] = self.totals["dropped_stale"]
        metrics["async/failed_episodes_total"] = self.totals["failed"]
        metrics["train/actor_version"] = self.learner.actor_version
        self.run.log(step, metrics)
        if step % cfg.output.trajectories_every == 0:
            self.run.write_trajectories(step, batch[: cfg.output.trajectories_per_dump], self.codec.decode)
        if cfg.output.save_every and step % cfg.output.save_every == 0:
            self.save(f"step_{step:06d}", step)
        self.progress.step(metrics)

    def save(self, tag: str, step: int):
        return self.run.save_checkpoint(tag, self.actor, self.critic, self.codec.tokenizer,
                                        {"step": step, "actor_version": self.learner.actor_version,
                                         "critic_version": self.learner.critic_version})


def start_rollout(trainer: Trainer) -> tuple[RolloutProcess, SharedWeights]:
    """Spawn the rollout process with version-0 weights; it starts generating as soon as it is up."""
    cfg = trainer.cfg
    ctx = torch.multiprocessing.get_context("spawn")
    weights = SharedWeights.for_model(trainer.actor, ctx)
    weights.publish(list(trainer.actor.parameters()), 0)
    spec = WorkerSpec(str(trainer.model_path), cfg.env.name, cfg.env.options, cfg.train.seed, trainer.limits,
                      cfg.rollout.concurrency, cfg.runtime.rollout_threads, cfg.train.batch_size, cfg.runtime.max_lag)
    worker = RolloutProcess(spec, weights, ctx)
    worker.start()
    return worker, weights


def _async_perf(trainer: Trainer, worker: RolloutProcess, wait_s: float, wall: float, sync_ms: float) -> dict:
    ws = worker.stats  # the rollout process reports its engine counters about once a second
    return {
        "async/trainer_wait_s": wait_s,
        "async/trainer_idle_frac": trainer.totals["wait_s"] / wall,
        "async/rollout_idle_frac": 1.0 - ws.get("busy_s", 0.0) / max(ws.get("wall_s", 1.0), 1e-9),
        "async/engine_version": float(ws.get("version", 0)),
        "perf/tokens_per_s": ws.get("tokens", 0) / max(ws.get("wall_s", 1.0), 1e-9),
        "perf/engine_tokens_per_s": ws.get("tokens", 0) / max(ws.get("busy_s", 1.0), 1e-9),
        "perf/weight_sync_ms": sync_ms,
        "perf/wall_s": wall,
    }


def run_async(trainer: Trainer, worker: RolloutProcess, weights: SharedWeights) -> None:
    """Take the next B finished trajectories, train, publish every `sync_every` actor steps."""
    cfg, learner = trainer.cfg, trainer.learner
    pacer = Pacer(cfg.train.batch_size, cfg.runtime.max_lag, *worker.counters)
    queue = TrajectoryQueue()
    t_start, sync_ms, unpublished = time.perf_counter(), 0.0, 0
    for step in range(1, cfg.train.steps + 1):
        t_wait = time.perf_counter()
        version = learner.actor_version  # the policy this batch updates; lag is measured against it
        while True:
            batch, dropped = queue.get_batch(cfg.train.batch_size, version, cfg.runtime.max_lag)
            pacer.refund(len(dropped))
            if batch:
                break
            for traj in worker.receive(timeout=1.0):
                queue.put(traj)
        wait_s = time.perf_counter() - t_wait
        trainer.totals.update(wait_s=trainer.totals["wait_s"] + wait_s, dropped_stale=queue.dropped_stale,
                              failed=sum(queue.failed.values()))
        metrics = learner.step(collate(batch, trainer.codec.tokenizer.pad_token_id))
        worker.trainer_step.value = step
        unpublished += 1
        if learner.actor_version == version:  # critic warm-up: the policy did not change
            pacer.mark_consumed(unpublished)
            unpublished = 0
        elif learner.actor_version % cfg.runtime.sync_every == 0:
            sync_ms = weights.publish(list(trainer.actor.parameters()), learner.actor_version)
            pacer.mark_consumed(unpublished)
            unpublished = 0
        perf = _async_perf(trainer, worker, wait_s, time.perf_counter() - t_start, sync_ms)
        trainer.after_step(step, batch, version, metrics, perf)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
            trainer.evaluate(step)


def run_sync(trainer: Trainer) -> None:
    """Generate B episodes with the current weights, then train on them; no overlap. Each phase gets
    the thread count that suits it (decoding is overhead-bound: 1 thread; training uses both cores)."""
    cfg, learner = trainer.cfg, trainer.learner
    engine = TorchEngine(trainer.actor, trainer.codec.tokenizer.pad_token_id, max_batch=cfg.rollout.concurrency,
                         seed=cfg.train.seed + 1)
    tasks = trainer.environment.train_tasks()
    t_start, gen_total, train_total = time.perf_counter(), 0.0, 0.0
    for step in range(1, cfg.train.steps + 1):
        torch.set_num_threads(cfg.runtime.rollout_threads)
        version = engine.version = learner.actor_version
        t0 = time.perf_counter()
        batch, failed = usable_batch(engine, trainer.environment, trainer.codec, tasks, trainer.limits,
                                     cfg.train.batch_size, trainer_step=step - 1)
        trainer.totals["failed"] += failed
        gen_s = time.perf_counter() - t0
        torch.set_num_threads(cfg.runtime.trainer_threads + cfg.runtime.rollout_threads)  # nothing else runs now
        trainer.actor.train()
        t1 = time.perf_counter()
        metrics = learner.step(collate(batch, trainer.codec.tokenizer.pad_token_id))
        train_s = time.perf_counter() - t1
        gen_total, train_total = gen_total + gen_s, train_total + train_s
        extra = {"perf/gen_s": gen_s, "perf/train_s": train_s, "perf/gen_total_s": gen_total,
                 "perf/train_total_s": train_total, "perf/wall_s": time.perf_counter() - t_start,
                 "perf/tokens_per_s": sum(t.num_action_tokens for t in batch) / gen_s,
                 "perf/weight_sync_ms": 0.0, "async/trainer_idle_frac": gen_total / (gen_total + train_total),
                 "async/rollout_idle_frac": train_total / (gen_total + train_total)}
        trainer.after_step(step, batch, version, metrics, extra)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
            trainer.evaluate(step)


def train(cfg: Config, progress: RunProgress) -> RunResult:
    quiet_transformers()
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(cfg.runtime.trainer_threads + cfg.runtime.rollout_threads)  # SFT has both cores
    t_start = time.perf_counter()
    trainer = Trainer(cfg, progress)  # step 1
    torch.set_num_threads(cfg.runtime.trainer_threads)
    progress.log(f"run directory: {trainer.run.path}")
    diff = parity_check(trainer.actor, engine_copy(trainer), trainer.codec, trainer.environment,  # step 2
                        trainer.limits, cfg.runtime.parity_tol, seed=cfg.train.seed)
    trainer.run.log(0, {"parity/max_abs_diff": diff})
    # the rollout process pays its start-up (imports, model load: seconds) while step 3 runs
    rollout = start_rollout(trainer) if cfg.runtime.mode == "async" else None
    try:
        before = trainer.evaluate(0)  # step 3
        progress.start_training(cfg.train.steps)
        if rollout is not None:  # step 4
            run_async(trainer, *rollout)
        else:
            run_sync(trainer)
    finally:
        if rollout is not None:
            rollout[0].stop()
        progress.stop_training()
    after = trainer.evaluate(cfg.train.steps)  # step 5
    ckpt = trainer.save("final", cfg.train.steps)
    wall = time.perf_counter() - t_start
    result = RunResult(str(trainer.run.path), before, after, cfg.train.steps, wall,
                       {"checkpoint": str(ckpt), "parity_max_abs_diff": diff, **trainer.totals})
    trainer.run.write_json("summary.json", result.__dict__)
    trainer.run.close()
    return result
