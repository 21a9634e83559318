#!/usr/bin/env bash
# GPU check (one CUDA GPU, a few minutes): the default `sao train` on the GPU with bf16 autocast over
# float32 master weights (engine.device=cuda engine.dtype=bfloat16), then generation and training
# tokens/s from the run's metrics. Extra key=value arguments are passed to `sao train`
# (e.g. train.steps=100). Nothing else in the project needs a GPU; the torch engine is used (the
# vLLM server on a GPU machine: add engine.name=vllm engine.python=... engine.weight_transport=ipc).
#
# Then the critic on its own process against the colocated critic (benchmarks/critic_overlap.py, one GPU).
# Then, with two or more GPUs, the trainer on 2 FSDP2 ranks over NCCL (bf16 params, fp32 reduce:
# sao/trainer/distributed.py) for 5 steps; with one GPU that part is skipped (NCCL needs a GPU per rank).
#
#   bash benchmarks/gpu_check.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "gpu_check.sh: no CUDA device is visible"
print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; bf16: {torch.cuda.is_bf16_supported()}")
PYEOF
ROOT=${GPU_CHECK_ROOT:-runs}
NAME=gpu-check-$(date +%Y%m%d-%H%M%S)
START=$(date +%s)
# bf16 engine vs bf16 trainer differ by bf16 rounding (KV cache vs a full pass), hence the wider parity gate
"$PY" -m sao.cli train engine.device=cuda engine.dtype=bfloat16 runtime.parity_tol=0.1 \
  output.root="$ROOT" output.name="$NAME" output.progress=false "$@"
echo "wall: $(( $(date +%s) - START )) s (SFT warm start included when not cached)"
"$PY" - "$ROOT/$NAME" <<'PYEOF'
import json, sys
from pathlib import Path
rows = [json.loads(x) for x in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
steps = [r for r in rows if "perf/train_step_s" in r]
gen = [r["perf/engine_tokens_per_s"] for r in steps if r.get("perf/engine_tokens_per_s")]
train_tok = sum(r["perf/train_tokens"] for r in steps)
train_s = sum(r["perf/train_step_s"] for r in steps)
acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
print(f"generation: {gen[-1] if gen else float('nan'):.0f} tokens/s (rollout engine, while busy)")
print(f"training:   {train_tok / max(train_s, 1e-9):.0f} tokens/s ({len(steps)} optimizer steps)")
print(f"held-out accuracy: {acc[0] if acc else float('nan'):.3f} -> {acc[-1] if acc else float('nan'):.3f}")
PYEOF

# The critic on its own process, one batch ahead (critic.placement=separate, docs/ranks.md §2), against
# the colocated sequence, both on this GPU: per-step wall, the share of the critic's time hidden
"$PY" benchmarks/critic_overlap.py --batches 8 --repeats 3 --out "$ROOT/$NAME-critic-overlap.json" \
  trainer.device=cuda "$@"

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -ge 2 ]; then
  "$PY" -m sao.cli train trainer.ranks=2 trainer.device=cuda engine.device=cuda engine.dtype=bfloat16 \
    runtime.parity_tol=0.1 train.steps=5 output.root="$ROOT" output.name="$NAME-ranks2" output.progress=false "$@"
  echo "trainer.ranks=2 on CUDA: ok ($ROOT/$NAME-ranks2)"
else
  echo "trainer.ranks=2 on CUDA: skipped ($NGPU GPU; FSDP2 over NCCL needs one GPU per rank)"
fi
