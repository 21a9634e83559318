"""Pure math of sao/algo with expected values derived by hand in the comments."""

import math

import pytest
import torch

from sao.algo.baselines import RunningMeanBaseline, group_advantages
from sao.algo.core import explained_variance, masked_mean, masked_whiten
from sao.algo.gae import (
    length_adaptive_lambda,
    skip_observation_gae,
    skip_observation_gae_reference,
    step_level_values,
)
from sao.algo.losses import dis_policy_loss, ppo_clip_loss, value_loss


def test_two_turn_trajectory_skips_observation_and_links_actions():
    # positions: 0 prompt | 1 2 action 1 | 3 4 observation | 5 6 action 2 | 7 padding
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 9.0]])  # 9.0 = garbage off the mask
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 0, 1.0, 0]])  # outcome on the last action token (6)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # reversed over action positions 6, 5, 2, 1 (observations 3, 4 never enter the chain):
    # p=6: delta = 1 + 0 - 0.4 = 0.6;            A6 = 0.6
    # p=5: delta = 0 + 0.4 - 0.3 = 0.1;          A5 = 0.1 + 0.5*0.6 = 0.4
    # p=2: delta = 0 + V5(0.3) - 0.2 = 0.1;      A2 = 0.1 + 0.5*0.4 = 0.3   <- end of action 1 links to start of action 2
    # p=1: delta = 0 + 0.2 - 0.1 = 0.1;          A1 = 0.1 + 0.5*0.3 = 0.25
    expected = torch.tensor([[0.0, 0.25, 0.3, 0.0, 0.0, 0.4, 0.6, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)
    # returns R = A + V on action tokens, 0 elsewhere: 0.35, 0.5, 0.7, 1.0
    assert torch.allclose(ret, torch.tensor([[0.0, 0.35, 0.5, 0.0, 0.0, 0.7, 1.0, 0.0]]), atol=1e-6)
    assert adv[0, 3] == 0 and adv[0, 4] == 0  # observation tokens get no advantage


def test_lambda_one_returns_are_monte_carlo():
    # with lambda = 1 and gamma = 1, R_p = sum of future rewards = the outcome, whatever V is
    mask = torch.tensor([[1, 1, 0, 1.0]])
    values = torch.tensor([[0.5, -2.0, 7.0, 0.25]])
    rewards = torch.tensor([[0, 0, 0, 1.0]])
    _, ret = skip_observation_gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))


def test_per_trajectory_lambda():
    # row 0 lambda 0: A = one-step TD error; row 1 lambda 1: A = R - V
    mask = torch.ones(2, 2)
    values = torch.tensor([[0.2, 0.6], [0.2, 0.6]])
    rewards = torch.tensor([[0, 1.0], [0, 1.0]])
    adv, _ = skip_observation_gae(rewards, values, mask, 1.0, torch.tensor([0.0, 1.0]))
    # row 0: A1 = 1 - 0.6 = 0.4, A0 = 0.6 - 0.2 = 0.4; row 1: A1 = 0.4, A0 = 1 - 0.2 = 0.8
    assert torch.allclose(adv, torch.tensor([[0.4, 0.4], [0.8, 0.4]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (1.0, "per_trajectory")])
def test_gae_fast_path_matches_the_reference_recurrence(gamma, lam):
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 50, generator=g) > 0.5).float()
    mask[2] = 0  # a row without action tokens
    mask[4, :] = 1  # a row that is all actions
    rewards = torch.randn(6, 50, generator=g) * mask
    values = torch.randn(6, 50, generator=g)
    lam = torch.rand(6, generator=g) if lam == "per_trajectory" else lam
    fast = skip_observation_gae(rewards, values, mask, gamma, lam)
    ref = skip_observation_gae_reference(rewards, values, mask, gamma, lam)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    empty = skip_observation_gae(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 1.0, 1.0)
    assert all(not x.any() for x in empty)


def test_length_adaptive_lambda():
    # 1 - 1/(1.5 l): l=1 -> 1/3; l=2 -> 2/3; l=10 -> 1 - 1/15; l=0 is clamped to 1 token
    lam = length_adaptive_lambda(torch.tensor([1, 2, 10, 0]), alpha=1.5)
    assert torch.allclose(lam, torch.tensor([1 / 3, 2 / 3, 14 / 15, 1 / 3]), atol=1e-6)
    assert length_adaptive_lambda(torch.tensor([1]), alpha=0.5).item() == 0.0  # 1 - 2 clipped to 0


def test_dis_masks_both_sides_for_any_advantage_sign():
    # ratios e^{logp - blp}: 1.0, 0.5 (<= 1 - 0.3: masked low), 7.0 (>= 1 + 5: masked high), 1.2
    blp = torch.zeros(1, 5)
    logp = torch.log(torch.tensor([[1.0, 0.5, 7.0, 1.2, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -2.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0.0]])  # last position is not an action
    loss, m = dis_policy_loss(logp, blp, adv, mask, eps_low=0.3, eps_high=5.0)
    # kept: t0 (w=1, A=1), t3 (w=1.2, A=-2); denominator counts all 4 action tokens
    # loss = -(1*1*log1 + 1.2*(-2)*log1.2) / 4 = 2.4*log(1.2)/4
    assert loss.item() == pytest.approx(2.4 * math.log(1.2) / 4, rel=1e-5)
    loss.backward()
    # d loss / d logp_t = -w_t A_t / 4
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, 0.0, 0.0, 0.6, 0.0]]), atol=1e-6)
    assert m["dis/masked_low_frac"] == pytest.approx(0.25)
    assert m["dis/masked_high_frac"] == pytest.approx(0.25)
    # k3 estimate of KL(rollout || current): mean over the 4 action tokens of (r - 1) - log r
    k3 = [(r - 1) - math.log(r) for r in (1.0, 0.5, 7.0, 1.2)]
    assert m["dis/approx_kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)


def test_dis_boundaries_are_strict():
    # r exactly at 1 - eps_low or 1 + eps_high is masked (strict inequalities in Eq. 2)
    logp = torch.log(torch.tensor([[0.5, 3.0]]))
    _, m = dis_policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.5, 2.0)
    assert m["dis/masked_low_frac"] == 0.5 and m["dis/masked_high_frac"] == 0.5


def test_dis_overflowing_ratio_is_masked_not_nan():
    # t1: log-ratio 100 -> exp overflows fp32 to inf (masked high); t2 is off the mask with a -inf
    # log-prob. `inf * 0` and `-inf * 0` are NaN; the loss and its gradient must stay finite.
    logp = torch.tensor([[math.log(1.2), 100.0, -math.inf]]).requires_grad_(True)
    blp = torch.tensor([[0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = dis_policy_loss(logp, blp, adv, mask, eps_low=0.3, eps_high=5.0)
    # only t0 is kept: loss = -(1.2 * 1 * log 1.2) / 2 action tokens; d/dlogp_0 = -1.2 / 2
    assert loss.item() == pytest.approx(-1.2 * math.log(1.2) / 2, rel=1e-5)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.6, 0.0, 0.0]]), atol=1e-6) and logp.grad[0, 1:].eq(0).all()
    assert m["dis/masked_high_frac"] == 0.5 and m["dis/masked_low_frac"] == 0.0


def test_ppo_clip_loss_on_policy_is_minus_mean_advantage():
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, m = ppo_clip_loss(logp, logp.detach(), torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-2.0) and m["ppo/clipfrac"] == 0.0


def test_value_loss_and_clipping():
    v = torch.tensor([[0.0, 1.0, 5.0]], requires_grad=True)
    r = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = value_loss(v, r, mask)
    assert loss.item() == pytest.approx(0.5 * (1 + 0) / 2)  # 0.5 * mean of squared errors over 2 tokens
    # clipped: err = max((V - R)^2, (V_old + clamp(V - V_old, -0.2, 0.2) - R)^2); t1 is 0 either way (V = V_old = R)
    old = torch.tensor([[0.9, 1.0, 5.0]])
    clipped, _ = value_loss(v, r, mask, old_values=old, clip=0.2)
    # t0: unclipped (0-1)^2 = 1; clipped V = 0.9 - 0.2 = 0.7 -> (0.7-1)^2 = 0.09; max = 1 -> 0.5 * 1 / 2
    assert clipped.item() == pytest.approx(0.25)
    old = torch.tensor([[-1.0, 1.0, 5.0]])
    clipped, _ = value_loss(v, r, mask, old_values=old, clip=0.2)
    # t0: unclipped (0-1)^2 = 1; clipped V = -1 + 0.2 = -0.8 -> (-0.8-1)^2 = 3.24; max = 3.24 -> 0.5 * 3.24 / 2
    assert clipped.item() == pytest.approx(0.81)
    clipped.backward()
    # the clipped term won and its clamp is saturated: no gradient reaches V at t0 (unclipped would give
    # d/dV 0.5 * (V-1)^2 / 2 = (V-1)/2 = -0.5)
    assert v.grad[0].tolist() == [0.0, 0.0, 0.0]


def test_whitening_and_masked_mean():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert masked_mean(x, mask).item() == 2.0
    w = masked_whiten(x, mask)  # mean 2, std 1 over the mask -> -1, 1, and 0 off the mask
    assert torch.allclose(w, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6)


def test_explained_variance():
    r = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(r, r, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 0.5), r, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(r, torch.zeros_like(r), mask))


def test_step_level_values_per_turn():
    v = torch.tensor([[9.0, 1.0, 2.0, 9.0, 3.0, 5.0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 1.0]])
    assert torch.equal(step_level_values(v, mask, "state"), torch.tensor([[0, 1.0, 1.0, 0, 3.0, 3.0]]))
    assert torch.equal(step_level_values(v, mask), step_level_values(v, mask, "state"))  # the default
    assert torch.equal(step_level_values(v, mask, "last"), torch.tensor([[0, 2.0, 2.0, 0, 5.0, 5.0]]))
    assert torch.equal(step_level_values(v, mask, "mean"), torch.tensor([[0, 1.5, 1.5, 0, 4.0, 4.0]]))


def test_group_and_running_mean_baselines():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "a", "b", "b"])
    # group a: mean 0.5, std 0.5 -> +1, -1; group b: std 0 -> 0, 0
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-4)
    rm = RunningMeanBaseline(window=2, per_prompt=False)
    # baseline is the mean of earlier rewards in the window: 0 (empty), 1, (1+0)/2, (0+1)/2
    assert rm.advantages([1.0, 0.0, 1.0, 1.0], ["x", "y", "z", "w"]) == [1.0, -1.0, 0.5, 0.5]


def test_whitening_equal_values_gives_zeros_not_noise():
    x = torch.full((1, 4), 0.3) + torch.tensor([[0.0, 1e-9, -1e-9, 0.0]])
    assert masked_whiten(x, torch.ones(1, 4)).abs().max() < 1e-2
    # seven equal float32 values whose mean has rounding error: an unfloored std whitens that to ~0.4
    assert masked_whiten(torch.full((1, 7), 0.1), torch.ones(1, 7)).abs().max() < 1e-2


def test_an_algorithm_entry_is_typed_and_a_typo_fails_at_registration():
    """The registry's advantage and loss are enums the learner compares by identity; a plain string of a
    value is accepted (an entry written before the enums), a misspelled one fails when it is declared."""
    import pytest

    from sao.algo.registry import Advantage, Algorithm, PolicyLoss, get_algorithm

    mine = Algorithm("mine", "gae", "ppo")
    assert mine.advantage is Advantage.GAE and mine.policy_loss is PolicyLoss.PPO and mine.uses_critic
    assert get_algorithm("grpo_dis").grouped and get_algorithm("grpo_dis").policy_loss is PolicyLoss.DIS
    with pytest.raises(ValueError, match="'gea'"):
        Algorithm("typo", "gea", "dis")
