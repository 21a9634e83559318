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

A write that fails (a full disk) removes the `.partial` folder and raises WriteError naming the
checkpoint; the previous checkpoint and `latest` are untouched. `resume_problem` is what `--resume`
checks first: a run that has no checkpoint, a damaged one (a truncated `trainer_state.pt` or
`model.safetensors`), or one that already finished, each refused in one line naming the file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zipfile
from pathlib import Path

import torch

from sao.config import ConfigError
from sao.models.lora import is_peft, save_merged_model
from sao.runtime.run_dir import fsync_tree, write_failure
from sao.types import Trajectory


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
    try:
        _write(trainer, tmp, step)
    except Exception as exc:  # a full disk surfaces as OSError, torch's "basic_ios::clear" or a SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(f"checkpoint {final}", exc) from None
    try:
        if final.exists():  # e.g. "final" written again after a resume: keep the old one until the new is in place
            old = final.with_name(tag + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _atomic_text(run.path / "checkpoints" / "latest", tag + "\n")
    except OSError as exc:
        raise write_failure(f"checkpoint {final}", exc) from None
    prune(run.path / "checkpoints", trainer.cfg.output.keep_checkpoints)
    return final


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` periodic checkpoints (step_N; never final, never the latest)."""
    if keep <= 0:
        return
    latest_tag = (folder / "latest").read_text().strip()
    periodic = sorted((p for p in folder.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                      key=lambda p: int(p.name[5:]))
    for old in periodic[:-keep]:
        if old.name != latest_tag:
            shutil.rmtree(old, ignore_errors=True)


def _write(trainer, tmp: Path, step: int) -> None:
    trainer.actor.save_pretrained(tmp / "actor")  # a LoRA actor writes its adapter (sao/models/lora.py)
    trainer.codec.tokenizer.save_pretrained(tmp / "actor")
    if trainer.cfg.model.lora.save_merged and is_peft(trainer.actor):
        save_merged_model(trainer.actor, tmp / "actor_merged")
        trainer.codec.tokenizer.save_pretrained(tmp / "actor_merged")
    if trainer.critic is not None:
        trainer.critic.save_pretrained(tmp / "critic")
        trainer.codec.tokenizer.save_pretrained(tmp / "critic")
    state = trainer_state(trainer, step)
    with open(tmp / "trainer_state.pt", "wb") as f:  # a Python file: a failed write raises OSError with its errno
        torch.save(state, f)
    small = {k: state[k] for k in ("step", "actor_version", "critic_version", "steps_done", "totals")}
    (tmp / "state.json").write_text(json.dumps(small))
    fsync_tree(tmp)


def latest(run_path: Path) -> Path | None:
    pointer = run_path / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_path / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def damage(ckpt: Path) -> str | None:
    """What in checkpoint `ckpt` is missing, truncated or damaged (naming the file), or None. Reads the
    archive's checksums and the safetensors headers, not the tensors."""
    from safetensors import safe_open

    state = ckpt / "trainer_state.pt"
    if not state.is_file():
        return f"{state} is missing"
    try:
        with zipfile.ZipFile(state) as archive:
            bad = archive.testzip()
    except Exception as exc:  # BadZipFile when truncated; anything else a damaged directory
        return f"{state} is truncated or damaged ({_first_line(exc)})"
    if bad is not None:
        return f"{state} is damaged ({bad} fails its checksum)"
    for part in ("actor", "critic"):
        folder = ckpt / part
        if part == "actor" and not folder.is_dir():
            return f"{folder} is missing"
        for weights in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            try:
                with safe_open(str(weights), "pt"):
                    pass
            except Exception as exc:
                return f"{weights} is truncated or damaged ({_first_line(exc)})"
        for meta in ("config.json", "adapter_config.json"):
            if (folder / meta).is_file():
                try:
                    json.loads((folder / meta).read_text())
                except ValueError as exc:
                    return f"{folder / meta} is damaged ({_first_line(exc)})"
    return None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def resume_problem(run: Path, steps: int) -> str | None:
    """Why `sao train --resume run` with train.steps=`steps` cannot continue, or None."""
    if not (run / "config.yaml").is_file():
        return f"{str(run)!r} is not a run directory (no config.yaml)"
    pointer = run / "checkpoints" / "latest"
    if not pointer.is_file():
        return (f"{str(run)!r} has no checkpoint yet: it stopped before its first (output.save_every); "
                "start a new run")
    ckpt = run / "checkpoints" / pointer.read_text().strip()
    problem = damage(ckpt)
    if problem is not None:
        others = sorted(p.name for p in ckpt.parent.iterdir() if p.is_dir() and p != ckpt
                        and not p.name.endswith((".partial", ".old")) and damage(p) is None)
        hint = (f"; to resume from {others[-1]}, write that name into {pointer}" if others
                else "; no other complete checkpoint is left")
        return problem + hint
    try:
        done = json.loads((ckpt / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{ckpt / 'state.json'} is damaged ({_first_line(exc)})"
    if done >= steps:
        return (f"{str(run)!r} finished: its checkpoint {ckpt.name} is at step {done} of train.steps={steps}; "
                f"nothing is rewritten. To train on, raise train.steps (e.g. train.steps={2 * done})")
    return None


def load_state(ckpt: Path) -> dict:
    try:
        return torch.load(ckpt / "trainer_state.pt", weights_only=False)
    except Exception as exc:
        raise ConfigError(f"--resume: {ckpt / 'trainer_state.pt'} cannot be read ({_first_line(exc)})") from None


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
