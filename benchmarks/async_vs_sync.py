"""Async vs sync on the same steps: wall-clock of the training loop, plus generation-only and
training-only time.

    python benchmarks/async_vs_sync.py [--steps 60] [key=value ...]

Runs `sao train` twice with the same config and seeds (SFT model from the shared cache): once
`runtime.mode=async` (rollout process + trainer overlapping on two cores), once `runtime.mode=sync`
(generate a batch, then train, in one process). Generation-only and training-only times are the
sync run's totals of its generate and train phases. Perfect overlap would make async take
max(gen, train); no overlap, gen + train. Writes benchmarks/results/async_vs_sync.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sao.config import load_config
from sao.runtime.progress import RunProgress
from sao.runtime.train import train


def _loop_stats(run_dir: str) -> dict:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    last = steps[-1]
    return {
        "loop_wall_s": last["perf/wall_s"],
        # from the end of step 1 on: excludes the rollout process's start-up that step 1 may wait for
        "steady_wall_s": last["perf/wall_s"] - steps[0]["perf/wall_s"],
        "train_step_s_total": sum(r["perf/train_step_s"] for r in steps),
        "gen_total_s": last.get("perf/gen_total_s"),
        "train_total_s": last.get("perf/train_total_s"),
        "trainer_idle_frac": last.get("async/trainer_idle_frac"),
        "rollout_idle_frac": last.get("async/rollout_idle_frac"),
        "lag_mean": sum(r["async/lag_mean"] for r in steps) / len(steps),
        "reward_mean_last10": sum(r["reward/mean"] for r in steps[-10:]) / min(10, len(steps)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="benchmarks/results/async_vs_sync.json")
    ap.add_argument("--threads", nargs="*", default=["1,1", "1,2", "2,2"],
                    help="async thread pinnings to compare, as rollout,trainer (2,2 = torch's default on 2 cores)")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    common = [f"train.steps={ns.steps}", "eval.every=0", "eval.num_tasks=50", "output.root=runs/bench", *ns.overrides]
    results = {}
    runs = [("sync", ["runtime.mode=sync"])] + [
        (f"async_{t.replace(',', '_')}", ["runtime.mode=async", f"runtime.rollout_threads={t.split(',')[0]}",
                                          f"runtime.trainer_threads={t.split(',')[1]}"]) for t in ns.threads]
    for name, extra in runs:
        cfg = load_config(None, [*common, *extra, f"output.name={name}-{stamp}"])
        res = train(cfg, RunProgress(enabled=sys.stderr.isatty()))
        results[name] = {"run_dir": res.run_dir, "overrides": extra, **_loop_stats(res.run_dir)}
    results["async"] = results[f"async_{ns.threads[0].replace(',', '_')}"]  # the first pinning is the default
    a, s = results["async"], results["sync"]
    gen, trn = s["gen_total_s"], s["train_total_s"]
    summary = {
        "steps": ns.steps,
        "async_s": a["loop_wall_s"],
        "sync_s": s["loop_wall_s"],
        "gen_only_s": gen,
        "train_only_s": trn,
        "async_over_sync": a["loop_wall_s"] / s["loop_wall_s"],
        "async_over_max_gen_train": a["loop_wall_s"] / max(gen, trn),
        "async_steady_s": a["steady_wall_s"],
        "sync_steady_s": s["steady_wall_s"],
        "async_over_sync_steady": a["steady_wall_s"] / s["steady_wall_s"],
        "config_overrides": common,
        "runs": results,
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"{'measure':<34}{'seconds':>10}")
    for k in ("async_s", "sync_s", "gen_only_s", "train_only_s"):
        print(f"{k:<34}{summary[k]:>10.1f}")
    for t in ns.threads:
        r = results[f"async_{t.replace(',', '_')}"]
        print(f"{'async, threads rollout,trainer=' + t:<34}{r['loop_wall_s']:>10.1f}")
    print(f"{'async / sync':<34}{summary['async_over_sync']:>10.2f}")
    print(f"{'async / sync, after step 1':<34}{summary['async_over_sync_steady']:>10.2f}")
    print(f"{'async / max(gen, train)':<34}{summary['async_over_max_gen_train']:>10.2f}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
