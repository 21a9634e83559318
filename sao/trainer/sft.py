"""Supervised warm start on solved episodes (the paper's SFT stage), loss on action tokens only."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from sao.algo.core import masked_mean
from sao.models.actor import token_logprobs

Example = tuple[list[int], list[int]]  # (token ids, loss mask: 1 on tokens the model must produce)


def collate_examples(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros((len(examples), T))
    for i, (tok, m) in enumerate(examples):
        ids[i, : len(tok)] = torch.tensor(tok)
        attn[i, : len(tok)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, loss_mask


def sft_train(
    model,
    sample: Callable[[random.Random], Example],
    steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW with a 5% linear warm-up and cosine decay; returns the loss of every step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    )
    losses = []
    for step in range(steps):
        ids, attn, loss_mask = collate_examples([sample(rng) for _ in range(batch_size)], pad_id)
        logits = model(input_ids=ids, attention_mask=attn).logits
        loss = -masked_mean(token_logprobs(logits, ids), loss_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
