"""Sampling one token per row and the log-prob of that token under the distribution sampled from."""

from __future__ import annotations

import torch

from sao.types import SamplingParams


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) logits -> sampled ids (N,) and their log-probs (N,) under the sampling distribution.

    Greedy rows (temperature 0) report the log-prob of the argmax under the model's softmax.
    Logits are upcast to float32 first, so a bf16 forward pass still samples from fp32 probabilities.
    """
    logits = logits.float()
    out_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    out_lp = torch.empty(logits.shape[0], device=logits.device)
    exact = [i for i, p in enumerate(params) if p.is_exact]
    if len(exact) == len(params):  # the common training path: one vectorized draw
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
        tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
        out_ids[i], out_lp[i] = tok, logp[tok]
    return out_ids, out_lp
