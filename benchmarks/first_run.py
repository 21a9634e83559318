"""A newcomer's first run: `sao train` with the defaults from an empty cache (SFT included), per seed.

    python benchmarks/first_run.py --label after [--seeds 0 1 2] [-- key=value ...]

Each seed runs alone, in a fresh folder (its own empty `.sao_cache`, so the SFT warm start is built
as on a fresh clone), with `train.seed=S`. Written per run: wall time of the whole command, the SFT
build time, held-out accuracy before/after (200 held-out problems), the time spent writing
checkpoints (summary.json checkpoint_s), and the peak RSS of the process tree's largest process.
Each label is merged into benchmarks/results/first_run.json and the table of every label is printed.
The README's first-run figures come from here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "first_run.json"
ROOT = Path(__file__).resolve().parents[1]


def one_run(seed: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="sao-first-run-") as cwd:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", f"train.seed={seed}", *extra, "--quiet"],
                              cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed}: sao train exited {proc.returncode}: {proc.stderr[-2000:]}")
        run = Path(cwd) / re.search(r"run directory: (\S+)", proc.stdout).group(1)
        summary = json.loads((run / "summary.json").read_text())
        extra = summary["extra"]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # GB (ru_maxrss is KB on Linux)
    return {"seed": seed, "wall_s": round(wall, 1), "sft_s": round(extra["sft_s"], 1),
            "sft_built": extra["sft_built"], "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], "checkpoint_s": round(extra["checkpoint_s"], 2),
            "train_wall_s": round(summary["wall_s"], 1), "peak_rss_gb_max_so_far": round(peak, 2)}


def table(results: dict) -> str:
    lines = ["| label | seed | first run (s) | SFT (s) | held-out before -> after | checkpoints (s) |",
             "|---|---|---|---|---|---|"]
    for label, entry in results.items():
        for r in entry["runs"]:
            lines.append(f"| {label} | {r['seed']} | {r['wall_s']} | {r['sft_s']} | "
                         f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f} | {r['checkpoint_s']} |")
        walls = [r["wall_s"] for r in entry["runs"]]
        lines.append(f"| {label} | median | {statistics.median(walls)} | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    ns = ap.parse_args()
    runs = []
    for seed in ns.seeds:
        runs.append(one_run(seed, ns.overrides))
        print(json.dumps(runs[-1]), flush=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[ns.label] = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                         "overrides": ns.overrides, "runs": runs}
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
