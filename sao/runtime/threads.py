"""Trainer threads that follow what the rollout side is doing (docs/performance.md).

On a few cores, decoding a small model is overhead-bound (one thread decodes as fast as two) while
training nearly doubles with a second thread. A fixed one-plus-one pin leaves a core idle whenever
the rollout side is paced (the usual state of a trainer-bound run), so:

    episodes in flight on local workers  ->  the trainer uses runtime.trainer_threads
    none in flight                       ->  it also takes the workers' threads (every core)

The trainer-side scheduler issues every episode, so "in flight" is exact: between its model passes
the learner calls this policy, which drains what the backend has delivered (non-blocking) and sets
the thread count. While a step trains, nothing new is issued (pacing room only grows when a step
publishes), so an idle rollout side stays idle until the step ends.
"""

from __future__ import annotations

import time

import torch


class AdaptiveThreads:
    """`policy()` before each pass; `metrics()` once per step (threads used, share of time at max)."""

    def __init__(self, trainer, backend, own: int, idle: int):
        self.trainer, self.backend = trainer, backend
        self.own, self.idle = own, idle
        self.current = torch.get_num_threads()
        self.since = time.perf_counter()
        self.time_at = {own: 0.0, idle: 0.0}

    def _set(self, n: int) -> None:
        now = time.perf_counter()
        self.time_at[self.current] = self.time_at.get(self.current, 0.0) + now - self.since
        self.since = now
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n

    def __call__(self) -> None:
        sched = self.trainer.scheduler
        sched.handle(self.backend.receive(timeout=0), self.trainer.queue, self.trainer.step + 1)
        self._set(self.own if sched.outstanding else self.idle)

    def end_step(self) -> dict[str, float]:
        """Back to the trainer's own threads (receiving and logging need no more); the step's figures."""
        self._set(self.own)
        total = sum(self.time_at.values()) or 1.0
        out = {"perf/trainer_all_cores_frac": self.time_at.get(self.idle, 0.0) / total}
        self.time_at = {self.own: 0.0, self.idle: 0.0}
        return out
