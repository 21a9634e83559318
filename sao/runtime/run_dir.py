"""The run directory: resolved config, metrics.jsonl, TensorBoard events, trajectories, checkpoints.

    runs/<name>/
      config.yaml            resolved configuration
      metrics.jsonl          one row per optimizer step (namespaced keys), eval rows included
      tb/                    TensorBoard event files with the same scalars (output.report_to: also wandb/, trackio)
      trajectories/          step_000010.txt (readable, action/observation split) + .jsonl (token level)
      checkpoints/<tag>/     actor/ and critic/ in HF format
      summary.json           before/after held-out accuracy and run totals
      plots/                 written by `sao report`

Nothing is overwritten: a run directory that exists already is refused, and checkpoints are
written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from sao.config import Config, ConfigError, to_yaml
from sao.types import Trajectory


class RunDir:
    def __init__(self, path: Path, cfg: Config | None = None):
        self.path, self.cfg = path, cfg
        self._trackers = None  # output.report_to, started at the first row (sao/runtime/trackers.py)

    @classmethod
    def create(cls, cfg: Config) -> RunDir:
        name = cfg.output.name or f"{cfg.algo.name}-{cfg.env.name.replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = Path(cfg.output.root) / name
        if path.exists():
            raise ConfigError(f"output.name: run directory {str(path)!r} exists already; choose another name")
        (path / "trajectories").mkdir(parents=True)
        (path / "checkpoints").mkdir()
        (path / "config.yaml").write_text(to_yaml(cfg))
        return cls(path, cfg)

    # -- metrics ----------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}) + "\n")
        if self._trackers is None:
            from sao.runtime.trackers import make_trackers

            self._trackers = make_trackers(self.path, self.cfg)
        scalars = {k: v for k, v in row.items() if k not in ("step", "time")}
        for tracker in self._trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        for tracker in self._trackers or []:
            tracker.close()
        self._trackers = None

    # -- trajectories -----------------------------------------------------------------------
    def write_trajectories(self, step: int, trajs: list[Trajectory], decode, prefix: str = "step") -> None:
        stem = self.path / "trajectories" / f"{prefix}_{step:06d}"
        with open(stem.with_suffix(".jsonl"), "w") as f:
            for t in trajs:
                f.write(t.to_json() + "\n")
        with open(stem.with_suffix(".txt"), "w") as f:
            for t in trajs:
                f.write(render_trajectory(t, decode) + "\n\n")

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, tag: str, actor, critic, tokenizer, extra: dict | None = None) -> Path:
        final = self.path / "checkpoints" / tag
        tmp = final.with_name(tag + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        actor.save_pretrained(tmp / "actor")
        tokenizer.save_pretrained(tmp / "actor")
        if critic is not None:
            critic.save_pretrained(tmp / "critic")
            tokenizer.save_pretrained(tmp / "critic")
        (tmp / "state.json").write_text(json.dumps(extra or {}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def write_json(self, name: str, data: dict) -> None:
        tmp = self.path / (name + ".partial")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.rename(self.path / name)


def render_trajectory(t: Trajectory, decode) -> str:
    """Readable text with the action/observation split visible and the policy version per action."""
    head = (f"=== trajectory {t.id}  task={t.task_id}  reward={t.reward}  status={t.status.value}"
            f"{' (' + t.status_reason + ')' if t.status_reason else ''}  turns={t.turns}")
    parts = [head]
    i, n = 0, len(t.token_ids)
    while i < n:
        j = i
        while j < n and t.action_mask[j] == t.action_mask[i]:
            j += 1
        text = decode(t.token_ids[i:j])
        if t.action_mask[i]:
            versions = sorted(set(t.token_versions[i:j]))
            parts.append(f"[ACTION v{','.join(map(str, versions))}] {text}")
        else:
            parts.append(f"[{'PROMPT' if i == 0 else 'OBSERVATION'}] {text}")
        i = j
    return "\n".join(parts)
