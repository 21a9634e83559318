"""`sao report RUN`: PNG plots of a run's metrics.jsonl (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from sao.config import ConfigError

# (file name, metric keys, title, y-axis label)
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
            rows.append(json.loads(line))
    return rows


def trailing_mean(ys: list[float], window: int) -> list[float]:
    """Mean of the last `window` points up to each point (fewer at the start)."""
    return [sum(ys[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(ys))]


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


def panel_title(name: str, title: str, rows: list[dict]) -> str:
    # The async loop logs tokens so far / worker time so far (loop.async_perf); the sync loop logs
    # this step's tokens / this step's generation time (loop.run_sync, which also logs perf/gen_s).
    if name == "throughput":
        per_step = any("perf/gen_s" in r for r in rows)
        return f"{title}, " + ("per step (generation time only)" if per_step else "cumulative average")
    return title


def figure(rows: list[dict], run_name: str, name: str, keys: list[str], title: str, ylabel: str) -> Figure | None:
    """One panel: each key's raw values faint, a trailing mean over them, critic warm-up shaded."""
    series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
    if not any(series.values()):
        return None
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    for k, pts in series.items():
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        window = max(1, len(pts) // 20)
        (raw,) = ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, markersize=3, alpha=0.3 if window > 1 else 1.0,
                         label=k if window == 1 else "_nolegend_")
        if window > 1:
            ax.plot(xs, trailing_mean(ys, window), color=raw.get_color(), label=f"{k} (mean of last {window})")
    for i, (first, last) in enumerate(warmup_spans(rows)):
        ax.axvspan(first - 0.5, last + 0.5, color="grey", alpha=0.15, label="critic warm-up" if i == 0 else "_nolegend_")
    fig.suptitle(run_name, fontsize=9)
    ax.set_title(panel_title(name, title, rows), fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(run: Path) -> list[Path]:
    rows = read_metrics(run)
    out = run / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for name, keys, title, ylabel in PANELS:
        fig = figure(rows, run.resolve().name, name, keys, title, ylabel)
        if fig is None:
            continue
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
