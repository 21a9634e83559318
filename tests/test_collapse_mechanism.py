"""The mechanism of the long async collapse on the vs_trl addition task (docs/performance.md, "Long async runs").

The collapsed run answers "4" to every "What is a+b?" (a, b in 0..4): 4 is the most frequent sum (5 of
25 prompts), so "4 everywhere" is the best policy among those that ignore the prompt (reward 0.2). Its
checkpoint shows an actor that ignores the prompt (p("4") = 0.998 on all 25) and a critic whose values
are the same for all 25 (std 1e-5, explained variance 0).

These bandits pin what that means, with sao's own advantage and loss code (skip-observation GAE +
whitening as `algo.name=sao` with a prompt-blind critic, GRPO group advantages, the per-prompt
running mean, the DIS loss) on a softmax policy over the answers 0..8:
- a policy that cannot see the prompt converges to the modal answer under every one of these
  baselines, per-prompt ones included: the collapse is the prompt-blind policy's optimum;
- a policy that can see the prompt, trained with the prompt-blind critic's advantages (reward minus
  one value for every prompt, whitened), learns the sums: a prompt-blind baseline alone does not
  make the modal answer win;
- on a prompt where the modal answer is wrong, that baseline gives it a negative advantage.
"""

from __future__ import annotations

import torch

from sao.algo.baselines import RunningMeanBaseline, group_advantages
from sao.algo.core import masked_whiten
from sao.algo.gae import length_adaptive_lambda, skip_observation_gae
from sao.algo.losses import dis_policy_loss

PROMPTS = [(a, b) for a in range(5) for b in range(5)]
ANSWERS = 9  # 0..8
MODE = 4  # the most frequent sum


class Bandit:
    """One-token answers to the 25 prompts; `prompt_aware` adds a logit table per prompt."""

    def __init__(self, prompt_aware: bool, seed: int):
        torch.manual_seed(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.shared = torch.zeros(ANSWERS, requires_grad=True)
        self.table = torch.zeros(len(PROMPTS), ANSWERS, requires_grad=prompt_aware)
        params = [self.shared] + ([self.table] if prompt_aware else [])
        self.opt = torch.optim.Adam(params, lr=0.05)
        self.value = 0.0  # a prompt-blind critic: one value for every prompt, fit to the mean return
        self.running = RunningMeanBaseline(window=8, per_prompt=True)

    def logprobs(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.shared + self.table[idx]).log_softmax(-1)

    def step(self, baseline: str, batch: int = 16, group: int = 4) -> None:
        n = batch // group if baseline == "group" else batch
        idx = torch.randint(len(PROMPTS), (n,), generator=self.gen)
        if baseline == "group":
            idx = idx.repeat_interleave(group)
        lp = self.logprobs(idx)
        act = torch.multinomial(lp.detach().exp(), 1, generator=self.gen)[:, 0]
        rewards = torch.tensor([float(a == sum(PROMPTS[i])) for i, a in zip(idx.tolist(), act.tolist())])
        mask = torch.ones(len(idx), 1)
        adv = self.advantages(baseline, idx, rewards, mask)
        token_lp = lp.gather(1, act[:, None])
        loss, _ = dis_policy_loss(token_lp, token_lp.detach(), adv, mask, eps_low=0.3, eps_high=5.0)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def advantages(self, baseline: str, idx, rewards, mask) -> torch.Tensor:
        if baseline == "critic":  # algo.name=sao with a critic that gives every prompt the same value
            values = torch.full_like(mask, self.value)
            lam = length_adaptive_lambda(mask.sum(1))
            adv, returns = skip_observation_gae(rewards[:, None], values, mask, 1.0, lam)
            self.value += 0.2 * float(returns.mean() - self.value)
            return masked_whiten(adv, mask, min_std=0.05)
        if baseline == "group":
            return group_advantages(rewards, [str(i) for i in idx.tolist()])[:, None]
        keys = [str(i) for i in idx.tolist()]  # running_mean, per prompt
        return torch.tensor(self.running.advantages(rewards.tolist(), keys))[:, None]

    def greedy(self) -> list[int]:
        with torch.no_grad():
            return self.logprobs(torch.arange(len(PROMPTS))).argmax(-1).tolist()

    def p_mode(self) -> torch.Tensor:
        with torch.no_grad():
            return self.logprobs(torch.arange(len(PROMPTS)))[:, MODE].exp().detach()


def _train(prompt_aware: bool, baseline: str, steps: int = 300, seed: int = 0) -> Bandit:
    bandit = Bandit(prompt_aware, seed)
    for _ in range(steps):
        bandit.step(baseline)
    return bandit


def test_a_prompt_blind_policy_converges_to_the_modal_answer_under_every_baseline():
    # groups of 4 see 4 prompts a step, not 16: they get twice the steps
    for baseline, steps in (("critic", 300), ("running_mean", 300), ("group", 600)):
        bandit = _train(prompt_aware=False, baseline=baseline, steps=steps)
        assert bandit.greedy() == [MODE] * len(PROMPTS), baseline
        assert float(bandit.p_mode().min()) > 0.75, (baseline, float(bandit.p_mode().min()))


def test_a_prompt_aware_policy_learns_the_sums_with_the_prompt_blind_critic():
    bandit = _train(prompt_aware=True, baseline="critic")
    correct = sum(g == a + b for g, (a, b) in zip(bandit.greedy(), PROMPTS))
    assert correct >= 23, correct
    wrong_mode = [p for i, p in enumerate(bandit.p_mode().tolist()) if sum(PROMPTS[i]) != MODE]
    assert max(wrong_mode) < 0.2, max(wrong_mode)


def test_the_prompt_blind_critic_gives_the_modal_answer_a_negative_advantage_where_it_is_wrong():
    # the collapsed state: every prompt answered 4, reward 1 on the 5 prompts whose sum is 4; the critic's
    # one value for every state is the mean return, 0.2 (the run's checkpoint: 0.191)
    rewards = torch.tensor([float(a + b == MODE) for a, b in PROMPTS])[:, None]
    mask = torch.ones_like(rewards)
    adv, _ = skip_observation_gae(rewards, torch.full_like(mask, 0.2), mask, 1.0, length_adaptive_lambda(mask.sum(1)))
    adv = masked_whiten(adv, mask, min_std=0.05)[:, 0]
    right = rewards[:, 0].bool()
    assert bool((adv[~right] < 0).all()) and bool((adv[right] > 0).all())
    assert abs(float(adv.sum())) < 1e-4  # over all prompts the pushes on "4" cancel: no net drift
    # a per-prompt baseline that has seen these answers gives every one of them 0: nothing to learn
    keys = [f"{a}+{b}" for a, b in PROMPTS]
    running = RunningMeanBaseline(window=8, per_prompt=True)
    running.advantages(rewards[:, 0].tolist(), keys)
    assert running.advantages(rewards[:, 0].tolist(), keys) == [0.0] * len(PROMPTS)
    assert group_advantages(rewards[:, 0], keys).abs().max() == 0.0
