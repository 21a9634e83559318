"""Is async training as stable as sync? Paired runs over seeds on two tasks (docs/performance.md).

    python benchmarks/stability.py [--seeds 0 1 2] [--steps-default 60] [--steps-addition 150]
                                   [--tasks default addition] [--modes sync async ...] [key=value ...]

A mode is `sync`, `async`, or a variant with its own overrides, e.g. `async:runtime.max_lag=1` or
`async:algo.eps_high=1.0,runtime.max_lag=2`.

Tasks:
  default   `sao train` as shipped (calc, SFT warm start)
  addition  one turn of "a+b" with an untrained model: random-init Qwen2, no SFT, lr 1e-3, 16 episodes
            per step (the setting where async once collapsed, docs/performance.md §6, with ~1.8M parameters:
            pass `--large-model`; the default size, ~0.2M, is 8x cheaper per step)
For each task and seed, the modes run back to back (the order reversed on every other seed), with
the same seed. Per run: final reward (mean of the last 10 steps), actor entropy and truncated fraction
over the last 10 steps, mean lag, DIS masked fractions, held-out accuracy at the end, and the first
step at which the trailing-10 truncated fraction exceeded 0.9 (a collapse marker). Writes
benchmarks/results/stability.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from sao.config import load_config
from sao.runtime.progress import RunProgress
from sao.runtime.train import train

TASKS = {
    "default": [],
    "addition": ["env.options.max_ops=1", "env.options.ops=+", "rollout.max_turns=1", "sft.steps=0",
                 "model.arch=qwen2", "train.lr=1e-3", "train.batch_size=16"],
}
# --large-model: ~1.8M parameters (a step costs ~8x the default 0.2M model's on this machine)
LARGE_MODEL = ["model.hidden_size=192", "model.num_layers=4", "model.num_heads=4", "model.intermediate_size=512"]


def summarize(run_dir: str, accuracy: float) -> dict:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    last = steps[-10:]

    def mean(key, rows=last):
        vals = [r[key] for r in rows if key in r]
        return statistics.mean(vals) if vals else float("nan")

    trunc = [r.get("rollout/truncated_frac", 0.0) for r in steps]
    collapse = next((i + 1 for i in range(9, len(trunc)) if statistics.mean(trunc[i - 9:i + 1]) > 0.9), None)
    return {
        "run_dir": run_dir, "steps": len(steps), "final_reward": mean("reward/mean"),
        "entropy": mean("actor/entropy"), "truncated_frac": mean("rollout/truncated_frac"),
        "lag_mean": mean("async/lag_mean", steps), "masked_low": mean("dis/masked_low_frac", steps),
        "masked_high": mean("dis/masked_high_frac", steps), "heldout_accuracy": accuracy,
        "collapse_step": collapse, "wall_s": steps[-1].get("perf/wall_s"),
        "train_step_s_mean": mean("perf/train_step_s", steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--steps-default", type=int, default=60)
    ap.add_argument("--steps-addition", type=int, default=150)
    ap.add_argument("--modes", nargs="+", default=["sync", "async"])
    ap.add_argument("--large-model", action="store_true",
                    help="addition: a ~1.8M-parameter model (hidden 192, 4 layers) instead of the default ~0.2M")
    ap.add_argument("--out", default="benchmarks/results/stability.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    bad = [m for m in ns.modes if m.partition(":")[0] not in ("sync", "async")]
    if bad:  # e.g. a key=value override after --modes, which argparse hands to --modes
        ap.error(f"--modes: {bad[0]!r} is not sync, async or MODE:key=value,...; put overrides before --modes")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = []
    for task in ns.tasks:
        steps = ns.steps_default if task == "default" else ns.steps_addition
        for i, seed in enumerate(ns.seeds):
            for j, mode in enumerate(ns.modes if i % 2 == 0 else ns.modes[::-1]):
                base, _, extra = mode.partition(":")
                name = f"stab-{task}-{base}{j}-s{seed}-{stamp}"
                size = LARGE_MODEL if ns.large_model and task == "addition" else []
                cfg = load_config(None, [*TASKS[task], *size, f"train.steps={steps}", f"train.seed={seed}", "eval.every=0",
                                         "eval.num_tasks=50", "output.root=runs/bench", f"runtime.mode={base}",
                                         f"output.name={name}", *ns.overrides, *filter(None, extra.split(","))])
                res = train(cfg, RunProgress(enabled=sys.stderr.isatty()))
                row = {"task": task, "seed": seed, "mode": mode, **summarize(res.run_dir, res.accuracy_after)}
                runs.append(row)
                print(json.dumps(row), flush=True)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"overrides": ns.overrides, "large_model": ns.large_model, "modes": ns.modes,
                               "runs": runs}, indent=2))
    cols = ["final_reward", "entropy", "truncated_frac", "lag_mean", "masked_low", "heldout_accuracy", "collapse_step"]
    print(f"{'task':<10}{'mode':<34}{'seed':>5}" + "".join(f"{c:>17}" for c in cols))
    for r in runs:
        print(f"{r['task']:<10}{r['mode']:<34}{r['seed']:>5}" + "".join(
            f"{'-' if r[c] is None else format(r[c], '.3f') if isinstance(r[c], float) else r[c]:>17}" for c in cols))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
