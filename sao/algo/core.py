"""Masked reductions over action tokens. Every function takes explicit tensors and numbers."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean of `x` over positions where `mask` is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance over masked positions."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, min_std: float = 1e-6) -> torch.Tensor:
    """(x - mean) / std over masked positions; zero outside the mask. The std is floored so that a
    batch of (numerically) equal values whitens to ~0, not to rounding noise of unit scale."""
    mean = masked_mean(x, mask)
    std = masked_var(x, mask).clamp(min=0).sqrt().clamp(min=min_std)
    return (x - mean) / std * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over action tokens (docs/algorithm.md §5); nan when Var(R) is (numerically) 0,
    e.g. a batch whose rewards are all equal."""
    var_r = masked_var(returns, mask)
    if var_r.item() < 1e-8:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask) / var_r)
