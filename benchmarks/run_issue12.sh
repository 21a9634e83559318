#!/bin/bash
# The issue-12 measurements in one go (reduced sizes for a shared 2-core machine), under the shared
# benchmark lock: the train-step cost, stability on the one-turn addition task, async vs sync.
#   flock /tmp/bench.lock bash benchmarks/run_issue12.sh [steps_addition] [steps_default]
set -e
A=${1:-60}
D=${2:-30}
PY=${PYTHON:-python}
$PY benchmarks/train_step.py --batches 4 --repeats 2
$PY benchmarks/stability.py --tasks addition --seeds 0 1 2 --steps-addition "$A" \
    --modes sync async async:runtime.issue_ahead=1 --out benchmarks/results/stability_addition.json
$PY benchmarks/async_vs_sync.py --steps "$D" --reps 3
