"""Weights through shared memory: one flat float buffer plus a version counter, lock-free.

The trainer `publish`es (the only writer); engines `poll` the version between decode steps and
`load_into` their parameters. A sequence counter (odd while a copy is in progress) replaces a lock:
a reader that saw a write in progress or a changed counter copies again. Without a lock, a worker
killed halfway through reading cannot leave the trainer (or the other workers) waiting forever.
~1 ms for a 1M-parameter model.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch


def flatten(params: list[torch.Tensor]) -> torch.Tensor:
    """All parameters as one float32 vector: one buffer per publish on every backend."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).float() for p in params])


class SharedWeights:
    def __init__(self, shapes: list[tuple[int, ...]], ctx=None):
        ctx = ctx or mp.get_context("spawn")
        self.shapes = shapes
        self.numel = sum(int(torch.Size(s).numel()) for s in shapes)
        self.buffer = torch.zeros(self.numel, dtype=torch.float32).share_memory_()
        self._version = ctx.Value("q", -1, lock=False)
        self._seq = ctx.Value("q", 0, lock=False)
        self.last_publish_ms = 0.0

    @classmethod
    def for_model(cls, model: torch.nn.Module, ctx=None) -> SharedWeights:
        from sao.models.lora import engine_parameters  # a LoRA actor publishes merged weights

        return cls([tuple(p.shape) for p in engine_parameters(model)], ctx)

    @property
    def version(self) -> int:
        return int(self._version.value)

    def publish(self, params: list[torch.Tensor], version: int) -> float:
        """Copy `params` into shared memory and stamp `version`; returns milliseconds taken."""
        t0 = time.perf_counter()
        self._seq.value += 1  # odd: a write is in progress
        with torch.no_grad():
            offset = 0
            for p in params:
                n = p.numel()
                self.buffer[offset: offset + n].copy_(p.detach().reshape(-1).float())
                offset += n
        self._version.value = version
        self._seq.value += 1
        self.last_publish_ms = (time.perf_counter() - t0) * 1000
        return self.last_publish_ms

    def poll(self, current_version: int) -> int | None:
        v = self.version
        return v if v > current_version else None

    def load_into(self, params: list[torch.Tensor]) -> int:
        with torch.no_grad():
            while True:
                seq = self._seq.value
                if seq % 2:
                    time.sleep(0.0005)
                    continue
                version = self.version
                offset = 0
                for p in params:
                    n = p.numel()
                    p.copy_(self.buffer[offset: offset + n].view_as(p))
                    offset += n
                if self._seq.value == seq:
                    return version
