"""Critic-free baselines: GRPO group normalization and the running-mean baseline (docs/algorithm.md §7)."""

from __future__ import annotations

from collections import defaultdict, deque

import torch


def group_advantages(rewards: torch.Tensor, group_ids: list[str], eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (R - mean_G) / (std_G + eps) per trajectory, std over the group (population).  (B,) -> (B,)

    A group whose rewards are all equal gets advantage 0: it carries no signal about which
    rollout was better.
    """
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
    The mean excludes the current reward: each sample is judged against what came before it; the
    first time a key is seen the baseline is 0. Keys must identify the prompt (its content), not one
    draw of it: a key that is new for every draw never fills its window.
    """

    def __init__(self, window: int, per_prompt: bool):
        self.window = window
        self.per_prompt = per_prompt
        self._history: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def advantages(self, rewards: list[float], prompt_keys: list[str]) -> list[float]:
        out = []
        for r, key in zip(rewards, prompt_keys):
            hist = self._history[key if self.per_prompt else "__global__"]
            base = sum(hist) / len(hist) if hist else 0.0
            out.append(r - base)
            hist.append(r)
        return out

    def state_dict(self) -> dict[str, list[float]]:
        return {k: list(v) for k, v in self._history.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self._history.clear()
        for k, v in state.items():
            self._history[k].extend(v)
