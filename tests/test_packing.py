"""Packed rows (sao/trainer/packing.py) against the padded batch: same log-probs, values, losses and
gradients (reference-vs-fast equivalence, docs/architecture.md §7), and no attention across trajectories."""

import pytest
import torch

from sao.algo.losses import dis_policy_loss, value_loss
from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.models.critic import build_critic
from sao.models.tiny import build_tiny_model, load_model
from sao.trainer.batch import collate
from sao.trainer.learner import Learner
from sao.trainer.packing import actor_logprobs, critic_forward, pack, plan_rows
from sao.types import Trajectory


def test_plan_rows_first_fit_decreasing():
    # sorted by length: 6(i1) 5(i3) 4(i0) 3(i2) 2(i4) into rows of 8:
    # 6 -> row0 (2 left); 5 -> row1 (3 left); 4 -> row2 (4 left); 3 -> row1 (0 left); 2 -> row0 (0 left)
    assert plan_rows([4, 6, 3, 5, 2], 8) == [[1, 4], [3, 2], [0]]
    assert plan_rows([3], 3) == [[0]]


def _trajectories(n_tokens, seed=0):
    """Random token ids; prompt of 3, then a mix of action and observation tokens; uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(n_tokens):
        ids = torch.randint(4, 100, (n,), generator=g).tolist()
        mask = [0] * 3 + (torch.rand(n - 3, generator=g) > 0.3).int().tolist()
        mask[-1] = 1  # the reward sits on the last action token
        blp = [-2.0 * m for m in mask]
        out.append(Trajectory(str(i), f"t{i}", ids, mask, blp, [0 if m else -1 for m in mask], 3, reward=float(i % 2)))
    return out


LENGTHS = [40, 7, 25, 33, 12, 60, 5, 21]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, hidden_size=32,
                            num_layers=2, num_heads=2, intermediate_size=64, max_positions=128, seed=0)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packing_layout_and_savings():
    padded = collate(_trajectories(LENGTHS), pad_id=0)
    p = pack(padded.input_ids, padded.attention_mask)
    assert p.input_ids.shape[1] == 60 and p.positions < padded.input_ids.numel()  # 4 rows of 60 vs 8 x 60
    for b, n in enumerate(LENGTHS):  # every token lands once, in order, with positions 0..n-1
        flat = p.index[b, :n]
        assert torch.equal(p.input_ids.reshape(-1)[flat], padded.input_ids[b, :n])
        assert torch.equal(p.position_ids.reshape(-1)[flat], torch.arange(n))
    assert p.index[padded.attention_mask.bool()].unique().numel() == sum(LENGTHS)


def test_actor_pass_same_logprobs_loss_and_gradients(model_dir):
    trajs = _trajectories(LENGTHS)
    grads, outs = [], []
    for packed in (False, True):
        torch.manual_seed(0)
        model = load_model(model_dir).train()
        batch = collate(trajs, pad_id=0)
        if packed:
            batch.packing = pack(batch.input_ids, batch.attention_mask)
        logprobs, entropy = actor_logprobs(model, batch)
        adv = torch.linspace(-1, 1, batch.input_ids.numel()).reshape(batch.input_ids.shape)
        loss, _ = dis_policy_loss(logprobs, batch.behavior_logprobs, adv, batch.action_mask, 0.3, 5.0)
        loss.backward()
        real = batch.attention_mask.bool()
        outs.append((logprobs.detach()[real], entropy[real], loss.detach()))
        grads.append(_grads(model))
    for ref, fast in zip(*outs):
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=2e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_critic_pass_same_values_loss_and_gradients(model_dir):
    trajs = _trajectories(LENGTHS, seed=1)
    grads, outs = [], []
    for packed in (False, True):
        critic = build_critic(model_dir)
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.score.weight)  # a zero head would give zero values and no signal
        batch = collate(trajs, pad_id=0)
        if packed:
            batch.packing = pack(batch.input_ids, batch.attention_mask)
        values = critic_forward(critic, batch)
        loss, _ = value_loss(values, batch.rewards.cumsum(1), batch.action_mask)
        loss.backward()
        outs.append((values.detach()[batch.attention_mask.bool()], loss.detach()))
        grads.append(_grads(critic))
    for ref, fast in zip(*outs):
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=2e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


SHARED = ("loss/policy", "critic/value_loss", "critic/value_mean", "critic/grad_norm", "actor/grad_norm",
          "actor/entropy", "dis/ratio_mean", "adv/mean_raw")


@pytest.mark.parametrize("algo,keys", [("sao", (*SHARED, "dis/approx_kl")),
                                       ("vapo", (*SHARED, "ppo/approx_kl", "ppo/clipfrac"))])
def test_learner_step_same_numbers_packed_or_padded(model_dir, algo, keys):
    """A whole step (v0, K=2 critic updates, v2, then DIS, or PPO minibatch updates against pi_old)
    gives the same metrics either way."""
    trajs = _trajectories(LENGTHS, seed=2)
    runs = []
    for packed in (False, True):
        torch.manual_seed(0)
        actor, critic = load_model(model_dir), build_critic(model_dir)
        learner = Learner(actor, critic, get_algorithm(algo), AlgoConfig(), CriticConfig(warmup_steps=0),
                          TrainConfig(lr=1e-3, pack=packed))
        runs.append(learner.step(collate(trajs, pad_id=0)))
    ref, fast = runs
    assert ref["perf/padded_frac"] > 0.3 and fast["perf/padded_frac"] < ref["perf/padded_frac"]
    for key in keys:
        assert fast[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
