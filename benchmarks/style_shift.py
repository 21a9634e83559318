"""Online learning (paper §4.5): SAO vs the running-mean baseline on `style_shift`.

    python benchmarks/style_shift.py [--steps 300] [key=value ...]

Both algorithms run with the same seeds, model, tasks and budget; the running-mean baseline uses the
paper's online setting (one global window of the last 128 rewards, DIS loss). For every switch of
the rewarded style the script reports the steps until the 10-step moving average of the training
reward climbs back to 80% of that algorithm's stable reward before the switch, and the stable
reward of each phase (mean over its last quarter). Writes benchmarks/results/style_shift.json and
style_shift.png (reward curves and held-out choice rate of the rewarded style, switch points shaded).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sao.config import load_config
from sao.envs.style_shift import StyleShiftOptions
from sao.runtime.progress import RunProgress
from sao.runtime.train import train

ALGOS = {
    "sao": [],
    "running_mean": ["algo.name=running_mean", "algo.running_mean_per_prompt=false", "algo.running_mean_window=128"],
}


def moving_average(xs: list[float], w: int) -> list[float]:
    return [sum(xs[max(0, i - w + 1): i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(xs))]


def phase_figures(steps: list[int], rewards: list[float], starts: list[int], total: int, window: int = 10) -> dict:
    """Stable reward per phase (mean of its last quarter) and steps to recover after each switch: the
    steps from the switch until the mean reward of the last `window` steps *of the new phase* first
    reaches 80% of the stable reward before the switch (None: not within the phase)."""
    bounds = starts + [total + 1]
    phases = [[(s, r) for s, r in zip(steps, rewards) if bounds[k] <= s < bounds[k + 1]] for k in range(len(starts))]
    stable = []
    for phase in phases:
        tail = phase[len(phase) * 3 // 4:] or phase
        stable.append(sum(r for _, r in tail) / len(tail) if tail else None)
    recovery = []
    for k in range(1, len(starts)):
        target = 0.8 * stable[k - 1] if stable[k - 1] else None
        hit = None
        for i in range(window - 1, len(phases[k])):
            if target is not None and sum(r for _, r in phases[k][i - window + 1: i + 1]) / window >= target:
                hit = phases[k][i][0] - starts[k]
                break
        recovery.append(hit)
    return {"stable_reward": stable, "steps_to_recover": recovery}


def plot(results: dict, phases, total: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    bounds = [p.start for p in phases] + [total]
    for ax in axes:
        for k, p in enumerate(phases):
            ax.axvspan(bounds[k], bounds[k + 1], color=f"C{k + 2}", alpha=0.08)
            ax.axvline(p.start, color="grey", lw=0.8, ls="--")
            if ax is axes[0]:
                ax.text(p.start + 2, 1.02, f"rewarded: {p.rewarded}", fontsize=8)
    for name, r in results.items():
        axes[0].plot(r["steps"], moving_average(r["rewards"], 10), label=name)
        axes[1].plot(r["eval_steps"], r["eval_rewarded_choice"], marker="o", ms=3, label=name)
    axes[0].set_ylabel("train reward (10-step avg)")
    axes[0].set_ylim(0, 1.1)
    axes[1].set_ylabel("held-out: picks rewarded style")
    axes[1].set_xlabel("trainer step")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="benchmarks/results/style_shift.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # a smaller actor step than calc's default: the style choice saturates within a phase otherwise
    common = ["env.name=style_shift", f"train.steps={ns.steps}", "train.lr=2e-4", "eval.every=25",
              "eval.num_tasks=100", "output.root=runs/bench", *ns.overrides]
    phases = StyleShiftOptions().phases
    results = {}
    for name, extra in ALGOS.items():
        cfg = load_config(None, [*common, *extra, f"output.name=style-{name}-{stamp}"])
        options = StyleShiftOptions(**cfg.env.options)
        phases = options.phases
        res = train(cfg, RunProgress(enabled=sys.stderr.isatty()))
        rows = [json.loads(line) for line in (Path(res.run_dir) / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if "reward/mean" in r]
        evals = [r for r in rows if "eval/accuracy" in r]
        rewarded = [f"eval/chose_{options.phase_at(r['step']).rewarded}" for r in evals]
        results[name] = {
            "run_dir": res.run_dir,
            "steps": [r["step"] for r in train_rows],
            "rewards": [r["reward/mean"] for r in train_rows],
            "eval_steps": [r["step"] for r in evals],
            "eval_reward": [r["eval/accuracy"] for r in evals],
            "eval_rewarded_choice": [r.get(k, 0.0) for r, k in zip(evals, rewarded)],
        }
        results[name].update(phase_figures(results[name]["steps"], results[name]["rewards"],
                                           [p.start for p in phases], ns.steps))
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": ns.steps, "phases": [p.model_dump() for p in phases],
                               "overrides": common, "results": results}, indent=2))
    plot(results, phases, ns.steps, out.with_suffix(".png"))
    names = [f"phase {k} ({p.rewarded})" for k, p in enumerate(phases)]
    print(f"{'algorithm':<14}" + "".join(f"{n:>22}" for n in names) + "   steps to recover after each switch")
    for name, r in results.items():
        stable = "".join(f"{(s if s is not None else float('nan')):>22.2f}" for s in r["stable_reward"])
        print(f"{name:<14}{stable}   {r['steps_to_recover']}")
    print(f"results: {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
