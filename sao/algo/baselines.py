"""Critic-free baselines: GRPO group normalization and the running-mean baseline (docs/algorithm.md §7)."""

from __future__ import annotations

from collections import defaultdict, deque

import torch


def group_advantages(rewards: torch.Tensor, group_ids: list[str], eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (R - mean_G) / (std_G + eps) per trajectory, groups given by prompt id.  (B,) -> (B,)"""
    out = torch.zeros_like(rewards)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    for idx in groups.values():
        r = rewards[idx]
        std = r.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0)
        out[idx] = (r - r.mean()) / (std + eps)
    return out


class RunningMeanBaseline:
    """Advantage = reward - mean of the last N rewards (per prompt, or one global window).

    Stateful by nature (a window of past rewards), so it is a small object, not a pure function.
    The mean excludes the current reward: each sample is judged against what came before it.
    """

    def __init__(self, window: int, per_prompt: bool):
        self.window = window
        self.per_prompt = per_prompt
        self._history: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def advantages(self, rewards: list[float], prompt_ids: list[str]) -> list[float]:
        out = []
        for r, pid in zip(rewards, prompt_ids):
            hist = self._history[pid if self.per_prompt else "__global__"]
            base = sum(hist) / len(hist) if hist else 0.0
            out.append(r - base)
            hist.append(r)
        return out

    def state_dict(self) -> dict[str, list[float]]:
        return {k: list(v) for k, v in self._history.items()}
