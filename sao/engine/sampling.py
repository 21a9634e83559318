"""Sampling one token per row and the log-prob of that token under the distribution sampled from.

A row whose `SamplingParams.seed` is set draws its token from that seed and the token's position in the
sequence alone (`position_seed`), by inverse CDF: the draw does not depend on which other rows share the batch,
in what order requests arrived, or what the engine sampled before. Evaluation sets it per episode
(`episode_seed`), so two policies evaluated on the same games with the same seed use common random numbers:
where their distributions agree they sample the same tokens, and a paired difference between them measures
the policies, not the luck of the draw.
"""

from __future__ import annotations

import hashlib

import torch

from sao.types import SamplingParams

_MASK63 = (1 << 63) - 1


def _mix(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & _MASK63


def episode_seed(seed: int, index: int, task_id: str) -> int:
    """The sampling seed of the `index`-th episode of an evaluation on task `task_id` (a repeated task gets
    a seed of its own per repeat)."""
    return _mix("episode", seed, index, task_id)


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw at `position` (0-based, prompt included) of a sequence sampled with `seed`."""
    return _mix("position", seed, position)


def _keyed_draw(probs: torch.Tensor, key: int) -> int:
    """Inverse-CDF draw from `probs` (V,) with a uniform that depends on `key` only."""
    u = torch.rand((), generator=torch.Generator().manual_seed(key), dtype=torch.float64)
    cdf = probs.double().cumsum(0)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), probs.numel() - 1)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator,
    positions: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) logits -> sampled ids (N,) and their log-probs (N,) under the sampling distribution.

    Greedy rows (temperature 0) report the log-prob of the argmax under the model's softmax. Rows with a
    seed draw from (seed, positions[i]) when `positions` is given (see the module docstring), the others
    from `generator`. Logits are upcast to float32 first, so a bf16 forward pass still samples from fp32
    probabilities.
    """
    logits = logits.float()
    out_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    out_lp = torch.empty(logits.shape[0], device=logits.device)
    keyed = positions is not None and any(p.seed is not None for p in params)
    if not keyed and all(p.is_exact for p in params):  # the common training path: one vectorized draw
        logp = torch.log_softmax(logits, dim=-1)
        ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
    for i, p in enumerate(params):
        row = logits[i]
        if p.temperature == 0:
            tok = int(row.argmax())
            out_ids[i], out_lp[i] = tok, torch.log_softmax(row, -1)[tok]
            continue
        row = row / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) > p.top_p
            row = row.masked_fill(torch.zeros_like(row, dtype=torch.bool).scatter(0, order, drop), float("-inf"))
        logp = torch.log_softmax(row, -1)
        if keyed and p.seed is not None:
            tok = _keyed_draw(logp.exp().cpu(), position_seed(p.seed, positions[i]))
        else:
            tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
        out_ids[i], out_lp[i] = tok, logp[tok]
    return out_ids, out_lp
