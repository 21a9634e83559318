"""Async vs sync on the same steps, paired and alternating, before and after packing, adaptive threads and issue_ahead=1.

    python benchmarks/async_vs_sync.py [--steps 60] [--reps 3] [--variants after before] [key=value ...]

For each variant and repetition, `sao train` runs once in `runtime.mode=sync` and once in
`runtime.mode=async` (each a process of its own, so each mode runs at its best: OpenMP threads spin in
sync and sleep when idle in async, sao/runtime/threads.py) with the same config and seed (repetition r
uses train.seed=r), the order alternating between repetitions (so a drift in machine load hits both modes alike). The runs double
as a stability check on the default task (final reward, entropy, truncated fraction, lag, held-out
accuracy per seed). Variants:
  after   the defaults (packed passes, adaptive trainer threads)
  before  `train.pack=false runtime.adaptive_threads=false runtime.issue_ahead=2` (padded passes, fixed
          1+1 pinning, the rollout side running max_lag=2 batches ahead)
Per run: loop wall-clock (from the first step's start), steady wall (after step 1), the sync run's
generation-only and training-only totals, the share of padded positions, train-step seconds per
real token, and how well step time follows real tokens (r^2 of a linear fit on real tokens and on
computed positions; the largest step time over the fit's prediction: the goal is <= 1.5).
Async perfect overlap would take max(gen, train); no overlap, gen + train.
Writes benchmarks/results/async_vs_sync.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sao.config import load_config
from sao.runtime.threads import wait_policy

VARIANTS = {"after": [], "before": ["train.pack=false", "runtime.adaptive_threads=false", "runtime.issue_ahead=2"]}


def _fit(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x -> (a, b, r^2)."""
    mx, my = statistics.mean(x), statistics.mean(y)
    sxx = sum((v - mx) ** 2 for v in x) or 1e-12
    b = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx
    a = my - b * mx
    ss_res = sum((v - a - b * u) ** 2 for u, v in zip(x, y))
    ss_tot = sum((v - my) ** 2 for v in y) or 1e-12
    return a, b, 1.0 - ss_res / ss_tot


def loop_stats(run_dir: str) -> dict:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    last = steps[-1]
    t = [r["perf/train_step_s"] for r in steps]
    tokens = [r["perf/train_tokens"] for r in steps]
    positions = [r.get("perf/train_positions", r["perf/train_tokens"]) for r in steps]
    # step time vs tokens on full steps only: critic warm-up steps run no actor pass (another cost line)
    full = [i for i, r in enumerate(steps) if not r.get("train/critic_warmup")]
    ft, fn, fp = [t[i] for i in full], [tokens[i] for i in full], [positions[i] for i in full]
    a, b, r2_tokens = _fit(fn, ft)
    r2_positions = _fit(fp, ft)[2]
    over = [ti / max(a + b * n, 1e-9) for ti, n in zip(ft, fn)]
    return {
        "loop_wall_s": last["perf/wall_s"],
        "steady_wall_s": last["perf/wall_s"] - steps[0]["perf/wall_s"],
        "train_step_s_total": sum(t),
        "gen_total_s": last.get("perf/gen_total_s"),
        "train_total_s": last.get("perf/train_total_s"),
        "trainer_idle_frac": last.get("async/trainer_idle_frac"),
        "rollout_idle_frac": last.get("async/rollout_idle_frac"),
        "lag_mean": statistics.mean(r["async/lag_mean"] for r in steps),
        "padded_frac": 1.0 - sum(tokens) / sum(positions),
        "padded_frac_of_padded_batch": statistics.mean(r.get("perf/padded_frac", 0.0) for r in steps),
        "train_s_per_1k_real_tokens": 1000 * sum(t) / sum(tokens),
        "r2_time_vs_real_tokens": r2_tokens,
        "r2_time_vs_positions": r2_positions,
        "worst_step_over_fit": max(over),
        "steps_over_1_5x_fit": sum(x > 1.5 for x in over),
        "full_steps": len(full),
        "trainer_all_cores_frac": statistics.mean(r.get("perf/trainer_all_cores_frac", 0.0) for r in steps),
        "reward_mean_last10": statistics.mean(r["reward/mean"] for r in steps[-10:]),
        "entropy_last10": statistics.mean(r.get("actor/entropy", float("nan")) for r in steps[-10:]),
        "truncated_frac_last10": statistics.mean(r["rollout/truncated_frac"] for r in steps[-10:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--eval-tasks", type=int, default=50, help="held-out tasks evaluated before and after")
    ap.add_argument("--variants", nargs="+", default=["after", "before"], choices=list(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results/async_vs_sync.json")
    ap.add_argument("--resummarize", metavar="FILE", help="recompute the figures of the runs in FILE (a results JSON, "
                    "or this script's printed JSON lines) from their run directories, and write --out")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    if ns.resummarize:
        text = Path(ns.resummarize).read_text()
        old = json.loads(text)["runs"] if text.lstrip().startswith('{\n') else [
            json.loads(line) for line in text.splitlines() if line.startswith("{")]
        runs = [{**r, **loop_stats(r["run_dir"])} for r in old]
        variants = list(dict.fromkeys(r["variant"] for r in runs))
        reps = 1 + max(r["rep"] for r in runs)
        steps = len([line for line in (Path(runs[0]["run_dir"]) / "metrics.jsonl").read_text().splitlines()
                     if "reward/mean" in line])
        summary = summarize(runs, variants, reps, {"steps": steps, "reps": reps, "resummarized_from": ns.resummarize})
        Path(ns.out).write_text(json.dumps(summary, indent=2))
        print_table(summary, variants, reps)
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    common = [f"train.steps={ns.steps}", "eval.every=0", f"eval.num_tasks={ns.eval_tasks}", "output.root=runs/bench",
              *ns.overrides]
    runs: list[dict] = []
    for rep in range(ns.reps):
        for variant in ns.variants:
            for mode in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
                name = f"{variant}-{mode}-r{rep}-{stamp}"
                overrides = [*common, *VARIANTS[variant], f"runtime.mode={mode}", f"output.name={name}",
                             f"train.seed={rep}"]
                cfg = load_config(None, overrides)  # a bad override fails here, before any run
                # each run is its own `sao train` process, as a user runs it: the OpenMP wait policy is read
                # once, when torch loads, and each mode gets its own (sao/runtime/threads.py)
                subprocess.run([sys.executable, "-m", "sao.cli", "train", *overrides,
                                *([] if sys.stderr.isatty() else ["--quiet"])], check=True)
                run_dir = str(Path(cfg.output.root) / name)
                res = json.loads((Path(run_dir) / "summary.json").read_text())
                row = {"variant": variant, "mode": mode, "rep": rep, "run_dir": run_dir,
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or wait_policy(mode) or "default (spinning)",
                       "heldout_accuracy": res["accuracy_after"], **loop_stats(run_dir)}
                runs.append(row)
                print(json.dumps(row), flush=True)
    summary = summarize(runs, ns.variants, ns.reps, {"steps": ns.steps, "reps": ns.reps, "config_overrides": common})
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print_table(summary, ns.variants, ns.reps)
    print(f"results: {out}")


def summarize(runs: list[dict], variants: list[str], reps: int, head: dict) -> dict:
    """Per variant: the paired ratios of every repetition, their medians, and run means."""
    summary: dict = {**head, "variants": {}}
    for variant in variants:
        pairs = []
        for rep in range(reps):
            s = next(r for r in runs if r["variant"] == variant and r["rep"] == rep and r["mode"] == "sync")
            a = next(r for r in runs if r["variant"] == variant and r["rep"] == rep and r["mode"] == "async")
            pairs.append({
                "async_over_sync": a["loop_wall_s"] / s["loop_wall_s"],
                "async_over_sync_steady": a["steady_wall_s"] / s["steady_wall_s"],
                "async_over_max_gen_train": a["loop_wall_s"] / max(s["gen_total_s"], s["train_total_s"]),
                "async_s": a["loop_wall_s"], "sync_s": s["loop_wall_s"],
                "gen_only_s": s["gen_total_s"], "train_only_s": s["train_total_s"],
            })
        summary["variants"][variant] = {
            "pairs": pairs,
            **{f"median_{k}": statistics.median(p[k] for p in pairs) for k in pairs[0]},
            **{f"mean_{k}": statistics.mean(r[k] for r in runs if r["variant"] == variant)
               for k in ("padded_frac", "train_s_per_1k_real_tokens", "r2_time_vs_real_tokens",
                         "r2_time_vs_positions", "worst_step_over_fit", "steps_over_1_5x_fit",
                         "trainer_all_cores_frac")},
        }
    summary["runs"] = runs
    return summary


def print_table(summary: dict, variants: list[str], reps: int) -> None:
    runs = summary["runs"]
    keys = ["async_over_sync", "async_over_sync_steady", "async_over_max_gen_train", "async_s", "sync_s",
            "gen_only_s", "train_only_s"]
    print(f"{'per repetition':<28}" + "".join(f"{v + ' r' + str(i):>12}" for v in variants for i in range(reps)))
    for k in keys:
        print(f"{k:<28}" + "".join(f"{p[k]:>12.2f}" for v in variants for p in summary["variants"][v]["pairs"]))
    print(f"{'mean over runs':<28}" + "".join(f"{v:>12}" for v in variants))
    for k in ("padded_frac", "train_s_per_1k_real_tokens", "r2_time_vs_real_tokens", "r2_time_vs_positions",
              "worst_step_over_fit", "steps_over_1_5x_fit", "trainer_all_cores_frac"):
        print(f"{k:<28}" + "".join(f"{summary['variants'][v]['mean_' + k]:>12.3f}" for v in variants))
    print(f"{'per run':<22}" + "".join(f"{c:>14}" for c in ("reward_last10", "entropy", "truncated", "lag",
                                                               "heldout_acc")))
    for r in runs:
        print(f"{r['variant'] + ' ' + r['mode'] + ' s' + str(r['rep']):<22}" + "".join(
            f"{r[c]:>14.3f}" for c in ("reward_mean_last10", "entropy_last10", "truncated_frac_last10", "lag_mean",
                                       "heldout_accuracy")))


if __name__ == "__main__":
    main()
