"""A run's checkpoints: what each part of the run saves, gathered and restored in one place
(sao/runtime/checkpoint.py writes and reads the files).

    trainer_state.pt = {step, totals, rng, trainer, pacing, tasks, queue, scheduler, run, audit}

Each part saves and restores its own state (`state_dict`/`load_state_dict`); the scheduler (async
runs) exists only once the workers are up, so a resumed run's unfinished episodes wait in `pending`
until it takes them. `totals` are the run's counters for summary.json: the queue's drop counts, the
time the loop waited for batches, and what checkpoints cost.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from sao.runtime import checkpoint
from sao.runtime.run_dir import RunDir
from sao.runtime.scheduler import Audit, Scheduler, TaskStream


class Saver:
    def __init__(self, run: RunDir, trainer, pacing, tasks: TaskStream, queue, audit: Audit | None, tokenizer,
                 keep: int, merged: bool):
        self.run, self.trainer, self.pacing, self.tasks, self.queue, self.audit = run, trainer, pacing, tasks, queue, audit
        self.tokenizer, self.keep, self.merged = tokenizer, keep, merged
        self.scheduler: Scheduler | None = None  # async runs, once the backend is up (`start_scheduler`)
        self.pending: dict = {}  # a resumed run's unfinished episodes, until the scheduler takes them
        self.wait_s = 0.0  # the loop's time waiting for batches, before this process (a resume's)
        self.waited = lambda: 0.0  # ... and in it (AsyncSource.wait_s)
        self.checkpoint_s = 0.0  # in summary.json: what checkpoints cost the run
        self.resumed_from: str | None = None  # that checkpoint's actor/ is the engines' model: never pruned

    def totals(self) -> dict:
        return {"dropped_stale": self.queue.dropped_stale, "failed": sum(self.queue.failed.values()),
                "wait_s": self.wait_s + self.waited(), "checkpoint_s": self.checkpoint_s}

    def state_dict(self, step: int) -> dict:
        return {
            "step": step, "totals": self.totals(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "trainer": self.trainer.state_dict(), "pacing": self.pacing.state_dict(),
            "tasks": self.tasks.state_dict(), "queue": self.queue.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else self.pending,
            "run": self.run.state_dict(), "audit": self.audit.state_dict() if self.audit is not None else None,
        }

    def load(self, ckpt: Path) -> int:
        """Every part's state from checkpoint `ckpt`; returns its step."""
        state = checkpoint.load(ckpt)
        self.resumed_from = ckpt.name
        self.wait_s, self.checkpoint_s = state["totals"]["wait_s"], state["totals"]["checkpoint_s"]
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        self.trainer.load_state_dict(state["trainer"])  # sharded: what the shards do not hold (a separate critic)
        self.pacing.load_state_dict(state["pacing"])
        self.tasks.load_state_dict(state["tasks"])
        self.queue.load_state_dict(state["queue"])  # its drop counts are the totals' dropped_stale and failed
        self.pending = state["scheduler"]
        self.run.load_state_dict(state["run"])
        if self.audit is not None and state["audit"] is not None:
            self.audit.load_state_dict(state["audit"])
        if self.audit is not None:
            self.audit.note("resumed", state["step"], checkpoint=ckpt.name)
        return state["step"]

    def start_scheduler(self, scheduler: Scheduler) -> Scheduler:
        """The async run's scheduler takes the checkpoint's unfinished episodes and is saved from now on."""
        scheduler.load_state_dict(self.pending)
        self.scheduler = scheduler
        return scheduler

    def save(self, tag: str, step: int) -> Path:
        t0 = time.perf_counter()
        path = checkpoint.save(self.run.path, tag, self.state_dict(step), self._write_models, self.keep,
                               protect=self.resumed_from)
        self.checkpoint_s += time.perf_counter() - t0
        return path

    def _write_models(self, folder: Path) -> None:
        self.trainer.save_pretrained(folder, self.tokenizer, merged=self.merged)

    def save_at_exit(self, tag: str, step: int) -> Path:
        """The last checkpoint; the audit says which episodes it carries over, so they are not taken for lost."""
        if self.audit is not None and self.scheduler is not None:
            self.audit.write("unfinished_at_exit", self.scheduler.pending(), step, checkpoint=tag)
            self.audit.write("queued_at_exit", self.queue.items(), step, checkpoint=tag)
        return self.save(tag, step)
