#!/usr/bin/env bash
# GPU check: one command on one CUDA GPU (~8 minutes on an H100/H200), each step printing one result line
# and writing JSON under $OUT (default runs/gpu-check-DATE). Nothing else in the project needs a GPU.
#
#   bash benchmarks/gpu_check.sh --fetch-wheels          here (network): the wheels of benchmarks/gpu_wheels.txt
#                                                        into .whl/ for the GPU machine's Python 3.12
#   bash benchmarks/gpu_check.sh [--device cuda|cpu] [key=value ...]
#
# On the GPU machine (the device tool: carry .whl; the command is this script): installs .whl/*.whl into
# /tmp/site when .whl/ exists and runs sao from this checkout (PYTHONPATH), then
#   1. the default `sao train` (calc, built-in model) shortened to GPU_CHECK_STEPS steps (default 100),
#      async and --sync, trainer and torch engine on the device, bf16 autocast over fp32 master weights:
#      held-out accuracy before/after, generation and training tokens/s, weight publish ms (train.json);
#   2. randomly initialized Qwen2-0.5B and -1.5B shapes (benchmarks/gpu_shapes.py): SAO and GRPO step time
#      split into critic and actor, peak GPU memory against docs/ranks.md's formula, torch-engine
#      tokens/s at 1, 8 and 32 concurrent requests (gpu_shapes.json);
#   3. the critic on its own process against the colocated critic on the same GPU
#      (benchmarks/critic_overlap.py; critic_overlap.json);
#   4. `pytest -m gpu` (tests/test_gpu.py: placement, bf16, CUDA-IPC handles, LoRA on CUDA; pytest.xml).
# Extra key=value arguments go to every `sao train`. `--device cpu` runs the same steps on the CPU with
# small sizes (the tiny shape, 15 steps): it checks everything but CUDA on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT_DIR=$PWD

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  grep -q '^/.whl/$' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  grep -v '^#' benchmarks/gpu_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl
  ls .whl
  exit 0
fi
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE=$2; shift 2; fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$ROOT_DIR:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
RUNS=${GPU_CHECK_ROOT:-/tmp/gpu-check-runs-$(date +%Y%m%d-%H%M%S)}  # run folders stay out of $OUT (few files come back)

if [ "$DEVICE" = cuda ]; then
  "$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "gpu_check.sh: no CUDA device is visible (use --device cpu to check the rest)"
print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; bf16: {torch.cuda.is_bf16_supported()}")
PYEOF
  STEPS=${GPU_CHECK_STEPS:-100}; DTYPE=bfloat16; SHAPES="qwen2-0.5b qwen2-1.5b"; ENGINE_BATCHES="1 8 32"
  TRAIN_SHAPE=""; TEST_DEVICE=cuda:0
else
  STEPS=${GPU_CHECK_STEPS:-15}; DTYPE=float32; SHAPES=tiny; ENGINE_BATCHES="1 4"
  TRAIN_SHAPE="--steps 2 --prompt 32 --action 32 --engine-tokens 16"; TEST_DEVICE=cpu
fi

# 1. the default run, async and --sync. The bf16 engine against the fp32 trainer differs by bf16 rounding
#    (measured within 1.4e-3 nats on CPU, tests/test_engine.py): parity_tol 0.1 leaves room for GPU kernels
for MODE in async sync; do
  FLAG=""; [ "$MODE" = sync ] && FLAG=--sync
  START=$(date +%s)
  "$PY" -m sao.cli train $FLAG engine.device="$DEVICE" trainer.device="$DEVICE" engine.dtype=$DTYPE \
    runtime.parity_tol=0.1 train.steps="$STEPS" output.root="$RUNS" output.name="$MODE" output.progress=false \
    "$@" > "$OUT/train-$MODE.log" 2>&1 || { tail -20 "$OUT/train-$MODE.log"; exit 1; }
  "$PY" - "$RUNS/$MODE" "$MODE" "$(( $(date +%s) - START ))" "$OUT/train.json" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
run, mode, wall, out = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
steps = [r for r in rows if "perf/train_step_s" in r]
acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
# async: the engine's tokens per busy second; sync: this step's tokens per generation second
gen = [r.get("perf/engine_tokens_per_s") or r.get("perf/tokens_per_s") for r in steps]
gen = [g for g in gen if g]
sync = [r["perf/weight_sync_ms"] for r in steps if r.get("perf/weight_sync_ms")]
res = {"mode": mode, "wall_s": wall, "steps": len(steps), "accuracy_before": acc[0] if acc else None,
       "accuracy_after": acc[-1] if acc else None,
       "generation_tokens_per_s": statistics.median(gen) if gen else None,
       "training_tokens_per_s": sum(r["perf/train_tokens"] for r in steps) / max(sum(r["perf/train_step_s"] for r in steps), 1e-9),
       "weight_publish_ms_median": statistics.median(sync) if sync else None}
old = json.loads(out.read_text()) if out.exists() else []
out.write_text(json.dumps(old + [res], indent=2))
f = lambda x, spec: "n/a" if x is None else format(x, spec)
print(f"sao train {mode}: held-out {f(res['accuracy_before'], '.3f')} -> {f(res['accuracy_after'], '.3f')} in "
      f"{res['steps']} steps, {wall} s; generation {f(res['generation_tokens_per_s'], '.0f')} tokens/s, training "
      f"{res['training_tokens_per_s']:.0f} tokens/s, weight publish {f(res['weight_publish_ms_median'], '.1f')} ms")
PYEOF
done

# 2. realistic shapes, randomly initialized here
"$PY" benchmarks/gpu_shapes.py --device "$DEVICE" --shapes $SHAPES --engine-batches $ENGINE_BATCHES $TRAIN_SHAPE \
  --out "$OUT/gpu_shapes.json"

# 3. the separate critic (critic.placement=separate, docs/ranks.md §2) against the colocated one, same device
"$PY" benchmarks/critic_overlap.py --batches 8 --repeats 3 --out "$OUT/critic_overlap.json" \
  trainer.device="$DEVICE" engine.device="$DEVICE" "$@" | tail -2

# 4. the tests that need a GPU (on --device cpu: the same tests on the CPU, CUDA IPC skipped)
SAO_GPU_TEST_DEVICE=$TEST_DEVICE "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" 2>&1 | tail -3
echo "results: $OUT"
