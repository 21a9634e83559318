"""The critic: the actor's architecture (its first `critic.depth` share of decoder layers by default) with a
zero-initialized scalar value head (docs/algorithm.md §5).

Built as a `transformers` token-classification model with one label, so it saves and loads in
plain HF format (`AutoModelForTokenClassification`). `values[:, t]` is V(s_t), the value of the
prefix ids[:t] (the state in which token t is chosen): the head's output at position t-1.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForTokenClassification


def critic_layers(actor_layers: int, num_layers: int | None = None, depth: float = 1.0) -> int:
    """How many of the actor's first decoder layers the critic keeps: `num_layers` when given, else
    ceil(depth x actor_layers), at least 1 (critic.num_layers, critic.depth; docs/algorithm.md §5)."""
    if num_layers is not None:
        return min(num_layers, actor_layers)
    return max(1, min(actor_layers, math.ceil(depth * actor_layers - 1e-9)))


def build_critic(actor_path: str | Path, dtype: torch.dtype = torch.float32, meta: bool = False,
                 num_layers: int | None = None, depth: float = 1.0):
    """Critic initialized from the actor checkpoint; value head zeroed so V starts at 0. `meta`: the same
    model on the meta device, no weight read (a trainer rank that receives them, docs/ranks.md §1).
    `num_layers` / `depth`: keep only the first decoder layers (`critic_layers`; the rest of the
    checkpoint's layers are not loaded): a critic that costs that share of the actor's layers per pass."""
    config = AutoConfig.from_pretrained(str(actor_path))
    config.num_labels = 1
    config.classifier_dropout = 0.0
    num_layers = critic_layers(config.num_hidden_layers, num_layers, depth)
    if num_layers < config.num_hidden_layers:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):  # per-layer attention kinds (Qwen2): the first ones
            config.layer_types = config.layer_types[:num_layers]
    if meta:
        with torch.device("meta"):
            return AutoModelForTokenClassification.from_config(config, dtype=dtype)
    critic = AutoModelForTokenClassification.from_pretrained(str(actor_path), config=config, dtype=dtype)
    with torch.no_grad():
        critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    return critic


def load_critic(path: str | Path, dtype: torch.dtype = torch.float32, meta: bool = False,
                num_layers: int | None = None, depth: float = 1.0):
    """A saved critic (as saved: `num_layers` and `depth` apply only to what follows), or any causal LM
    folder (e.g. a smaller model with the actor's tokenizer) given a zero value head by build_critic."""
    config = AutoConfig.from_pretrained(str(path))
    if not any(a.endswith("ForTokenClassification") for a in (config.architectures or [])):
        return build_critic(path, dtype, meta, num_layers, depth)
    if meta:
        with torch.device("meta"):
            return AutoModelForTokenClassification.from_config(config, dtype=dtype)
    return AutoModelForTokenClassification.from_pretrained(str(path), dtype=dtype)


def freeze_parameters(model: torch.nn.Module, pattern: str) -> int:
    """Freeze every parameter whose name matches `pattern`; return how many were frozen.

    A pattern that matches nothing is an error (docs/algorithm.md §5): a silent no-op would train a different
    critic than the config says.
    """
    rx = re.compile(pattern)
    frozen = 0
    for name, p in model.named_parameters():
        if rx.search(name):
            p.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        raise ValueError(f"critic.freeze_pattern {pattern!r} matches no parameter of the critic")
    return frozen


def critic_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) ids -> (B, T) values aligned with token positions (V(s_t) at t; 0 at t=0).

    Packed rows (sao/trainer/packing.py) pass `position_ids` and, for full-attention Llama/Qwen models,
    the batch's 4-D block-causal mask built once (`attention_mask`), else no mask."""
    head = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=False).logits[..., 0].float()  # (B, T)
    return torch.nn.functional.pad(head[:, :-1], (1, 0))
