"""The training loops: the one async loop (over any Backend) and the sync loop (for comparison).

    async, each step:  receive until B usable trajectories are queued  (the scheduler issues work meanwhile)
                       a critic on its own process: hand it the next batch now if it is queued (look_ahead)
                       trainer.step(batch)
                       publish when pacing says so (sao/runtime/pacing.py): room to issue grows
    sync, each step:   generate B episodes with the current weights, then train
    both:              `finish_step` logs, dumps trajectories, evaluates and checkpoints on schedule
"""

from __future__ import annotations

import time

from sao.errors import RunStopped
from sao.runtime.episodes import usable_batch
from sao.runtime.queue import drop_reason, queue_age_s
from sao.runtime.threads import adaptive_threads
from sao.trainer.batch import collate
from sao.types import Trajectory


class StalledError(RunStopped):
    """Nothing arrived from the rollout workers for `runtime.receive_timeout_s` seconds."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived; raised at a step boundary so the checkpoint is consistent."""


def check_stop(ctx) -> None:
    if ctx.stop_requested:
        raise Interrupted(ctx.stop_requested)


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


def traced_rows(cfg, step: int) -> int:
    """Rows of step `step`'s batch whose per-token values the trainer records: on the steps that dump
    trajectories, the first `output.trace_trajectories` of those dumped (sao/trainer/trace.py)."""
    if step % cfg.output.trajectories_every:
        return 0
    return min(cfg.output.trace_trajectories, cfg.output.trajectories_per_dump)


def finish_step(ctx, step: int, batch: list[Trajectory], version: int, metrics: dict, evaluate) -> None:
    """Log the step's row (and the run's totals), dump trajectories, evaluate and checkpoint on schedule."""
    cfg = ctx.cfg
    trace = metrics.pop("trace", None)  # what the trainer computed per token (traced_rows)
    ctx.step = step
    metrics.update(rollout_metrics(batch, version))
    ctx.live_parity(metrics)
    metrics["async/dropped_stale_total"] = ctx.totals["dropped_stale"]
    metrics["async/failed_episodes_total"] = ctx.totals["failed"]
    metrics["async/env_error_episodes_total"] = ctx.queue.failed.get("env_error", 0)  # env faults, not the model's
    if hasattr(ctx.queue, "dropped_group"):  # usable group members dropped with a failed mate
        metrics["async/dropped_group_total"] = ctx.queue.dropped_group
    metrics["train/actor_version"] = ctx.trainer.version
    warning = ctx.critic_watch.update(metrics, cfg.critic.warn_low_ev_steps, step)
    if warning:
        ctx.progress.warn(warning)
    ctx.rollout_watch.trained(batch, step)
    ctx.run.log(step, metrics)
    if step % cfg.output.trajectories_every == 0:
        ctx.run.write_trajectories(step, batch[: cfg.output.trajectories_per_dump], ctx.codec.decode)
    if trace:
        ctx.run.write_traces(step, batch, trace, ctx.codec.decode, cfg.algo.name, version)
    ctx.progress.step(metrics)
    if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
        evaluate(step)
    if cfg.output.save_every and step % cfg.output.save_every == 0 and step < cfg.train.steps:  # final follows
        ctx.save(f"step_{step:06d}")


def next_batch(ctx, backend, step: int, version: int) -> tuple[list[Trajectory], float]:
    """Receive until B trainable trajectories within the lag bound are queued; never waits unboundedly."""
    cfg, sched, queue = ctx.cfg, ctx.scheduler, ctx.queue
    t0 = last = time.perf_counter()
    while True:
        batch, dropped = queue.get_batch(cfg.train.batch_size, version, cfg.runtime.max_lag)
        sched.dropped(dropped, step, getattr(queue, "drop_reason", drop_reason))  # GroupQueue knows more
        if batch:
            return batch, time.perf_counter() - t0
        check_stop(ctx)
        sched.fill(step - 1)
        if sched.handle(backend.receive(timeout=1.0), queue, step):
            last = time.perf_counter()
        elif time.perf_counter() - last > cfg.runtime.receive_timeout_s:
            raise StalledError(f"no trajectory arrived for {cfg.runtime.receive_timeout_s:g}s "
                               f"(runtime.receive_timeout_s) with {len(sched.outstanding)} episodes issued to "
                               f"{backend.workers} rollout worker(s); stopping")


def look_ahead(ctx, backend, step: int, version: int, current, handed: bool):
    """critic.placement=separate: if the next batch is already queued, hand it to the trainer now, so its
    critic runs steps 1-3 on it while the actor steps on `current` (sao/trainer/critic_ranks.py). Never
    waits; never before a checkpoint (which holds both sides at one step boundary) or the last step.
    The batch trains at the next policy version, so its lag bound is checked against that one."""
    cfg, trainer, queue = ctx.cfg, ctx.trainer, ctx.queue
    saves = cfg.output.save_every and step % cfg.output.save_every == 0
    if not trainer.looks_ahead or step >= cfg.train.steps or saves or ctx.stop_requested:
        return None
    ctx.scheduler.handle(backend.receive(timeout=0.0), queue, step)
    batch, dropped = queue.get_batch(cfg.train.batch_size, version + 1, cfg.runtime.max_lag)
    ctx.scheduler.dropped(dropped, step, getattr(queue, "drop_reason", drop_reason))
    if not batch:
        return None
    if not handed:
        trainer.look_ahead(current)  # the critic takes batches in order: this one first
    collated = collate(batch, ctx.codec.tokenizer.pad_token_id)
    collated.trace_rows = traced_rows(cfg, step + 1)
    trainer.look_ahead(collated)
    return batch, collated


def async_perf(ctx, wait_s: float, wall: float, sync_ms: float) -> dict:
    sched = ctx.scheduler
    ws = sched.worker_totals()  # workers report their counters about once a second
    return {
        "async/trainer_wait_s": wait_s,
        "async/trainer_idle_frac": ctx.totals["wait_s"] / wall,
        "async/rollout_idle_frac": 1.0 - ws["busy_s"] / max(ws["wall_s"], 1e-9) if ws["wall_s"] else 0.0,
        "async/engine_version": float(ws["version"]),
        "async/worker_restarts_total": float(sched.lost),
        "rollout/hung_steps": float(ws["hung_steps"]),
        "rollout/engine_errors_total": float(ws["engine_errors"]),
        "rollout/engine_restarts_total": float(ws["engine_restarts"]),
        "perf/tokens_per_s": ws["tokens"] / max(ws["wall_s"] / max(len(sched.stats), 1), 1e-9),
        "perf/engine_tokens_per_s": ws["tokens"] / max(ws["busy_s"], 1e-9),
        "perf/weight_sync_ms": sync_ms,
        "perf/wall_s": wall,
    }


def run_async(ctx, backend, evaluate) -> None:
    """Take the next B finished trajectories, train, publish when pacing says so."""
    cfg, trainer, sched, pacing = ctx.cfg, ctx.trainer, ctx.scheduler, ctx.pacing
    t_start, sync_ms = time.perf_counter(), 0.0
    threads = adaptive_threads(cfg.runtime, backend, ctx.progress.log)
    if threads is not None:
        trainer.before_pass = threads
    ahead = None  # (trajectories, collated): the next batch, handed to the trainer early
    for step in range(ctx.step + 1, cfg.train.steps + 1):
        version = trainer.version  # the policy this batch updates; lag is measured against it
        if ahead is not None:  # its critic updates are done: it is trained before any stop
            (batch, collated), ahead, wait_s = ahead, None, 0.0
        else:
            check_stop(ctx)
            (batch, wait_s), collated = next_batch(ctx, backend, step, version), None
        ctx.totals["wait_s"] += wait_s
        if cfg.runtime.rollout_only:  # the rollout side alone: the batch is counted, not trained on
            metrics = {"reward/mean": sum(t.reward for t in batch) / len(batch)}
        else:
            handed = collated is not None
            if not handed:
                collated = collate(batch, ctx.codec.tokenizer.pad_token_id)
                collated.trace_rows = traced_rows(cfg, step)
            ahead = look_ahead(ctx, backend, step, version, collated, handed)
            metrics = trainer.step(collated)
            if trainer.looks_ahead:
                metrics["async/critic_ahead"] = float(handed)  # this batch's critic ran during the last step
        if threads is not None:
            metrics.update(threads.end_step())
        sched.trained(batch, step)
        published = pacing.step_done(version, trainer.version)
        if published:
            sync_ms = backend.publish(trainer.export_weights(), trainer.version)
        metrics["async/published"] = float(published)  # marked on the curves of `sao view`
        sched.fill(step)  # keep the workers busy while this step is logged (and the next trains)
        ctx.totals.update(dropped_stale=ctx.queue.dropped_stale, failed=sum(ctx.queue.failed.values()))
        metrics.update(async_perf(ctx, wait_s, time.perf_counter() - t_start, sync_ms))
        finish_step(ctx, step, batch, version, metrics, evaluate)


def run_sync(ctx, evaluate) -> None:
    """Generate B episodes with the current weights (a copy given them each step), then train on them;
    no overlap. Each phase gets the threads that suit it (sao/runtime/threads.py)."""
    cfg, trainer = ctx.cfg, ctx.trainer
    pad_id = ctx.codec.tokenizer.pad_token_id
    policy = ctx.policy_copy()
    engine = policy.engine(pad_id, max_batch=cfg.rollout.concurrency, seed=cfg.train.seed + 1)
    t_start, gen_total, train_total = time.perf_counter(), 0.0, 0.0
    for step in range(ctx.step + 1, cfg.train.steps + 1):
        check_stop(ctx)
        ctx.threads.generate()
        t0 = time.perf_counter()
        policy.load(trainer.export_weights())
        version = engine.version = trainer.version
        batch, failed = usable_batch(engine, ctx.environment, ctx.codec, ctx.tasks, ctx.limits,
                                     cfg.train.batch_size, trainer_step=step - 1, queue=ctx.queue,
                                     watch=ctx.rollout_watch)
        ctx.totals["failed"] += failed
        gen_s = time.perf_counter() - t0
        ctx.threads.train_alone()
        t1 = time.perf_counter()
        collated = collate(batch, pad_id)
        collated.trace_rows = traced_rows(cfg, step)
        metrics = trainer.step(collated)
        train_s = time.perf_counter() - t1
        gen_total, train_total = gen_total + gen_s, train_total + train_s
        metrics.update({"perf/gen_s": gen_s, "perf/train_s": train_s, "perf/gen_total_s": gen_total,
                        "perf/train_total_s": train_total, "perf/wall_s": time.perf_counter() - t_start,
                        "perf/tokens_per_s": sum(t.num_action_tokens for t in batch) / gen_s,
                        "perf/weight_sync_ms": 0.0, "async/trainer_idle_frac": gen_total / (gen_total + train_total),
                        "async/rollout_idle_frac": train_total / (gen_total + train_total)})
        finish_step(ctx, step, batch, version, metrics, evaluate)
