"""Algorithms as thin registry entries over `sao/algo` (docs/algorithm.md §7, docs/architecture.md §7).

Each entry says how advantages are made and which policy loss is used; the learner reads these
fields, so there is no `if name == ...` chain anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantage: str  # "gae" (critic), "group" (GRPO), "running_mean"
    policy_loss: str  # "dis" (against the rollout policy) or "ppo" (against pi_old)
    critic_updates: int | None = None  # override critic.updates_per_step (None: use config)
    freeze_attention: bool | None = None  # override critic.freeze_attention
    step_values: str | None = None  # "last"/"mean": step-level GAE ablation
    group_size: int = 1  # rollouts per prompt (>1 only for group baselines)
    doc: str = ""

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algo: Algorithm) -> Algorithm:
    ALGORITHMS[algo.name] = algo
    return algo


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algo.name: unknown algorithm {name!r} (known: {', '.join(sorted(ALGORITHMS))})")
    return ALGORITHMS[name]


register_algorithm(Algorithm("sao", "gae", "dis", doc="SAO: one rollout, critic GAE (K=2, frozen attention), DIS"))
register_algorithm(Algorithm("sao_k1", "gae", "dis", critic_updates=1, doc="ablation: one critic step per actor step"))
register_algorithm(Algorithm("sao_no_freeze", "gae", "dis", freeze_attention=False, doc="ablation: critic attention trains"))
register_algorithm(Algorithm("sao_step_gae", "gae", "dis", step_values="last", doc="ablation: step-level GAE (App. A.1)"))
register_algorithm(Algorithm("vapo", "gae", "ppo", doc="VAPO-style: critic GAE, PPO clip vs pi_old, no DIS"))
register_algorithm(Algorithm(
    "running_mean", "running_mean", "dis",
    doc="one rollout; advantage = reward - mean of the last N rewards (per prompt or global); DIS",
))
