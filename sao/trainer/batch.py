"""Collate finished trajectories into right-padded tensors aligned with token positions.

A row is one token sequence: a trajectory, or one segment of a segmented one (Trajectory.segment_starts,
an agent whose template re-renders its history or one sample per call). Then `episodes` says which rows
are one episode, in order: the outcome reward sits on the last action token of its last row, every row
carries the episode's scalar reward, and GAE runs across its rows as one chain (sao/algo/gae.py).

Every loss and advantage function works on this (B, T) layout. The model passes themselves run
on packed rows when `packing` is set (the learner sets it, sao/trainer/packing.py), so their cost
follows real tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from sao.trainer.packing import Packing
from sao.types import Trajectory, segment_rows


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
    episodes: torch.Tensor | None = None  # (B,) long: each row's episode, rows of one in order; None: a row each

    @property
    def heads(self) -> torch.Tensor:
        """(B,) bool: the first row of each episode (every row when no episode has segments)."""
        if self.episodes is None:
            return torch.ones(self.size, dtype=torch.bool)
        e = self.episodes.cpu()
        return torch.cat([torch.ones(1, dtype=torch.bool), e[1:] != e[:-1]]) if self.size else e.bool()

    def unit_keys(self) -> list[str] | None:
        """What must stay together when rows are split (over ranks): the rows of one episode; None: any row."""
        return None if self.episodes is None else [str(int(e)) for e in self.episodes]

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
            episodes=None if self.episodes is None else self.episodes[idx.to(self.episodes.device)],
        )


def collate(trajectories: list[Trajectory], pad_id: int) -> Batch:
    rows = segment_rows(trajectories)
    B = len(rows)
    T = max(b - a for _, a, b in rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    action_mask = torch.zeros((B, T))
    behavior = torch.zeros((B, T))
    rewards = torch.zeros((B, T))
    versions = torch.full((B, T), -1, dtype=torch.long)
    last_row = {i: r for r, (i, _, _) in enumerate(rows)}
    for r, (i, a, b) in enumerate(rows):
        t, n = trajectories[i], b - a
        input_ids[r, :n] = torch.tensor(t.token_ids[a:b])
        attention_mask[r, :n] = 1
        action_mask[r, :n] = torch.tensor(t.action_mask[a:b], dtype=torch.float32)
        behavior[r, :n] = torch.tensor(t.behavior_logprobs[a:b])
        if len(t.token_versions) == len(t.token_ids):
            versions[r, :n] = torch.tensor(t.token_versions[a:b], dtype=torch.long)
        if last_row[i] == r:  # the outcome reward on the episode's last action token
            rewards[r, max(p for p, m in enumerate(t.action_mask[a:b]) if m)] = t.reward
    segmented = any(t.segment_starts for t in trajectories)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        behavior_logprobs=behavior,
        rewards=rewards,
        scalar_rewards=torch.tensor([trajectories[i].reward for i, _, _ in rows], dtype=torch.float32),
        num_action_tokens=action_mask.sum(1),
        prompt_keys=[prompt_key(trajectories[i]) for i, _, _ in rows],
        group_ids=[trajectories[i].task_id for i, _, _ in rows],
        versions=versions,
        episodes=torch.tensor([i for i, _, _ in rows], dtype=torch.long) if segmented else None,
    )


def prompt_key(traj: Trajectory) -> str:
    """Identifies the prompt by content (task ids are per draw in generated environments)."""
    return hashlib.blake2b(repr(traj.token_ids[: traj.prompt_len]).encode(), digest_size=12).hexdigest()
