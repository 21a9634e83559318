"""Global sums over the data-parallel trainer ranks: the `Reducer` (sao/algo/core.py) under torch.distributed.

Every statistic of a step (token counts, whitening mean/var, explained variance, DIS masked fractions,
logged metrics) goes through `sum`/`max` here, so N ranks holding parts of one batch compute the
numbers one process computes on the whole batch. Every rank must call them in the same order (they
are collectives); the learner's control flow depends only on global values, so it does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sao.algo.core import Reducer


class DistReducer(Reducer):
    """all_reduce over `group` (the default process group when None); results on the caller's device."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        # NCCL reduces CUDA tensors only; gloo CPU tensors
        self.device = device or torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        out = t.detach().to(self.device, copy=True)  # never in place on a caller's tensor (or a model output)
        dist.all_reduce(out, op=op, group=self.group)
        return out.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)

    def max_values(self, values: list[float]) -> list[float]:
        """Element-wise max of a list of floats over ranks, one collective (e.g. per-pass timings)."""
        if not values:
            return []
        return self.max(torch.tensor(values, dtype=torch.float64)).tolist()
