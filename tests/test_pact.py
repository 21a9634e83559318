"""algo.name=pact (actor first, then an importance-corrected critic; docs/algorithm.md §7): advantages from the
critic before its updates, the actor's DIS step, then K critic steps weighted by min(pi_new / pi_rollout, c).
Checked against a hand computation."""

import copy

import pytest
import torch
from conftest import two_turn_trajectories

from sao.algo.gae import episode_totals, length_adaptive_lambda, skip_observation_gae
from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.models.critic import build_critic, critic_values, freeze_parameters
from sao.trainer.batch import collate
from sao.trainer.learner import Learner
from sao.trainer.packing import actor_logprobs


def _batch(codec, rewards):
    return collate(two_turn_trajectories(codec, rewards), codec.tokenizer.pad_token_id)


def test_pact_step_equals_the_hand_computation(tiny, tiny_model_dir):
    model, codec = tiny
    rewards = [1.0, 0.0, 0.0, 1.0]
    batch = _batch(codec, rewards)
    batch.trace_rows = batch.size
    torch.manual_seed(0)
    critic = build_critic(tiny_model_dir)
    hand_actor, hand_critic = copy.deepcopy(model), copy.deepcopy(critic)
    with torch.no_grad():  # behaviour log-probs a little off the model's own, so the weights are not all 1
        own = actor_logprobs(hand_actor, batch)[0].float()
        shift = 0.3 * torch.sin(torch.arange(own.numel(), dtype=torch.float).reshape(own.shape))
        batch.behavior_logprobs = (own + shift) * batch.action_mask
    ccfg = CriticConfig(warmup_steps=0, updates_per_step=2, lr=1e-2)
    acfg = AlgoConfig(whiten_advantages=False, pact_weight_clip=1.2)
    learner = Learner(copy.deepcopy(model), critic, get_algorithm("pact"), acfg, ccfg, TrainConfig(lr=1e-3, pack=False))
    freeze_parameters(hand_critic, ccfg.freeze_pattern)  # the frozen-attention critic, as the learner's

    mask, ids, att = batch.action_mask, batch.input_ids, batch.attention_mask
    with torch.no_grad():
        v0 = critic_values(hand_critic, ids, att, None).float() * mask
    lam = length_adaptive_lambda(episode_totals(batch.num_action_tokens, None), acfg.lam_alpha)
    adv, _ = skip_observation_gae(batch.rewards, v0, mask, 1.0, lam)
    _, returns = skip_observation_gae(batch.rewards, v0, mask, 1.0, 1.0)
    # the actor first: DIS with eps 0.3 / 5 against the behaviour log-probs
    hand_actor.train()
    aopt = torch.optim.AdamW(hand_actor.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    lp, _ = actor_logprobs(hand_actor, batch)
    ratio = torch.exp(lp.detach().float() - batch.behavior_logprobs)
    keep = (ratio > 0.7) & (ratio < 6.0) & mask.bool()
    loss = -(torch.where(keep, ratio, 0.0) * adv * lp.float()).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(hand_actor.parameters()), 1.0)
    aopt.step()
    # then the critic, weighted by min(pi_new / pi_rollout, 1.2), pi_new the actor after its step
    with torch.no_grad():
        new = actor_logprobs(hand_actor, batch)[0].float()
        weights = torch.exp(new - batch.behavior_logprobs).clamp(max=1.2) * mask
    assert (weights[mask.bool()] < 1.2).any() and (weights[mask.bool()] == 1.2).any()  # both sides of the clip
    copt = torch.optim.AdamW([p for p in hand_critic.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0,
                             betas=(0.9, 0.99))
    for _ in range(2):
        v = critic_values(hand_critic, ids, att, None).float()
        closs = 0.5 * (weights * (v - returns) ** 2 * mask).sum() / mask.sum()
        copt.zero_grad()
        closs.backward()
        torch.nn.utils.clip_grad_norm_([p for p in hand_critic.parameters() if p.requires_grad], ccfg.grad_clip)
        copt.step()

    metrics = learner.step(batch)
    records = metrics.pop("trace")
    for rec in records:
        i = rec["row"]
        on = [a for a, m in zip(rec["adv"], mask[i].tolist()) if m]
        assert on == pytest.approx(adv[i][mask[i].bool()].tolist(), rel=1e-4, abs=1e-5)
        w = [a for a, m in zip(rec["critic_weight"], mask[i].tolist()) if m]
        assert w == pytest.approx(weights[i][mask[i].bool()].tolist(), rel=1e-4, abs=1e-5)
    assert metrics["loss/policy"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    assert metrics["critic/value_loss"] == pytest.approx(float(closs.detach()), rel=1e-4)
    assert metrics["critic/version"] == 2 and learner.actor_version == 1
    off = max(float((a - b).detach().abs().max()) for a, b in zip(learner.actor.parameters(), hand_actor.parameters()))
    assert off <= 1e-6
    off = max(float((a - b).abs().max()) for a, b in zip(critic.parameters(), hand_critic.parameters()))
    assert off <= 5e-3 * ccfg.lr  # Adam near eps, as in tests/test_sppo.py


def test_pact_refuses_a_separate_critic(tmp_path):
    import subprocess
    import sys

    from conftest import TINY

    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "algo.name=pact", "critic.placement=separate",
                           "output.name=p"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("sao: error: critic.placement: algo.name=pact updates the critic")
