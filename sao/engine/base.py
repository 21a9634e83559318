"""The engine protocol (docs/architecture.md §3) and the weight-source seam it pulls new weights from."""

from __future__ import annotations

from typing import Protocol

import torch

from sao.types import Generation, SamplingParams


class WeightSource(Protocol):
    """Where an engine finds newer weights. `poll(v)` returns the newest version if it is > v."""

    def poll(self, current_version: int) -> int | None: ...

    def load_into(self, params: list[torch.Tensor]) -> int: ...


class Engine(Protocol):
    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def update_weights(self, source: WeightSource) -> bool: ...
