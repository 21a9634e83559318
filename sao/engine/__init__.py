"""Inference engines behind one protocol: the built-in torch engine and a vLLM server (engine.name)."""

from __future__ import annotations

from pathlib import Path

from sao.config import EngineConfig
from sao.engine.base import ContextLengthError, Engine, EngineError, UnsupportedModelError, WeightSource  # noqa: F401


def make_engine(cfg: EngineConfig, model_path: str | Path, *, pad_id: int, max_batch: int, seed: int,
                version: int = 0, weight_source: WeightSource | None = None, model=None) -> Engine:
    """The engine `cfg.name` names, serving the model at `model_path`.

    torch: generates with `model` when given (e.g. the trainer's own actor, in sync mode), else loads
    `model_path` onto `cfg.device`. vllm: starts a server with `cfg.python` (or attaches to `cfg.url`) and
    pushes every newer version of `weight_source` to it. Both pull weights with `update_weights()`.
    """
    if cfg.name == "vllm":
        from sao.engine.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_path, max_batch=max_batch, seed=seed, version=version,
                          weight_source=weight_source)
    from sao.device import resolve_device, resolve_dtype
    from sao.engine.torch_engine import TorchEngine

    if model is None:
        from sao.models.tiny import load_model

        model = load_model(model_path).to(resolve_device(cfg.device))
    return TorchEngine(model, pad_id, max_batch=max_batch, seed=seed, version=version, weight_source=weight_source,
                       kv_reuse=cfg.kv_reuse, recompute_after_swap=cfg.recompute_after_swap,
                       dtype=resolve_dtype(cfg.dtype))
