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


def outcome_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """C-RF (crf_ntf, docs/algorithm.md §7): the outcome itself as the advantage, 2R - 1 for R in [0, 1]:
    +1 for a solved task, -1 for a failed one, no baseline and no group.  (E,) -> (E,)"""
    return 2.0 * rewards.float() - 1.0


def negative_token_filter(advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor,
                          keep: float) -> torch.Tensor:
    """Negative token filtering (crf_ntf): on a row whose advantage is negative only the ceil(keep * n) of its
    n action tokens the rollout policy found least likely stay in the loss (ties: the earlier token); a
    row with advantage >= 0 keeps every action token. The rest would be false penalties: tokens a failed
    episode shares with successful ones are the likely ones.  (B, T) each -> (B, T) bool, the tokens kept."""
    on = mask.bool()
    negative = ((advantages < 0) & on).any(1, keepdim=True)
    lp = torch.where(on, logprobs.float(), torch.inf)
    order = torch.sort(lp, dim=1, stable=True).indices  # least likely first; a tie keeps position order
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(lp.shape[1], device=lp.device).expand_as(order).contiguous())
    k = torch.ceil(on.sum(1, keepdim=True) * keep - 1e-9).clamp(min=1)
    return torch.where(negative, on & (rank < k), on)


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
