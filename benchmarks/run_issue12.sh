#!/bin/bash
# The issue-12 measurements in one go (reduced sizes for a shared 2-core machine), under the shared
# benchmark lock: async vs sync before/after (3 seeds, doubling as the default-task stability check),
# then the train-step timing (FLOPs per pass need no lock: train_step.py --flops).
#   flock /tmp/bench.lock bash benchmarks/run_issue12.sh [steps_default] [eval_tasks]
set -e
D=${1:-30}
E=${2:-50}
PY=${PYTHON:-python}
$PY benchmarks/async_vs_sync.py --steps "$D" --reps 3 --eval-tasks "$E"
$PY benchmarks/train_step.py --batches 4 --repeats 2
