"""Checkpoints that resume losslessly, written atomically.

    checkpoints/step_000040/
      actor/, critic/        HF format (weights + tokenizer)
      trainer_state.pt       every part's state_dict (sao/runtime/saver.py): the trainer's
                             (optimizer states, versions, running-mean baseline), pacing counters,
                             task cursor, RNG states, queued (finished, untrained) trajectories,
                             issued-but-unfinished assignments, and the line counts of
                             metrics.jsonl and audit.jsonl at this step
      state.json             the small, human-readable part
    checkpoints/latest       name of the newest complete checkpoint

A checkpoint is written into `<tag>.partial`, every file fsynced, then renamed into place, and only
then does `latest` (itself replaced by rename) point at it: a crash while writing leaves the
previous checkpoint usable. This module only writes and reads files; what goes in them is each
owner's. The learning rate is constant (no scheduler): the optimizers' param_groups carry it.
Resume truncates metrics.jsonl and audit.jsonl to the saved line counts, so steps that ran after
the checkpoint (and are trained again) are not recorded twice.

A write that fails (a full disk) removes the `.partial` folder and raises WriteError naming the
checkpoint; the previous checkpoint and `latest` are untouched. `resume_problem` is what `--resume`
checks first: a run that has no checkpoint, a damaged one (a truncated `trainer_state.pt` or
`model.safetensors`), or one that already finished, each refused in one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError

from sao.config import ConfigError
from sao.runtime.run_dir import fsync_tree, write_failure


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(run_path: Path, tag: str, state: dict, write_models: Callable[[Path], None], keep: int,
         protect: str | None = None) -> Path:
    """Write checkpoint `tag`: `write_models(folder)` writes the HF folders, `state` (every part's
    state_dict, sao/runtime/saver.py) goes into trainer_state.pt; then `latest` points at it."""
    final = run_path / "checkpoints" / tag
    tmp = final.with_name(tag + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(tmp, state, write_models)
    except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk: OSError, torch's "basic_ios::clear"
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(f"checkpoint {final}", exc) from None
    except BaseException:  # anything else (a lost trainer rank, Ctrl-C) is not a failed write
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        if final.exists():  # e.g. "final" written again after a resume: keep the old one until the new is in place
            old = final.with_name(tag + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _atomic_text(run_path / "checkpoints" / "latest", tag + "\n")
    except OSError as exc:
        raise write_failure(f"checkpoint {final}", exc) from None
    prune(run_path / "checkpoints", keep, protect)
    return final


def prune(folder: Path, keep: int, protect: str | None = None) -> None:
    """Delete all but the newest `keep` periodic checkpoints (step_N; never final, never the latest, never
    `protect`: the checkpoint a resumed run started from, whose actor/ the engines load)."""
    if keep <= 0:
        return
    latest_tag = (folder / "latest").read_text().strip()
    periodic = sorted((p for p in folder.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                      key=lambda p: int(p.name[5:]))
    for old in periodic[:-keep]:
        if old.name not in (latest_tag, protect):
            shutil.rmtree(old, ignore_errors=True)


def _write(tmp: Path, state: dict, write_models: Callable[[Path], None]) -> None:
    write_models(tmp)
    with open(tmp / "trainer_state.pt", "wb") as f:  # a Python file: a failed write raises OSError with its errno
        torch.save(state, f)
    trainer = state["trainer"]
    small = {"step": state["step"], "totals": state["totals"],
             **{k: trainer[k] for k in ("actor_version", "critic_version", "steps_done") if k in trainer}}
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


def load(ckpt: Path) -> dict:
    """trainer_state.pt: the state every part of the run restores (sao/runtime/saver.py)."""
    try:
        return torch.load(ckpt / "trainer_state.pt", weights_only=False)
    except Exception as exc:
        raise ConfigError(f"--resume: {ckpt / 'trainer_state.pt'} cannot be read ({_first_line(exc)})") from None
