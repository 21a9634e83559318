"""Packed training batches: several trajectories per row, so a pass costs real tokens, not B x longest.

    rows     whole trajectories back to back, first-fit decreasing into rows as long as the longest
             trajectory (so attention per row costs no more than one padded row did)
    position ids restart at 0 for every trajectory; with no 2-D attention mask, transformers builds
             a block-diagonal causal mask from them (transformers' masking_utils,
             `find_packed_sequence_indices`; flash/sdpa/eager alike), so no token sees another
             trajectory
    mask     that mask is built once per batch and given (4-D) to every pass of the step, the critic's
             and the actor's, instead of each pass rebuilding it (`attention_mask`; same bits)
    unpack   one gather brings (R, L) outputs back to the (B, T) padded layout, so GAE, DIS and the
             value loss see exactly the tensors of the padded path (tests/test_packing.py compares
             losses and gradients of both paths)

Shifted quantities (token t's log-prob comes from the logits at t-1) are computed in the packed
layout before unpacking: inside a trajectory t-1 is in the same segment; a segment's first position
would read the previous segment's last output, so it unpacks to 0, as position 0 is in the padded path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.masking_utils import create_causal_mask

from sao.models.actor import token_logprobs_and_entropy
from sao.models.critic import critic_values


@dataclass
class Packing:
    input_ids: torch.Tensor  # (R, L) trajectories back to back, pad_id after the last one
    position_ids: torch.Tensor  # (R, L) 0.. within each trajectory (and within the padding tail)
    index: torch.Tensor  # (B, T) flat index into R*L of each token of the padded layout (0 on padding)
    valid: torch.Tensor  # (B, T) bool, a real token that has a prefix (position 0 never has one)
    # 4-D attention masks built from position_ids, per (attention implementation, dtype): see attention_mask
    masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def positions(self) -> int:
        """Positions a forward pass computes (R * L)."""
        return self.input_ids.numel()

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Shifted (R, L) outputs (token t from position t-1) -> (B, T), zero on padding and at t=0 as
        in the padded path; differentiable."""
        out = x.reshape(-1)[self.index]
        return torch.where(self.valid, out, x.new_zeros(()))


def plan_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: lists of trajectory indices whose lengths sum to <= capacity."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packing:
    """Right-padded (B, T) ids and mask -> packed rows of length T (the longest trajectory)."""
    lengths = attention_mask.sum(1).tolist()
    B, L = input_ids.shape
    rows = plan_rows(lengths, L)
    packed = torch.zeros((len(rows), L), dtype=torch.long)  # the tail's ids never reach a real token
    position_ids = torch.zeros((len(rows), L), dtype=torch.long)
    index = torch.zeros((B, L), dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            n = lengths[i]
            packed[r, start:start + n] = input_ids[i, :n]
            position_ids[r, start:start + n] = torch.arange(n)
            index[i, :n] = r * L + start + torch.arange(n)
            start += n
        position_ids[r, start:] = torch.arange(L - start)  # the tail is a segment of its own
    valid = attention_mask.bool().clone()
    valid[:, 0] = False  # a segment's first position would read the previous segment's last output
    return Packing(packed, position_ids, index, valid)


# architectures whose forward builds one full-attention mask with `create_causal_mask` and uses a 4-D
# mask given to it as is (others, e.g. sliding-window layers, build more than one: they build their own)
_MASK_REUSE_MODELS = ("llama", "qwen2", "qwen3")


def attention_mask(model, p: Packing) -> torch.Tensor | None:
    """The block-diagonal causal mask transformers builds from the packed position ids, built once per
    batch and kept: every pass of a step (K critic updates, v2, the actor) would rebuild the same one.
    The model uses a given 4-D mask as is, so its outputs are the same bit for bit
    (tests/test_packing.py). None where reuse does not apply: the model then builds its own."""
    config = model.config
    if config.model_type not in _MASK_REUSE_MODELS or set(getattr(config, "layer_types", None)
                                                           or ["full_attention"]) != {"full_attention"}:
        return None
    dtype = model.get_input_embeddings().weight.dtype  # that of the embeddings the model builds it from
    key = (config._attn_implementation, dtype)
    if key not in p.masks:
        embeds = p.input_ids.new_empty((*p.input_ids.shape, 0), dtype=dtype)  # only its shape, dtype, device count
        mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                                  position_ids=p.position_ids)
        p.masks[key] = mask if isinstance(mask, torch.Tensor) and mask.ndim == 4 else None
    return p.masks[key]


def _inputs(batch, model) -> dict:
    """Model inputs of a batch: packed rows + position ids (+ the kept 4-D mask), or the padded batch +
    attention mask."""
    p = batch.packing
    if p is None:
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    return {"input_ids": p.input_ids, "position_ids": p.position_ids, "attention_mask": attention_mask(model, p),
            "use_cache": False}


def actor_logprobs(actor, batch, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One actor forward -> (logprobs (B, T) with grad, entropy (B, T); with grad only if asked)."""
    kw = _inputs(batch, actor)
    logits = actor(**kw).logits  # (R, L, V) or (B, T, V)
    # one log-softmax for both; the entropy is a metric only unless an entropy bonus is on
    logprobs, entropy = token_logprobs_and_entropy(logits, kw["input_ids"], entropy_grad)
    if batch.packing is not None:
        logprobs, entropy = batch.packing.unpack(logprobs), batch.packing.unpack(entropy)
    return logprobs, entropy


def critic_forward(critic, batch) -> torch.Tensor:
    """One critic forward -> values (B, T), V(s_t) at t (grad follows the caller's mode)."""
    kw = _inputs(batch, critic)
    values = critic_values(critic, kw["input_ids"], kw.get("attention_mask"), kw.get("position_ids"))
    return values if batch.packing is None else batch.packing.unpack(values)
