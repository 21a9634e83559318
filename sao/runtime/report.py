"""`sao report RUN`: PNG plots of a run's metrics.jsonl (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from sao.runtime.curves import PANELS, curve_data, read_metrics

__all__ = ["PANELS", "figure", "read_metrics", "write_report"]


def figure(rows: list[dict], run_name: str, name: str, keys: list[str], title: str, ylabel: str,
           curves: dict | None = None) -> Figure | None:
    """One panel of `curve_data` (sao/runtime/curves.py): each key's raw values faint, its trailing mean,
    critic warm-up shaded, resumes as dashed lines."""
    curves = curves if curves is not None else curve_data(rows)
    panel = next((p for p in curves["panels"] if p["name"] == name), None)
    if panel is None:
        return None
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    for k, s in panel["series"].items():
        window = s["window"]
        (raw,) = ax.plot(s["x"], s["y"], marker="o" if len(s["x"]) < 20 else None, markersize=3,
                         alpha=0.3 if window > 1 else 1.0, label=k if window == 1 else "_nolegend_")
        if window > 1:
            ax.plot(s["x"], s["smooth"], color=raw.get_color(), label=f"{k} (mean of last {window})")
    for i, (first, last) in enumerate(curves["warmup"]):
        ax.axvspan(first - 0.5, last + 0.5, color="grey", alpha=0.15, label="critic warm-up" if i == 0 else "_nolegend_")
    for i, step in enumerate(curves["resumes"]):
        ax.axvline(step, color="black", linestyle="--", linewidth=0.8, label="resumed" if i == 0 else "_nolegend_")
    fig.suptitle(run_name, fontsize=9)
    ax.set_title(panel["title"], fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(run: Path) -> list[Path]:
    rows = read_metrics(run)
    curves = curve_data(rows)
    out = run / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for name, keys, title, ylabel in PANELS:
        fig = figure(rows, run.resolve().name, name, keys, title, ylabel, curves)
        if fig is None:
            continue
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
