"""Collate finished trajectories into right-padded tensors aligned with token positions.

Every loss and advantage function works on this (B, T) layout. The model passes themselves run
on packed rows when `packing` is set (the learner sets it, sao/trainer/packing.py), so their cost
follows real tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from sao.trainer.packing import Packing
from sao.types import Trajectory


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    action_mask: torch.Tensor  # (B, T) float, 1 on sampled tokens
    behavior_logprobs: torch.Tensor  # (B, T)
    rewards: torch.Tensor  # (B, T) the outcome reward on the last action token
    scalar_rewards: torch.Tensor  # (B,)
    num_action_tokens: torch.Tensor  # (B,)
    prompt_keys: list[str]  # a digest of the prompt's token ids: the same prompt drawn twice, the same key
    group_ids: list[str]  # each row's task id: unique per draw, shared by a group's G rollouts (the group key)
    packing: Packing | None = None  # None: model passes run on the padded (B, T) batch
    versions: torch.Tensor | None = None  # (B, T) long: the policy version that sampled each token, -1 elsewhere
    trace_rows: int = 0  # the trainer records per-token values for rows 0..trace_rows-1 (sao/trainer/trace.py)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def positions(self) -> int:
        """Positions one model pass computes: packed rows R * L, or B * T padded."""
        return self.packing.positions if self.packing is not None else self.input_ids.numel()

    def rows(self, idx: torch.Tensor) -> Batch:
        """The trajectories at `idx` (a minibatch), padding kept."""
        pick = idx.tolist()
        return Batch(
            self.input_ids[idx], self.attention_mask[idx], self.action_mask[idx], self.behavior_logprobs[idx],
            self.rewards[idx], self.scalar_rewards[idx], self.num_action_tokens[idx],
            [self.prompt_keys[i] for i in pick], [self.group_ids[i] for i in pick],
            versions=None if self.versions is None else self.versions[idx], trace_rows=self.trace_rows,
        )


def collate(trajectories: list[Trajectory], pad_id: int) -> Batch:
    B = len(trajectories)
    T = max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    action_mask = torch.zeros((B, T))
    behavior = torch.zeros((B, T))
    rewards = torch.zeros((B, T))
    versions = torch.full((B, T), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        n = len(t.token_ids)
        input_ids[i, :n] = torch.tensor(t.token_ids)
        attention_mask[i, :n] = 1
        action_mask[i, :n] = torch.tensor(t.action_mask, dtype=torch.float32)
        behavior[i, :n] = torch.tensor(t.behavior_logprobs)
        if len(t.token_versions) == n:
            versions[i, :n] = torch.tensor(t.token_versions, dtype=torch.long)
        last = max(p for p, m in enumerate(t.action_mask) if m)  # reward on the last action token
        rewards[i, last] = t.reward
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        behavior_logprobs=behavior,
        rewards=rewards,
        scalar_rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        num_action_tokens=action_mask.sum(1),
        prompt_keys=[prompt_key(t) for t in trajectories],
        group_ids=[t.task_id for t in trajectories],
        versions=versions,
    )


def prompt_key(traj: Trajectory) -> str:
    """Identifies the prompt by content (task ids are per draw in generated environments)."""
    return hashlib.blake2b(repr(traj.token_ids[: traj.prompt_len]).encode(), digest_size=12).hexdigest()
