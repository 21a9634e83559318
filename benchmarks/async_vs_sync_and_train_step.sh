#!/bin/bash
# Async vs sync before/after packing and adaptive threads, then the train-step timing, in one go
# (reduced sizes for a shared 2-core machine), under the shared benchmark lock: async_vs_sync.py
# (3 seeds, doubling as the default-task stability check), then train_step.py (FLOPs per pass need
# no lock: train_step.py --flops). Results: benchmarks/results/async_vs_sync.json, train_step.json.
#   flock /tmp/bench.lock bash benchmarks/async_vs_sync_and_train_step.sh [steps_default] [eval_tasks]
set -e
D=${1:-30}
E=${2:-50}
PY=${PYTHON:-python}
$PY benchmarks/async_vs_sync.py --steps "$D" --reps 3 --eval-tasks "$E"
$PY benchmarks/train_step.py --batches 4 --repeats 2
