"""Masked reductions over action tokens. Every function takes explicit tensors and numbers.

`reduce` makes a statistic global across data-parallel trainer ranks (sao/trainer/reduce.py): every
sum and count goes through `reduce.sum`, so N ranks holding parts of a batch get the numbers one
process gets on the whole batch. The default, `LOCAL`, is one process: the identity.
"""

from __future__ import annotations

import torch


class Reducer:
    """Sums over the data-parallel ranks of a trainer; this one is a single process (the identity).
    `sum`/`max` take a tensor (no grad) and return the global value, the same on every rank."""

    world = 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of every element of `x` over all ranks (e.g. a per-trajectory (B,) tensor)."""
        x = x.detach().float()
        return self.sum(x.sum()) / self.sum(x.new_tensor(float(x.numel()))).clamp(min=1)


LOCAL = Reducer()


def token_count(mask: torch.Tensor, reduce: Reducer = LOCAL) -> torch.Tensor:
    """Action tokens over all ranks, at least 1: the denominator of every token-mean loss."""
    return reduce.sum(mask.detach().sum()).clamp(min=1)


def token_mean_loss(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer = LOCAL) -> torch.Tensor:
    """This rank's share of a token-mean loss, with grad: local sum / global count. The shares of all
    ranks add up to the one-process token mean (so their gradients add up to its gradient)."""
    return (x * mask).sum() / token_count(mask, reduce)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer = LOCAL) -> torch.Tensor:
    """Token-mean of `x` over positions where `mask` is 1 (0 when the mask is empty), over all ranks.
    With a distributed `reduce` the result has no grad (a statistic; losses use token_mean_loss)."""
    return reduce.sum((x * mask).sum()) / token_count(mask, reduce)


def masked_var(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer = LOCAL) -> torch.Tensor:
    """Population variance over masked positions."""
    mean = masked_mean(x, mask, reduce)
    return masked_mean((x - mean) ** 2, mask, reduce)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, min_std: float = 1e-6,
                  reduce: Reducer = LOCAL) -> torch.Tensor:
    """(x - mean) / std over masked positions; zero outside the mask. The std is floored so that a
    batch of (numerically) equal values whitens to ~0, not to rounding noise of unit scale."""
    mean = masked_mean(x, mask, reduce)
    std = masked_var(x, mask, reduce).clamp(min=0).sqrt().clamp(min=min_std)
    return (x - mean) / std * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       reduce: Reducer = LOCAL) -> float:
    """1 - Var(R - V) / Var(R) over action tokens (docs/algorithm.md §5); nan when Var(R) is (numerically) 0,
    e.g. a batch whose rewards are all equal."""
    var_r = masked_var(returns, mask, reduce)
    if var_r.item() < 1e-8:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask, reduce) / var_r)


def stale_tokens(versions: torch.Tensor, action_mask: torch.Tensor, version: int, max_lag: int) -> torch.Tensor:
    """(B, T) bool: action tokens sampled more than `max_lag` policy versions before `version` (the version
    the step trains; `versions` holds each token's sampling version, -1 off the actions)."""
    return action_mask.bool() & (versions >= 0) & (version - versions > max_lag)

