"""Supervised warm start on solved episodes (the paper's SFT stage), loss on action tokens only.

A step's examples are packed (several per row, rows as long as the longest example, position ids
restarting at 0 for each; sao/trainer/packing.py), so a step costs its real tokens, not batch x
longest: the built-in task's demos are 26-75 tokens, and a padded batch was ~44% padding. The loss is
the padded batch's (tests/test_sft.py compares loss and gradients of both layouts).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from sao.algo.core import masked_mean
from sao.models.actor import token_logprobs
from sao.trainer.packing import plan_rows

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


def pack_examples(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Examples back to back in rows as long as the longest (first-fit decreasing) -> (ids, position_ids,
    loss_mask), each (R, L). An example's first token is never a loss token (the prompt comes first), so
    no loss reads the logits of the example before it in the row."""
    lengths = [len(ids) for ids, _ in examples]
    L = max(lengths)
    rows = plan_rows(lengths, L)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    position_ids = torch.zeros_like(ids)
    loss_mask = torch.zeros((len(rows), L))
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            tok, m = examples[i]
            if m and m[0]:
                raise ValueError("an SFT example's first token cannot be a loss token (it has no prefix)")
            n = len(tok)
            ids[r, start:start + n] = torch.tensor(tok)
            position_ids[r, start:start + n] = torch.arange(n)
            loss_mask[r, start:start + len(m)] = torch.tensor(m, dtype=torch.float32)
            start += n
        position_ids[r, start:] = torch.arange(L - start)  # the tail is a segment of its own
    return ids, position_ids, loss_mask


def sft_loss(model, examples: list[Example], pad_id: int, pack: bool = True) -> torch.Tensor:
    """Mean negative log-likelihood of the loss-mask tokens, packed or as one right-padded batch."""
    if pack:
        ids, position_ids, loss_mask = pack_examples(examples, pad_id)
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    else:
        ids, attn, loss_mask = collate_examples(examples, pad_id)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    return -masked_mean(token_logprobs(logits, ids), loss_mask)


def sft_train(
    model,
    sample: Callable[[random.Random], Example],
    steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    pack: bool = True,
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
        loss = sft_loss(model, [sample(rng) for _ in range(batch_size)], pad_id, pack)
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
