"""Per-run overhead of the `code` sandbox: a trivial passing run, alone and 8 at once.

    flock /tmp/bench.lock python benchmarks/sandbox_overhead.py --label after [--runs 30] [--batches 8]
    SAO_SANDBOX_MECHANISM=unshare ... --label after-unshare      # one mechanism (both versions read it)

`--impl old` measures the sandbox of a checkout older than `sao/sandbox/` (its
`sao.envs.sandbox.run_tests`): run it with PYTHONPATH pointing at that checkout. Each label is
merged into benchmarks/results/sandbox_overhead.json and the table of every label there is printed.
Figures: median wall seconds of one run (sequential), and of a batch of 8 concurrent runs (asyncio).
The committed results hold the measured passes and a "note" on the conditions they ran in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
RESULTS = Path(__file__).resolve().parent / "results" / "sandbox_overhead.json"


def _runner(impl: str):
    """(run, run_async, describe) of the sandbox before sao/sandbox/ ("old") or of sao.sandbox ("new")."""
    if impl == "old":  # an editable install may still reach the new package: ask for the old module by name
        from sao.envs import sandbox as old
        return (lambda: old.run_tests(ADD, TESTS), lambda: old.run_tests_async(ADD, TESTS),
                lambda r: (r.status, r.mechanism))
    import sao.sandbox as box

    sandbox = box.get_sandbox()
    return (lambda: sandbox.run(ADD, TESTS), lambda: sandbox.run_async(ADD, TESTS), lambda r: (r.status, r.mechanism))


def measure(runs: int, batches: int, impl: str) -> dict:
    run, run_async, describe = _runner(impl)
    status, mechanism = describe(run())  # warm-up: probes the mechanism
    assert status == "passed", status
    single = []
    for _ in range(runs):
        start = time.perf_counter()
        assert describe(run())[0] == "passed"
        single.append(time.perf_counter() - start)

    async def batch() -> float:
        start = time.perf_counter()
        results = await asyncio.gather(*(run_async() for _ in range(8)))
        assert all(describe(r)[0] == "passed" for r in results)
        return time.perf_counter() - start

    concurrent = [asyncio.run(batch()) for _ in range(batches)]
    return {"mechanism": mechanism, "runs": runs, "batches": batches,
            "single_median_s": round(statistics.median(single), 4),
            "single_p90_s": round(sorted(single)[int(0.9 * (len(single) - 1))], 4),
            "concurrent8_batch_median_s": round(statistics.median(concurrent), 4),
            "concurrent8_per_run_s": round(statistics.median(concurrent) / 8, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="e.g. before / after")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON file to merge this label into")
    parser.add_argument("--impl", choices=("old", "new"), default="new",
                        help="old: sao.envs.sandbox of a checkout before sao/sandbox/ (on PYTHONPATH)")
    args = parser.parse_args()
    results = Path(args.results)
    row = measure(args.runs, args.batches, args.impl)
    row.update(euid=os.geteuid(), cpus=os.cpu_count(), python=platform.python_version(),
               load_avg_1m=round(os.getloadavg()[0], 2), commit=_commit(),
               time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    table = json.loads(results.read_text()) if results.exists() else {}
    table[args.label] = row
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(table, indent=2) + "\n")
    print(f"{'label':<24}{'mechanism':<34}{'single median s':>16}{'8 concurrent batch s':>22}{'load 1m':>9}")
    for label, r in table.items():
        if not isinstance(r, dict):
            continue  # the "note"
        print(f"{label:<24}{r['mechanism']:<34}{r['single_median_s']:>16.3f}{r['concurrent8_batch_median_s']:>22.3f}"
              f"{r['load_avg_1m']:>9.2f}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.environ.get("PYTHONPATH") or None).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
