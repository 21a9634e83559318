"""The engine protocol (docs/architecture.md §3), its errors, and the weight-source seam engines pull weights from."""

from __future__ import annotations

from typing import Protocol

import torch

from sao.types import Generation, SamplingParams


class EngineError(RuntimeError):
    """The engine (not the environment) failed: a forward pass raised, a vLLM server died or answered
    garbage. The agent loop ends the episode with status `engine_error`; the rollout worker re-runs it."""


class ContextLengthError(ValueError):
    """A prompt does not fit the model's context length (one line, naming both lengths)."""


def check_prompt(prompt_ids: list[int], context_length: int) -> None:
    """Every engine's precondition: a non-empty prompt that leaves room for one sampled token."""
    if not prompt_ids:
        raise ValueError("generate: empty prompt")
    if len(prompt_ids) >= context_length:
        raise ContextLengthError(f"prompt of {len(prompt_ids)} tokens does not fit the model's context length "
                                 f"{context_length} (config max_position_embeddings)")


class UnsupportedModelError(ValueError):
    """The engine cannot serve this model's cache layout (sliding-window or hybrid attention)."""


class WeightSource(Protocol):
    """Where an engine finds newer weights. `poll(v)` returns the newest version if it is > v."""

    def poll(self, current_version: int) -> int | None: ...

    def load_into(self, params: list[torch.Tensor]) -> int: ...


class Engine(Protocol):
    """Tokens in, tokens out. `session` names the episode a call belongs to, so an engine may keep that
    episode's KV cache across turns; `release(session)` says the episode is over."""

    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams, session: str | None = None) -> Generation: ...

    def release(self, session: str) -> None: ...

    def update_weights(self, source: WeightSource | None = None) -> bool: ...

    async def close(self) -> None: ...
