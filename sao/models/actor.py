"""Token log-probs of a causal LM, aligned with token positions.

Convention used throughout the project: position t of a (B, T) tensor refers to token t.
`logprobs[:, t] = log p(ids[t] | ids[:t])` comes from the logits at t-1; position 0 is 0.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) ids -> (B, T) log-probs of each token given its prefix."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) -> (B, T) entropy of the distribution that produced token t (0 at t=0); differentiable."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0))


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor,
                               entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and `token_entropy` from one log-softmax over the vocabulary (the trainer's actor
    pass needs both). The same values as the two functions; the entropy carries grad only if asked."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(picked, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Full forward pass of a right-padded batch -> (B, T) token log-probs."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    return token_logprobs(logits, input_ids)
