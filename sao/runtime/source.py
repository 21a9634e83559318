"""Where the training loop's batches come from (sao/runtime/loop.py takes one of these).

    AsyncSource   the rollout workers (a Backend), who runs what (the Scheduler, with the audit) and the
                  finished trajectories (the queue); `next` receives until B usable ones are queued
    SyncSource    one engine in this process on a copy of the current weights: generate B, then train

Both own the queue, so the dropped, failed and stale counts are theirs (`counts`), and say what the
rollout side did in a step's metrics.
"""

from __future__ import annotations

import time

from sao.errors import RunStopped
from sao.runtime.episodes import PolicyCopy, usable_batch
from sao.runtime.queue import Queue
from sao.runtime.scheduler import Scheduler
from sao.runtime.signals import StopFlag
from sao.runtime.threads import AdaptiveThreads, ThreadPlan
from sao.types import Trajectory


class StalledError(RunStopped):
    """Nothing arrived from the rollout workers for `runtime.receive_timeout_s` seconds."""


class AsyncSource:
    def __init__(self, backend, scheduler: Scheduler, queue: Queue, batch_size: int, max_lag: int, receive_timeout_s: float,
                 stop: StopFlag, threads: AdaptiveThreads | None = None):
        self.backend, self.scheduler, self.queue, self.stop = backend, scheduler, queue, stop
        self.batch_size, self.max_lag, self.receive_timeout_s = batch_size, max_lag, receive_timeout_s
        self.threads = threads  # the trainer's threads while no episode is in flight (sao/runtime/threads.py)
        self.wait_s = 0.0  # this process's time waiting for batches (Saver adds an earlier process's)
        self.t_start, self.sync_ms = time.perf_counter(), 0.0

    def _take(self, step: int, version: int) -> list[Trajectory]:
        batch, dropped = self.queue.get_batch(self.batch_size, version, self.max_lag)
        self.scheduler.dropped(dropped, step, self.queue.drop_reason)
        return batch

    def next(self, step: int, version: int) -> tuple[list[Trajectory], float]:
        """Receive until B trainable trajectories within the lag bound are queued; never waits unboundedly."""
        t0 = last = time.perf_counter()
        while not (batch := self._take(step, version)):
            self.stop.check()
            self.scheduler.fill(step - 1)
            if self.scheduler.handle(self.backend.receive(timeout=1.0), self.queue, step):
                last = time.perf_counter()
            elif time.perf_counter() - last > self.receive_timeout_s:
                raise StalledError(f"no trajectory arrived for {self.receive_timeout_s:g}s "
                                   f"(runtime.receive_timeout_s) with {len(self.scheduler.outstanding)} episodes "
                                   f"issued to {self.backend.workers} rollout worker(s); stopping")
        wait_s = time.perf_counter() - t0
        self.wait_s += wait_s
        return batch, wait_s

    def ready(self, step: int, version: int) -> list[Trajectory]:
        """The next batch if it is queued already (what arrived meanwhile counted); never waits."""
        self.scheduler.handle(self.backend.receive(timeout=0.0), self.queue, step)
        return self._take(step, version)

    def trained(self, batch: list[Trajectory], step: int) -> dict[str, float]:
        metrics = self.threads.end_step() if self.threads is not None else {}
        self.scheduler.trained(batch, step)
        return metrics

    def publish(self, weights, version: int) -> None:
        self.sync_ms = self.backend.publish(weights, version)

    def step_done(self, step: int, wait_s: float) -> dict[str, float]:
        """Keep the workers busy while the step is logged (and the next trains); the step's rollout side."""
        self.scheduler.fill(step)
        ws = self.scheduler.worker_totals()  # workers report their counters about once a second
        wall = time.perf_counter() - self.t_start
        return {
            "async/trainer_wait_s": wait_s,
            "async/trainer_idle_frac": self.wait_s / wall,
            "async/rollout_idle_frac": 1.0 - ws["busy_s"] / max(ws["wall_s"], 1e-9) if ws["wall_s"] else 0.0,
            "async/engine_version": float(ws["version"]),
            "async/worker_restarts_total": float(self.scheduler.lost),
            "rollout/hung_steps": float(ws["hung_steps"]),
            "rollout/engine_errors_total": float(ws["engine_errors"]),
            "rollout/engine_restarts_total": float(ws["engine_restarts"]),
            "perf/tokens_per_s": ws["tokens"] / max(ws["wall_s"] / max(len(self.scheduler.stats), 1), 1e-9),
            "perf/engine_tokens_per_s": ws["tokens"] / max(ws["busy_s"], 1e-9),
            "perf/weight_sync_ms": self.sync_ms,
            "perf/wall_s": wall,
            **self.queue.counts(),
        }


class SyncSource:
    def __init__(self, policy: PolicyCopy, environment, codec, tasks, limits, queue: Queue, batch_size: int, seed: int,
                 max_batch: int, threads: ThreadPlan, watch=None):
        self.policy, self.environment, self.codec, self.tasks, self.limits = policy, environment, codec, tasks, limits
        self.queue, self.batch_size, self.threads, self.watch = queue, batch_size, threads, watch
        self.engine = policy.engine(codec.tokenizer.pad_token_id, max_batch=max_batch, seed=seed)
        self.t_start, self.gen_total, self.train_total, self.gen_s = time.perf_counter(), 0.0, 0.0, 0.0

    def next(self, step: int, weights, version: int) -> list[Trajectory]:
        """B trainable episodes generated now with `weights`; then the trainer has every core."""
        self.threads.generate()
        t0 = time.perf_counter()
        self.policy.load(weights)
        self.engine.version = version
        batch, _ = usable_batch(self.engine, self.environment, self.codec, self.tasks, self.limits, self.batch_size,
                                trainer_step=step - 1, queue=self.queue, watch=self.watch)
        self.gen_s = time.perf_counter() - t0
        self.threads.train_alone()
        return batch

    def step_done(self, batch: list[Trajectory], train_s: float) -> dict[str, float]:
        self.gen_total, self.train_total = self.gen_total + self.gen_s, self.train_total + train_s
        busy = self.gen_total + self.train_total
        return {"perf/gen_s": self.gen_s, "perf/train_s": train_s, "perf/gen_total_s": self.gen_total,
                "perf/train_total_s": self.train_total, "perf/wall_s": time.perf_counter() - self.t_start,
                "perf/tokens_per_s": sum(t.num_action_tokens for t in batch) / self.gen_s,
                "perf/weight_sync_ms": 0.0, "async/trainer_idle_frac": self.gen_total / busy,
                "async/rollout_idle_frac": self.train_total / busy, **self.queue.counts()}
