"""Checkpoints that resume losslessly, written atomically.

    checkpoints/step_000040/
      actor/, critic/        HF format (weights + tokenizer)
      trainer_state.pt       optimizer states, versions, RNG states, task cursor, running-mean
                             baseline, pacing counters, queued (finished, untrained) trajectories,
                             issued-but-unfinished assignments, and the line counts of
                             metrics.jsonl and audit.jsonl at this step
      state.json             the small, human-readable part
    checkpoints/latest       name of the newest complete checkpoint

A checkpoint is written into `<tag>.partial`, every file fsynced, then renamed into place, and only
then does `latest` (itself replaced by rename) point at it: a crash while writing leaves the
previous checkpoint usable. The learning rate is constant (no scheduler): the optimizers'
param_groups carry it. Resume truncates metrics.jsonl and audit.jsonl to the saved line counts,
so steps that ran after the checkpoint (and are trained again) are not recorded twice.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from sao.models.lora import is_peft, save_merged_model
from sao.types import Trajectory


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def count_lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.exists() else 0


def truncate_lines(path: Path, n: int) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    if len(lines) > n:
        path.write_text("".join(lines[:n]))


def trainer_state(trainer, step: int) -> dict:
    learner = trainer.learner
    sched = trainer.scheduler
    queued = trainer.queue.items()
    return {
        "step": step,
        "actor_version": learner.actor_version, "critic_version": learner.critic_version,
        "steps_done": learner.steps_done, "unpublished": trainer.unpublished,
        "guard": learner.guard_state(),
        "actor_opt": learner.actor_opt.state_dict(),
        "critic_opt": learner.critic_opt.state_dict() if learner.critic_opt is not None else None,
        "running_mean": learner.running_mean.state_dict() if learner.running_mean is not None else None,
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "scheduler": sched.state(queued) if sched is not None else {"cursor": trainer.tasks.cursor},
        "queued": [t.to_json() for t in queued],
        "queue_counts": {"dropped_stale": trainer.queue.dropped_stale, "failed": dict(trainer.queue.failed)},
        "totals": dict(trainer.totals),
        "metrics_lines": count_lines(trainer.run.path / "metrics.jsonl"),
        "audit_lines": trainer.audit.lines() if trainer.audit is not None else 0,
    }


def save(trainer, tag: str, step: int) -> Path:
    run = trainer.run
    final = run.path / "checkpoints" / tag
    tmp = final.with_name(tag + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.actor.save_pretrained(tmp / "actor")  # a LoRA actor writes its adapter (sao/models/lora.py)
    trainer.codec.tokenizer.save_pretrained(tmp / "actor")
    if trainer.cfg.model.lora.save_merged and is_peft(trainer.actor):
        save_merged_model(trainer.actor, tmp / "actor_merged")
        trainer.codec.tokenizer.save_pretrained(tmp / "actor_merged")
    if trainer.critic is not None:
        trainer.critic.save_pretrained(tmp / "critic")
        trainer.codec.tokenizer.save_pretrained(tmp / "critic")
    state = trainer_state(trainer, step)
    torch.save(state, tmp / "trainer_state.pt")
    small = {k: state[k] for k in ("step", "actor_version", "critic_version", "steps_done", "totals")}
    (tmp / "state.json").write_text(json.dumps(small))
    _fsync_tree(tmp)
    if final.exists():  # e.g. "final" written again after a resume: keep the old one until the new is in place
        old = final.with_name(tag + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _atomic_text(run.path / "checkpoints" / "latest", tag + "\n")
    return final


def latest(run_path: Path) -> Path | None:
    pointer = run_path / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_path / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def load_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)


def restore(trainer, state: dict) -> None:
    """Everything but the weights (loaded with the models) back into a freshly built trainer."""
    learner = trainer.learner
    learner.actor_version, learner.critic_version = state["actor_version"], state["critic_version"]
    learner.steps_done = state["steps_done"]
    learner.load_guard_state(state.get("guard", {}))  # older checkpoints have none: counters start at 0
    learner.actor_opt.load_state_dict(state["actor_opt"])
    if learner.critic_opt is not None and state["critic_opt"] is not None:
        learner.critic_opt.load_state_dict(state["critic_opt"])
    if learner.running_mean is not None and state["running_mean"]:
        learner.running_mean.load_state_dict(state["running_mean"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    trainer.step, trainer.unpublished = state["step"], state["unpublished"]
    trainer.totals.update(state["totals"])
    for line in state["queued"]:
        trainer.queue.put(Trajectory.from_json(line))
    trainer.queue.dropped_stale = state["queue_counts"]["dropped_stale"]
    trainer.queue.failed = dict(state["queue_counts"]["failed"])
    truncate_lines(trainer.run.path / "metrics.jsonl", state["metrics_lines"])
    truncate_lines(trainer.run.path / "audit.jsonl", state["audit_lines"])
