"""`CriticWatch`: warns once when the critic explains none of the returns for many steps in a row.

A critic whose values are about the same for every state (explained variance ~0) turns SAO's
advantages into reward minus one number: a batch-mean baseline, bought at the cost of the critic's
passes (most of an SAO step). Seen on a randomly initialized 1.8M model (docs/performance.md, "Long
async runs"): explained variance 0.000 for 350 steps while the actor ignored the prompt. Healthy runs
of the default task dip below the threshold for at most ~30 steps in a row.

Counts only steps after the critic warm-up whose explained variance is finite (a batch whose rewards
are all equal has none and neither counts nor resets the count). The count starts again on resume.
"""

from __future__ import annotations

import math

LOW_EV = 0.05  # below this the critic explains (almost) nothing


def message(steps: int, step: int) -> str:
    return (f"sao: warning: critic/explained_variance has stayed below {LOW_EV} for {steps} steps with varying "
            f"rewards (step {step}): the critic gives about the same value to every state, so the actor's "
            "advantages are reward minus a batch mean. Likely cause: a randomly initialized or very small model "
            "whose critic cannot tell the prompts apart. Options: a pretrained critic (critic.path, sao "
            "pretrain-critic), critic.freeze_attention=false, or a critic-free algo.name (grpo, running_mean) "
            "that gets a batch-level baseline for less; critic.warn_low_ev_steps=0 silences this")


class CriticWatch:
    def __init__(self) -> None:
        self.low_steps = 0  # finite post-warm-up steps in a row with explained variance < LOW_EV
        self.warned = False

    def update(self, metrics: dict, limit: int, step: int) -> str | None:
        """Count this step; return the warning the first time the count reaches `limit` (0 = never)."""
        ev = metrics.get("critic/explained_variance")
        if ev is None or metrics.get("train/critic_warmup", 0.0) or not math.isfinite(ev):
            return None
        self.low_steps = self.low_steps + 1 if ev < LOW_EV else 0
        metrics["critic/low_ev_steps"] = float(self.low_steps)
        if limit and self.low_steps >= limit and not self.warned:
            self.warned = True
            return message(self.low_steps, step)
        return None
