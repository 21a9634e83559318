#!/usr/bin/env bash
# Create .venv and install sao with the extras given as $1 (default: test), e.g. `test,tasks`.
#
# torch comes first and only when no torch is importable: `torch==2.13.0` takes the CPU wheel that
# lies on the project's CPU machines (seconds); elsewhere it is the regular PyPI build (CUDA on
# Linux x86_64), and a GPU user who already has torch keeps theirs. pyproject.toml only asks for
# torch>=2.4, so the rest of the install never replaces it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${SAO_TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -e ".[${1:-test}]"
python -c "import sao, torch; print(f'sao installed in .venv (torch {torch.__version__})')"
