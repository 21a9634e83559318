"""The training loops: the one async loop (over any Backend) and the sync loop (for comparison).

    async, each step:  receive until B usable trajectories are queued  (scheduler issues work meanwhile)
                       learner.step(batch)
                       publish every `sync_every` actor steps  (pacing room grows: issue more)
    sync, each step:   generate B episodes with the current weights (actor in eval mode), then train
"""

from __future__ import annotations

import time

import torch

from sao.models.lora import engine_parameters  # merged weights for a LoRA actor
from sao.runtime.queue import drop_reason, queue_age_s
from sao.runtime.threads import AdaptiveThreads
from sao.trainer.batch import collate
from sao.types import Trajectory


class StalledError(RuntimeError):
    """Nothing arrived from the rollout workers for `runtime.receive_timeout_s` seconds."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived; raised at a step boundary so the checkpoint is consistent."""


def check_stop(trainer) -> None:
    if trainer.stop_requested:
        raise Interrupted(trainer.stop_requested)


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


def next_batch(trainer, backend, step: int, version: int) -> tuple[list[Trajectory], float]:
    """Receive until B trainable trajectories within the lag bound are queued; never waits unboundedly."""
    cfg, sched, queue = trainer.cfg, trainer.scheduler, trainer.queue
    t0 = last = time.perf_counter()
    while True:
        batch, dropped = queue.get_batch(cfg.train.batch_size, version, cfg.runtime.max_lag)
        sched.dropped(dropped, step, getattr(queue, "drop_reason", drop_reason))  # GroupQueue knows more
        if batch:
            return batch, time.perf_counter() - t0
        check_stop(trainer)
        sched.fill(step - 1)
        if sched.handle(backend.receive(timeout=1.0), queue, step):
            last = time.perf_counter()
        elif time.perf_counter() - last > cfg.runtime.receive_timeout_s:
            raise StalledError(f"no trajectory arrived for {cfg.runtime.receive_timeout_s:g}s "
                               f"(runtime.receive_timeout_s) with {len(sched.outstanding)} episodes issued to "
                               f"{backend.workers} rollout worker(s); stopping")


def async_perf(trainer, wait_s: float, wall: float, sync_ms: float) -> dict:
    ws = trainer.scheduler.worker_totals()  # workers report their counters about once a second
    return {
        "async/trainer_wait_s": wait_s,
        "async/trainer_idle_frac": trainer.totals["wait_s"] / wall,
        "async/rollout_idle_frac": 1.0 - ws["busy_s"] / max(ws["wall_s"], 1e-9) if ws["wall_s"] else 0.0,
        "async/engine_version": float(ws["version"]),
        "async/worker_restarts_total": float(trainer.scheduler.lost),
        "rollout/hung_steps": float(ws["hung_steps"]),
        "rollout/engine_errors_total": float(ws["engine_errors"]),
        "perf/tokens_per_s": ws["tokens"] / max(ws["wall_s"] / max(len(trainer.scheduler.stats), 1), 1e-9),
        "perf/engine_tokens_per_s": ws["tokens"] / max(ws["busy_s"], 1e-9),
        "perf/weight_sync_ms": sync_ms,
        "perf/wall_s": wall,
    }


def adaptive_threads(trainer, backend) -> AdaptiveThreads | None:
    """The trainer takes the local workers' cores while none of them has an episode in flight."""
    r = trainer.cfg.runtime
    if not r.adaptive_threads or r.backend != "local":
        return None
    idle = r.trainer_threads + r.rollout_threads * r.rollout_workers
    trainer.progress.log(f"adaptive threads: trainer {r.trainer_threads} ({idle} with no episode in flight), "
                         f"workers {r.rollout_threads} each")  # under 80 columns: rich would wrap it mid-sentence
    return AdaptiveThreads(trainer, backend, r.trainer_threads, idle)


def run_async(trainer, backend) -> None:
    """Take the next B finished trajectories, train, publish every `sync_every` actor steps."""
    cfg, learner, sched = trainer.cfg, trainer.learner, trainer.scheduler
    t_start, sync_ms = time.perf_counter(), 0.0
    threads = adaptive_threads(trainer, backend)
    learner.before_pass = threads
    for step in range(trainer.step + 1, cfg.train.steps + 1):
        check_stop(trainer)
        version = learner.actor_version  # the policy this batch updates; lag is measured against it
        batch, wait_s = next_batch(trainer, backend, step, version)
        trainer.totals["wait_s"] += wait_s
        if cfg.runtime.rollout_only:  # the rollout side alone: the batch is counted, not trained on
            metrics = {"reward/mean": sum(t.reward for t in batch) / len(batch)}
        else:
            metrics = learner.step(collate(batch, trainer.codec.tokenizer.pad_token_id))
        if threads is not None:
            metrics.update(threads.end_step())
        sched.trained(batch, step)
        trainer.unpublished += 1
        if learner.actor_version == version:  # critic warm-up: the policy did not change
            sched.consumed += trainer.unpublished
            trainer.unpublished = 0
        elif learner.actor_version % cfg.runtime.sync_every == 0:
            sync_ms = backend.publish(engine_parameters(trainer.actor), learner.actor_version)
            sched.consumed += trainer.unpublished
            trainer.unpublished = 0
        sched.fill(step)  # keep the workers busy while this step is logged (and the next trains)
        trainer.totals.update(dropped_stale=trainer.queue.dropped_stale, failed=sum(trainer.queue.failed.values()))
        perf = async_perf(trainer, wait_s, time.perf_counter() - t_start, sync_ms)
        trainer.after_step(step, batch, version, metrics, perf)


def run_sync(trainer) -> None:
    """Generate B episodes with the current weights, then train on them; no overlap. Each phase gets
    the thread count that suits it (decoding is overhead-bound: 1 thread; training uses both cores)."""
    from sao.engine.torch_engine import TorchEngine
    from sao.runtime.train import usable_batch

    cfg, learner = trainer.cfg, trainer.learner
    engine = TorchEngine(trainer.actor, trainer.codec.tokenizer.pad_token_id, max_batch=cfg.rollout.concurrency,
                         seed=cfg.train.seed + 1)
    tasks = trainer.tasks
    t_start, gen_total, train_total = time.perf_counter(), 0.0, 0.0
    for step in range(trainer.step + 1, cfg.train.steps + 1):
        check_stop(trainer)
        torch.set_num_threads(cfg.runtime.rollout_threads)
        version = engine.version = learner.actor_version
        trainer.actor.eval()  # generation runs without dropout; the learner switches back to train()
        t0 = time.perf_counter()
        batch, failed = usable_batch(engine, trainer.environment, trainer.codec, tasks, trainer.limits,
                                     cfg.train.batch_size, trainer_step=step - 1, queue=trainer.queue)
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
