"""Online learning (paper §4.5): SAO vs the running-mean baseline on `style_shift`.

Superseded by `sao bench online` (sao/bench/experiments/online.yaml: the same variants, seeds and
recovery rule, plus the shared results.json / results.md / curves.png format); kept because its
per-phase stable-reward figures and plot are still referenced by the README's measured numbers.

    python benchmarks/style_shift.py [--steps 300] [--seeds 0 1 2] [--recover-at 0.8] [key=value ...]

Both algorithms run with the same seeds, model, tasks and budget; the running-mean baseline uses the
paper's online setting (one global window of the last 128 rewards, DIS loss). For every switch of
the rewarded style the script reports the steps until the 10-step moving average of the training
reward first reaches `--recover-at` (an absolute reward; the best policy earns 1), and the stable
reward of each phase (mean over its last quarter). Whether a tiny policy finds a new style at all is
a matter of exploration and varies with the seed, so every algorithm runs once per seed and the table
gives the per-seed figures with their median. Writes benchmarks/results/style_shift.json and
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

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "style_shift.yaml"
ALGOS = {
    "sao": [],
    "running_mean": ["algo.name=running_mean", "algo.running_mean_per_prompt=false", "algo.running_mean_window=128"],
}


def moving_average(xs: list[float], w: int) -> list[float]:
    return [sum(xs[max(0, i - w + 1): i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(xs))]


def phase_figures(steps: list[int], rewards: list[float], starts: list[int], total: int,
                  recover_at: float = 0.8, window: int = 10) -> dict:
    """Stable reward per phase (mean of its last quarter) and steps to recover after each switch: the
    steps from the switch until the mean reward of the last `window` steps *of the new phase* first
    reaches `recover_at` (None: not within the phase)."""
    bounds = starts + [total + 1]
    phases = [[(s, r) for s, r in zip(steps, rewards) if bounds[k] <= s < bounds[k + 1]] for k in range(len(starts))]
    stable = []
    for phase in phases:
        tail = phase[len(phase) * 3 // 4:] or phase
        stable.append(sum(r for _, r in tail) / len(tail) if tail else None)
    recovery = []
    for k in range(1, len(starts)):
        hit = None
        for i in range(window - 1, len(phases[k])):
            if sum(r for _, r in phases[k][i - window + 1: i + 1]) / window >= recover_at:
                hit = phases[k][i][0] - starts[k]
                break
        recovery.append(hit)
    return {"stable_reward": stable, "steps_to_recover": recovery}


def median_or_none(xs: list) -> float | None:
    """Median where a run that never recovered counts as slower than any that did (None if most never did)."""
    ranked = sorted(xs, key=lambda x: (x is None, x or 0))
    mid = ranked[(len(ranked) - 1) // 2]
    return None if mid is None else float(mid)


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
    for c, (name, r) in enumerate(results.items()):
        for i, run in enumerate(r["runs"]):  # one line per seed, thin, so the spread stays visible
            label = f"{name} ({len(r['runs'])} seeds)" if i == 0 else None
            axes[0].plot(run["steps"], moving_average(run["rewards"], 10), color=f"C{c}", lw=1, alpha=0.7, label=label)
            axes[1].plot(run["eval_steps"], run["eval_rewarded_choice"], color=f"C{c}", marker="o", ms=2, lw=1,
                         alpha=0.7, label=label)
    axes[0].set_ylabel("train reward (10-step avg)")
    axes[0].set_ylim(0, 1.1)
    axes[1].set_ylabel("held-out: picks rewarded style")
    axes[1].set_xlabel("trainer step")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def run_one(name: str, overrides: list[str], seed: int, stamp: str, total: int, recover_at: float) -> tuple[dict, list]:
    cfg = load_config(RECIPE, [*overrides, *ALGOS[name], f"train.seed={seed}", f"output.name=style-{name}-s{seed}-{stamp}"])
    options = StyleShiftOptions(**cfg.env.options)
    res = train(cfg, RunProgress(enabled=sys.stderr.isatty()))
    rows = [json.loads(line) for line in (Path(res.run_dir) / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    rewarded = [f"eval/chose_{options.phase_at(r['step']).rewarded}" for r in evals]
    run = {
        "seed": seed,
        "run_dir": res.run_dir,
        "steps": [r["step"] for r in train_rows],
        "rewards": [r["reward/mean"] for r in train_rows],
        "eval_steps": [r["step"] for r in evals],
        "eval_reward": [r["eval/accuracy"] for r in evals],
        "eval_rewarded_choice": [r.get(k, 0.0) for r, k in zip(evals, rewarded)],
    }
    run.update(phase_figures(run["steps"], run["rewards"], [p.start for p in options.phases], total, recover_at))
    return run, options.phases


def summarize(runs: list[dict]) -> dict:
    switches = len(runs[0]["steps_to_recover"])
    phases = len(runs[0]["stable_reward"])
    return {
        "runs": runs,
        "median_steps_to_recover": [median_or_none([r["steps_to_recover"][k] for r in runs]) for k in range(switches)],
        "recovered": [sum(r["steps_to_recover"][k] is not None for r in runs) for k in range(switches)],
        "mean_stable_reward": [sum(r["stable_reward"][k] or 0.0 for r in runs) / len(runs) for k in range(phases)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--recover-at", type=float, default=0.8, help="reward (10-step average) that counts as recovered")
    ap.add_argument("--out", default="benchmarks/results/style_shift.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # the actor lr comes from the recipe (2e-4), like every setting it holds
    common = [f"train.steps={ns.steps}", "eval.every=25",
              "eval.num_tasks=100", "output.root=runs/bench", *ns.overrides]
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in ALGOS}
    phases = StyleShiftOptions().phases
    for seed in ns.seeds:
        for name in ALGOS:
            run, phases = run_one(name, common, seed, stamp, ns.steps, ns.recover_at)
            runs[name].append(run)
            results = {n: summarize(rs) for n, rs in runs.items() if rs}
            out.write_text(json.dumps({"steps": ns.steps, "seeds": ns.seeds, "recover_at": ns.recover_at,
                                       "phases": [p.model_dump() for p in phases], "overrides": common,
                                       "results": results}, indent=2))  # after every run: a crash keeps the rest
    plot(results, phases, ns.steps, out.with_suffix(".png"))
    names = [f"phase {k} ({p.rewarded})" for k, p in enumerate(phases)]
    print(f"stable reward per phase (mean over seeds {ns.seeds}); steps until the 10-step reward reaches {ns.recover_at}")
    print(f"{'algorithm':<14}" + "".join(f"{n:>22}" for n in names) + "   per seed / median (recovered runs)")
    for name, r in results.items():
        stable = "".join(f"{s:>22.2f}" for s in r["mean_stable_reward"])
        per_switch = [f"switch {k + 1}: {[run['steps_to_recover'][k] for run in r['runs']]} / {r['median_steps_to_recover'][k]}"
                      f" ({r['recovered'][k]}/{len(r['runs'])})" for k in range(len(r["recovered"]))]
        print(f"{name:<14}{stable}   " + "; ".join(per_switch))
    print(f"results: {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
