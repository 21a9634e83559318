"""Weights through shared memory: one flat float buffer plus a version counter.

The trainer `publish`es (in-place copy + version bump under a lock); engines `poll` the version
between decode steps and `load_into` their parameters. ~1 ms for a 1M-parameter model.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch


class SharedWeights:
    def __init__(self, shapes: list[tuple[int, ...]], ctx=None):
        ctx = ctx or mp.get_context("spawn")
        self.shapes = shapes
        self.numel = sum(int(torch.Size(s).numel()) for s in shapes)
        self.buffer = torch.zeros(self.numel, dtype=torch.float32).share_memory_()
        self._version = ctx.Value("q", -1, lock=False)
        self._lock = ctx.Lock()
        self.last_publish_ms = 0.0

    @classmethod
    def for_model(cls, model: torch.nn.Module, ctx=None) -> SharedWeights:
        return cls([tuple(p.shape) for p in model.parameters()], ctx)

    @property
    def version(self) -> int:
        return int(self._version.value)

    def publish(self, params: list[torch.Tensor], version: int) -> float:
        """Copy `params` into shared memory and stamp `version`; returns milliseconds taken."""
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            offset = 0
            for p in params:
                n = p.numel()
                self.buffer[offset: offset + n].copy_(p.detach().reshape(-1).float())
                offset += n
            self._version.value = version
        self.last_publish_ms = (time.perf_counter() - t0) * 1000
        return self.last_publish_ms

    def poll(self, current_version: int) -> int | None:
        v = self.version
        return v if v > current_version else None

    def load_into(self, params: list[torch.Tensor]) -> int:
        with self._lock, torch.no_grad():
            offset = 0
            for p in params:
                n = p.numel()
                p.copy_(self.buffer[offset: offset + n].view_as(p))
                offset += n
            return self.version
