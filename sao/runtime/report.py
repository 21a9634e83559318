"""`sao report RUN`: PNG plots of a run's metrics.jsonl (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

from sao.config import ConfigError

PANELS = [
    ("reward", ["reward/mean"], "train reward (batch mean)"),
    ("eval_accuracy", ["eval/accuracy"], "held-out accuracy"),
    ("dis_masked", ["dis/masked_low_frac", "dis/masked_high_frac"], "DIS masked token fraction"),
    ("critic", ["critic/explained_variance"], "critic explained variance"),
    ("value_loss", ["critic/value_loss"], "critic value loss"),
    ("grad_norms", ["actor/grad_norm", "critic/grad_norm"], "gradient norms"),
    ("lag", ["async/lag_mean", "async/lag_max"], "staleness (policy versions)"),
    ("idle", ["async/trainer_idle_frac", "async/rollout_idle_frac"], "idle fraction"),
    ("throughput", ["perf/tokens_per_s"], "generated tokens / s"),
    ("entropy", ["actor/entropy"], "policy entropy (action tokens)"),
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


def write_report(run: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run)
    out = run / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for name, keys, title in PANELS:
        series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, pts in series.items():
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 20 else None,
                        markersize=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
