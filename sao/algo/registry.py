"""Algorithms as thin registry entries over `sao/algo` (docs/algorithm.md §7, docs/architecture.md §7).

Each entry says how advantages are made, which policy loss is used and how many rollouts a prompt
gets; the learner and the runtime read these fields, so there is no `if name == ...` chain anywhere
else. Each docstring (`doc`) says how the entry differs from the paper it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Advantage(str, Enum):
    GAE = "gae"  # a critic: token-level skip-observation GAE (docs/algorithm.md §4)
    GROUP = "group"  # GRPO's group normalization over G rollouts of one prompt
    RUNNING_MEAN = "running_mean"  # reward minus a running mean of past rewards
    PROMPT_VALUE = "prompt_value"  # SPPO: reward minus a critic's scalar value of the prompt, sigmoid(logit)
    OUTCOME = "outcome"  # C-RF: the outcome as the advantage, 2R - 1 (no baseline, no critic, no group)


class PolicyLoss(str, Enum):
    DIS = "dis"  # against the rollout policy's log-probs, one update per batch
    PPO = "ppo"  # PPO clip against pi_old, recomputed by the trainer once per batch


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantage: Advantage  # how advantages are made (a plain string of its value is accepted)
    policy_loss: PolicyLoss  # which policy loss (likewise)
    critic_updates: int | None = None  # override critic.updates_per_step (None: use config)
    freeze_attention: bool | None = None  # override critic.freeze_attention
    step_level: bool = False  # step-level GAE ablation (App. A.1): one value and one advantage per turn
    negative_filter: bool = False  # negative token filtering: a failed episode's likely tokens leave the loss
    actor_first: bool = False  # advantages from the critic before its updates; the critic updates after the actor
    doc: str = ""

    def __post_init__(self) -> None:  # a typo in a registered algorithm fails here, not mid-run
        object.__setattr__(self, "advantage", Advantage(self.advantage))
        object.__setattr__(self, "policy_loss", PolicyLoss(self.policy_loss))

    @property
    def uses_critic(self) -> bool:
        return self.advantage in (Advantage.GAE, Advantage.PROMPT_VALUE)

    @property
    def whitens(self) -> bool:
        """Advantages whitened over the batch when algo.whiten_advantages (token-level GAE only: a baseline
        advantage and SPPO's R - V(x) are used as they are)."""
        return self.advantage is Advantage.GAE

    @property
    def grouped(self) -> bool:
        """G rollouts per prompt (algo.group_size), trained together once all G have finished."""
        return self.advantage is Advantage.GROUP


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algo: Algorithm) -> Algorithm:
    ALGORITHMS[algo.name] = algo
    return algo


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algo.name: unknown algorithm {name!r} (known: {', '.join(sorted(ALGORITHMS))})")
    return ALGORITHMS[name]


register_algorithm(Algorithm("sao", Advantage.GAE, PolicyLoss.DIS, doc=(
    "SAO (paper §3): one rollout per prompt, critic with token-level skip-observation GAE, K=2 critic "
    "steps, frozen critic attention, DIS against the rollout policy; whitening is the project's default")))
register_algorithm(Algorithm("sao_k1", Advantage.GAE, PolicyLoss.DIS, critic_updates=1, doc=(
    "ablation (paper Table 2): SAO with one critic step per actor step instead of K=2")))
register_algorithm(Algorithm("sao_no_freeze", Advantage.GAE, PolicyLoss.DIS, freeze_attention=False, doc=(
    "ablation (paper Table 2): SAO whose critic trains its attention projections too")))
register_algorithm(Algorithm("sao_step_gae", Advantage.GAE, PolicyLoss.DIS, step_level=True, doc=(
    "ablation (paper App. A.1): one value per turn (algo.step_value: the state the turn starts from, or "
    "the turn mean), GAE over turns with lambda_policy from the number of turns, the turn's advantage on each of "
    "its action tokens")))
register_algorithm(Algorithm("vapo", Advantage.GAE, PolicyLoss.PPO, doc=(
    "VAPO-style (vanilla, as the SAO paper's baseline): one rollout, critic + token-level GAE, PPO clip "
    "against pi_old computed once per batch before algo.ppo_epochs x algo.ppo_minibatches updates; no DIS "
    "and none of VAPO's other additions (value pretraining is separate, no length-adaptive lambda tricks "
    "beyond SAO's own, no positive-example LM loss, no group sampling)")))
register_algorithm(Algorithm("grpo", Advantage.GROUP, PolicyLoss.PPO, doc=(
    "GRPO (DeepSeekMath, DAPO-style clip-higher 0.2/0.28): algo.group_size rollouts per prompt trained "
    "together once all have finished; advantage (R - mean_G)/std_G (population std) on every action "
    "token; PPO clip against pi_old recomputed by the trainer once per batch before algo.ppo_epochs x "
    "algo.ppo_minibatches updates; no KL penalty, no dynamic sampling, token-mean loss")))
register_algorithm(Algorithm("grpo_dis", Advantage.GROUP, PolicyLoss.DIS, doc=(
    "GRPO+DIS (the SAO paper's strongest baseline): GRPO's group sampling and group advantage, with the "
    "DIS loss against the rollout policy (one update per batch, no pi_old pass)")))
register_algorithm(Algorithm("sppo", Advantage.PROMPT_VALUE, PolicyLoss.PPO, freeze_attention=False, doc=(
    "SPPO (Sequence-Level PPO, arXiv 2604.08865; its code: github.com/sustech-nlp/SPPO, "
    "adv_estimator=sequence_level_adv): one rollout per prompt; the critic's output at the last prompt token "
    "is a logit, V(x) = sigmoid(logit) the chance of solving the prompt; A = R - V(x) from the critic before "
    "its updates, on every action token, not whitened; then critic.updates_per_step steps of binary "
    "cross-entropy on (logit, R), R in [0, 1]; PPO clip against pi_old (algo.ppo_eps_low/high). Differs "
    "from the paper's code: no dual clip (c=3), the critic is sao's (critic.depth of the actor's layers, "
    "attention trained), K full-batch critic steps instead of its mini-batches, critic warm-up per "
    "critic.warmup_steps (the paper's runs use 0), and algo.skip_uniform_rewards applies")))
register_algorithm(Algorithm("pact", Advantage.GAE, PolicyLoss.DIS, actor_first=True, doc=(
    "actor first, then an importance-corrected critic (after PACT, arXiv 2609.26355, whose text was not "
    "found: built from its one-line description): advantages from skip-observation GAE on the critic's values "
    "before any update on this batch (v0; SAO uses v2, after its K updates), the actor's DIS step, then K "
    "critic steps whose per-token squared errors are weighted by min(pi_new / pi_rollout, algo.pact_weight_clip), "
    "pi_new the actor after its step: the returns were sampled by the rollout policy, the critic should value "
    "the policy being trained. Needs critic.placement=colocated (its critic waits for the actor)")))
register_algorithm(Algorithm("crf_ntf", Advantage.OUTCOME, PolicyLoss.DIS, negative_filter=True, doc=(
    "C-RF with negative token filtering (single rollout, critic-free; after 'Rethinking Groups in "
    "Critic-Free RLVR', arXiv 2606.17250): one rollout per prompt, advantage 2R - 1 (R in [0, 1]; +1 solved, "
    "-1 failed) on every action token, not whitened; on a failed episode's rows only the algo.ntf_keep share "
    "of action tokens with the lowest rollout log-prob stay in the loss (the others are the likely false "
    "penalties a group would have cancelled); DIS against the rollout policy like every sao arm. Read from "
    "the abstract and a third-party reproduction (the paper's method section was not readable here): its "
    "eps_high of 10 is sao's algo.eps_high (default 5), and its other batch-level advantage is not built")))
register_algorithm(Algorithm("running_mean", Advantage.RUNNING_MEAN, PolicyLoss.DIS, doc=(
    "running-mean baseline (paper §4.4/§4.5): one rollout; advantage = reward - mean of the last "
    "algo.running_mean_window rewards of the same prompt (keyed by the prompt's tokens) or of one global "
    "window; DIS; never whitened (whitening would turn it into a batch-mean baseline)")))
