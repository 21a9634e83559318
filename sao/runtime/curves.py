"""A run's curves, defined once: which metrics, titles, axis labels, smoothing and marks.

`sao report` draws them as PNG files (sao/runtime/report.py), `sao view` as SVG in its page
(sao/runtime/view.py): both take `curve_data(rows)`, which holds every series raw and smoothed, the
critic warm-up spans, the resumes and the weight publishes, so the two never disagree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from sao.config import ConfigError

# (name, metric keys, title, y-axis label with its unit)
PANELS = [
    ("reward", ["reward/mean"], "train reward (batch mean)", "reward"),
    ("eval_accuracy", ["eval/accuracy"], "held-out accuracy", "accuracy (fraction solved)"),
    ("dis_masked", ["dis/masked_low_frac", "dis/masked_high_frac"], "DIS masked token fraction", "fraction of tokens"),
    ("critic", ["critic/explained_variance"], "critic explained variance", "explained variance"),
    ("value_loss", ["critic/value_loss"], "critic value loss", "0.5 (V - R)^2, token mean"),
    ("grad_norms", ["actor/grad_norm", "critic/grad_norm"], "gradient norms", "L2 norm (before clipping)"),
    ("lag", ["async/lag_mean", "async/lag_max"], "staleness", "policy versions"),
    ("idle", ["async/trainer_idle_frac", "async/rollout_idle_frac"], "idle fraction", "fraction of wall time"),
    ("throughput", ["perf/tokens_per_s"], "generated tokens/s", "tokens / s"),
    ("entropy", ["actor/entropy"], "policy entropy (action tokens)", "nats / token"),
]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{str(run)!r}: not a run directory (no metrics.jsonl)")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a live run's last line, being written
                break
    return rows


def trailing_mean(ys: list[float], window: int) -> list[float]:
    """Mean of the last `window` points up to each point (fewer at the start)."""
    return [sum(ys[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(ys))]


def smoothing_window(points: int) -> int:
    """The trailing mean's window: about 1/20 of the points (1: no smoothing for short curves)."""
    return max(1, points // 20)


def warmup_spans(rows: list[dict]) -> list[tuple[int, int]]:
    """(first, last) step of each run of consecutive critic warm-up steps (`train/critic_warmup` == 1)."""
    spans: list[tuple[int, int]] = []
    for r in rows:
        if "train/critic_warmup" not in r:
            continue
        if r["train/critic_warmup"] == 1:
            if spans and spans[-1][1] == r["step"] - 1:
                spans[-1] = (spans[-1][0], r["step"])
            else:
                spans.append((r["step"], r["step"]))
    return spans


def resumes(rows: list[dict]) -> list[int]:
    """Steps a run resumed at: each start logs the parity gate's row, at step 0 on a fresh start."""
    return [r["step"] for r in rows if "parity/max_abs_diff" in r and r["step"] > 0]


def publishes(rows: list[dict]) -> list[int]:
    """Steps after which the trainer published weights to the rollout workers (async runs)."""
    return [r["step"] for r in rows if r.get("async/published")]


def panel_title(name: str, title: str, rows: list[dict]) -> str:
    # The async loop logs tokens so far / worker time so far (loop.async_perf); the sync loop logs
    # this step's tokens / this step's generation time (loop.run_sync, which also logs perf/gen_s).
    if name == "throughput":
        per_step = any("perf/gen_s" in r for r in rows)
        return f"{title}, " + ("per step (generation time only)" if per_step else "cumulative average")
    return title


def series(rows: list[dict], key: str) -> dict | None:
    """{"x": steps, "y": values, "smooth": trailing mean, "window"} of one metric, or None when never logged."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    if not pts:
        return None
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    window = smoothing_window(len(pts))
    return {"x": xs, "y": ys, "smooth": trailing_mean(ys, window), "window": window}


def curve_data(rows: list[dict]) -> dict:
    """Every panel that has data, with its series, and the marks every panel shows."""
    panels = []
    for name, keys, title, ylabel in PANELS:
        got = {k: s for k in keys if (s := series(rows, k)) is not None}
        if got:
            panels.append({"name": name, "title": panel_title(name, title, rows), "ylabel": ylabel, "series": got})
    return {"panels": panels, "warmup": warmup_spans(rows), "resumes": resumes(rows), "publishes": publishes(rows)}
