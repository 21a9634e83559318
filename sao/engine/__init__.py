"""Inference engines behind one protocol: the built-in torch engine (and, on GPUs, vLLM)."""

from sao.engine.base import Engine, WeightSource  # noqa: F401
