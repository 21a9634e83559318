"""The training loops: the one async loop (over any backend) and the sync loop (for comparison). Each
takes its parts: the trainer (sao/trainer/protocol.py), a batch source (sao/runtime/source.py) and a
step sink (sao/runtime/sink.py); only sao/runtime/train.py holds every part.

    async, each step:  receive until B usable trajectories are queued  (the scheduler issues work meanwhile)
                       a critic on its own process: hand it the next batch now if it is queued (look_ahead)
                       trainer.step(batch)
                       publish when pacing says so (sao/runtime/pacing.py): room to issue grows
    sync, each step:   generate B episodes with the current weights, then train
    both:              the sink logs, dumps trajectories, evaluates and checkpoints on schedule
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sao.runtime.pacing import Pacing
from sao.runtime.signals import StopFlag
from sao.runtime.sink import StepSink
from sao.runtime.source import AsyncSource, SyncSource
from sao.trainer.batch import Batch
from sao.trainer.protocol import Trainer
from sao.types import Trajectory

Collate = Callable[[list[Trajectory], int], Batch]  # (trajectories, step) -> the trainer's batch


def run_async(trainer: Trainer, source: AsyncSource, sink: StepSink, pacing: Pacing, collate: Collate, steps: int,
              stop: StopFlag, train: bool = True) -> None:
    """Take the next B finished trajectories, train, publish when pacing says so. `train=False`
    (runtime.rollout_only): the rollout side alone, each batch counted, not trained on."""
    ahead = None  # (trajectories, collated): the next batch, handed to the trainer early
    for step in range(sink.step + 1, steps + 1):
        version = trainer.version  # the policy this batch updates; lag is measured against it
        if ahead is not None:  # its critic updates are done: it is trained before any stop
            (batch, collated), ahead, wait_s = ahead, None, 0.0
        else:
            stop.check()
            (batch, wait_s), collated = source.next(step, version), None
        if not train:
            metrics = {"reward/mean": sum(t.reward for t in batch) / len(batch)}
        else:
            handed = collated is not None
            collated = collated if handed else collate(batch, step)
            if trainer.looks_ahead and step < steps and not sink.saves_at(step) and not stop:
                ahead = look_ahead(trainer, source, collate, step, version, collated, handed)
            metrics = trainer.step(collated)
            if trainer.looks_ahead:
                metrics["async/critic_ahead"] = float(handed)  # this batch's critic ran during the last step
        metrics.update(source.trained(batch, step))
        published = pacing.step_done(version, trainer.version)
        if published:
            source.publish(trainer.export_weights(), trainer.version)
        metrics["async/published"] = float(published)  # marked on the curves of `sao view`
        metrics.update(source.step_done(step, wait_s))
        metrics["train/actor_version"] = trainer.version
        sink.finish(step, batch, version, metrics)


def look_ahead(trainer: Trainer, source: AsyncSource, collate: Collate, step: int, version: int, current: Batch,
               handed: bool) -> tuple[list[Trajectory], Batch] | None:
    """critic.placement=separate: if the next batch is already queued, hand it to the trainer now, so its
    critic runs steps 1-3 on it while the actor steps on `current` (sao/trainer/critic_ranks.py). Never
    waits; the caller never looks ahead before a checkpoint (which holds both sides at one step boundary)
    or the last step. The batch trains at the next policy version, so its lag bound is checked against that one."""
    batch = source.ready(step, version + 1)
    if not batch:
        return None
    if not handed:
        trainer.look_ahead(current)  # the critic takes batches in order: this one first
    collated = collate(batch, step + 1)
    trainer.look_ahead(collated)
    return batch, collated


def run_sync(trainer: Trainer, source: SyncSource, sink: StepSink, collate: Collate, steps: int, stop: StopFlag) -> None:
    """Generate B episodes with the current weights (the policy copy given them each step), then train
    on them; no overlap. Each phase gets the threads that suit it (sao/runtime/threads.py)."""
    for step in range(sink.step + 1, steps + 1):
        stop.check()
        version = trainer.version
        batch = source.next(step, trainer.export_weights(), version)
        t0 = time.perf_counter()
        metrics = trainer.step(collate(batch, step))
        metrics.update(source.step_done(batch, time.perf_counter() - t0))
        metrics["train/actor_version"] = trainer.version
        sink.finish(step, batch, version, metrics)
