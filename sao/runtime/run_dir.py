"""The run directory: resolved config, metrics.jsonl, TensorBoard events, trajectories, checkpoints.

    runs/<name>/
      config.yaml            resolved configuration
      metrics.jsonl          one row per optimizer step (namespaced keys), eval rows included
      tb/                    TensorBoard event files with the same scalars (output.report_to: also wandb/, trackio)
      trajectories/          step_000010.txt (readable, action/observation split) + .jsonl (token level)
      traces/                step_000010.jsonl: what the trainer computed per token for some of them (`sao view`)
      evals/                 step_000050.json: every held-out episode's task, status and score (intervals in `sao bench`)
      checkpoints/<tag>/     actor/ and critic/ in HF format (sao/runtime/checkpoint.py)
      summary.json           before/after held-out accuracy and run totals
      plots/                 written by `sao report`

Nothing is overwritten: a run directory that exists already is refused (created with one mkdir,
so two runs cannot both take it; a default name that another run took in the same second gets a
suffix instead), and checkpoints are written to a temporary folder and renamed into place. A write
that fails (a full disk) raises WriteError naming the file, and leaves the file as it was before.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time
from pathlib import Path

from sao.config import Config, ConfigError, to_yaml
from sao.errors import WriteError
from sao.types import Trajectory, segment_rows


def write_failure(what: Path | str, exc: BaseException) -> WriteError:
    """One line naming `what` and the operating system's reason, found in the exception chain (torch's
    writer hides it behind "basic_ios::clear", safetensors behind its own error), else asked of the disk."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return WriteError(f"{what}: {os.strerror(seen.errno).lower()}")
        if any(s in str(seen) for s in ("No space left", "StorageFull", "os error 28")):
            return WriteError(f"{what}: no space left on device")
        seen = seen.__cause__ or seen.__context__
    folder = Path(what)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if shutil.disk_usage(folder).free < 1 << 20:
        return WriteError(f"{what}: {os.strerror(errno.ENOSPC).lower()}")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return WriteError(f"{what}: {first}")


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under root (then root): a rename after it publishes whole files."""
    for path in [*sorted(root.rglob("*")), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def default_name(cfg: Config) -> str:
    return f"{cfg.algo.name}-{cfg.env.name.replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"


class RunDir:
    def __init__(self, path: Path, cfg: Config | None = None):
        self.path, self.cfg = path, cfg
        self._trackers = None  # output.report_to, started at the first row (sao/runtime/trackers.py)

    @classmethod
    def create(cls, cfg: Config) -> RunDir:
        root = Path(cfg.output.root)
        root.mkdir(parents=True, exist_ok=True)
        name = cfg.output.name or default_name(cfg)
        path = root / name
        for suffix in range(2, 1000):
            try:
                path.mkdir()  # the one atomic claim: check-then-create would let two runs take one name
                break
            except FileExistsError:
                if cfg.output.name:
                    raise ConfigError(f"output.name: run directory {str(path)!r} exists already; "
                                      "choose another name") from None
                path = root / f"{name}-{suffix}"  # a default name another run took in the same second
        try:
            (path / "trajectories").mkdir()
            (path / "checkpoints").mkdir()
            (path / "config.yaml").write_text(to_yaml(cfg))
        except OSError as exc:
            raise write_failure(path / "config.yaml", exc) from None
        return cls(path, cfg)

    def state_dict(self) -> dict:
        return {"metrics_lines": count_lines(self.path / "metrics.jsonl")}

    def load_state_dict(self, state: dict) -> None:
        """Back to the checkpoint's rows: steps that ran after it are trained again, not recorded twice."""
        truncate_lines(self.path / "metrics.jsonl", state["metrics_lines"])

    # -- metrics ----------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        line = json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}) + "\n"
        append_line(self.path / "metrics.jsonl", line)
        if self._trackers is None:
            from sao.runtime.trackers import make_trackers

            self._trackers = make_trackers(self.path, self.cfg)
        scalars = {k: v for k, v in row.items() if k not in ("step", "time")}
        for tracker in self._trackers:
            try:
                tracker.log(step, scalars)
            except OSError as exc:  # tensorboard's writer thread re-raises its write error here
                raise write_failure(f"{type(tracker).__name__} events of {self.path}", exc) from None

    def close(self) -> None:
        trackers, self._trackers = self._trackers or [], None
        for tracker in trackers:
            try:
                tracker.close()
            except OSError as exc:
                raise write_failure(f"{type(tracker).__name__} events of {self.path}", exc) from None

    # -- trajectories -----------------------------------------------------------------------
    def write_trajectories(self, step: int, trajs: list[Trajectory], decode, prefix: str = "step") -> None:
        stem = self.path / "trajectories" / f"{prefix}_{step:06d}"
        for path, text in ((stem.with_suffix(".jsonl"), "".join(t.to_json() + "\n" for t in trajs)),
                           (stem.with_suffix(".txt"), "".join(render_trajectory(t, decode) + "\n\n" for t in trajs))):
            try:
                path.write_text(text)
            except OSError as exc:
                path.unlink(missing_ok=True)
                raise write_failure(path, exc) from None

    def write_traces(self, step: int, batch: list[Trajectory], records: list[dict], decode, algo: str,
                     version: int) -> None:
        """traces/step_N.jsonl: the trainer's per-token records (sao/trainer/trace.py) joined with their
        trajectories (id, status, lag, each token's text). Written whole, then renamed into place."""
        folder = self.path / "traces"
        path = folder / f"step_{step:06d}.jsonl"
        lines, rows = [], segment_rows(batch)  # a row is a trajectory or one segment of it (collate's rows)
        for rec in records:
            i, a, b = rows[rec["row"]]
            t = batch[i]
            ids = t.token_ids[a:b]
            head = {"step": step, "algo": algo, "trajectory_id": t.id, "task_id": t.task_id, "status": t.status.value,
                    "status_reason": t.status_reason, "turns": t.turns, "lag": t.lag(version),
                    "token_ids": list(ids), "text": [decode([k]) for k in ids], "action_mask": list(t.action_mask[a:b]),
                    **({"segment": [s for s, _ in t.segments()].index(a)} if t.segment_starts else {})}
            lines.append(json.dumps({**head, **rec}) + "\n")
        tmp = path.with_suffix(".partial")
        try:
            folder.mkdir(exist_ok=True)
            tmp.write_text("".join(lines))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_failure(path, exc) from None
        tmp.rename(path)

    def write_eval_games(self, step: int, trajs: list[Trajectory]) -> None:
        """evals/step_N.json: every held-out episode's task, status and score (what eval/accuracy averages:
        Trajectory.eval_score; failed ones are listed, not scored)."""
        games = [{"task": t.task_id, "status": t.status.value, "score": t.eval_score} for t in trajs]
        try:
            (self.path / "evals").mkdir(exist_ok=True)
        except OSError as exc:
            raise write_failure(self.path / "evals", exc) from None
        self.write_json(f"evals/step_{step:06d}.json", {"step": step, "games": games})

    def write_json(self, name: str, data: dict) -> None:
        tmp = self.path / (name + ".partial")
        try:
            tmp.write_text(json.dumps(data, indent=2))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_failure(self.path / name, exc) from None
        tmp.rename(self.path / name)


def count_lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.exists() else 0


def truncate_lines(path: Path, n: int) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    if len(lines) > n:
        path.write_text("".join(lines[:n]))


def append_line(path: Path, line: str) -> None:
    """Append one line whole or not at all: a failed append is cut back, so the file never holds half a row."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:
            os.ftruncate(fd, size)
            raise write_failure(path, exc) from None
    finally:
        os.close(fd)


def render_trajectory(t: Trajectory, decode) -> str:
    """Readable text with the action/observation split visible and the policy version per action."""
    head = (f"=== trajectory {t.id}  task={t.task_id}  reward={t.reward}  status={t.status.value}"
            f"{' (' + t.status_reason + ')' if t.status_reason else ''}  turns={t.turns}")
    parts = [head]
    i, n = 0, len(t.token_ids)
    starts = set(t.segment_starts)
    while i < n:
        if i in starts:
            parts.append(f"--- segment {sorted(starts).index(i) + 2} (a new prompt: the history as re-rendered)")
        j = i
        while j < n and t.action_mask[j] == t.action_mask[i] and (j == i or j not in starts):
            j += 1
        text = decode(t.token_ids[i:j])
        if t.action_mask[i]:
            versions = sorted(set(t.token_versions[i:j]))
            parts.append(f"[ACTION v{','.join(map(str, versions))}] {text}")
        else:
            parts.append(f"[{'PROMPT' if i == 0 or i in starts else 'OBSERVATION'}] {text}")
        i = j
    return "\n".join(parts)
