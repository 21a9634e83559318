"""Packed rows (sao/trainer/packing.py) against the padded batch: same log-probs, values, losses and
gradients (reference-vs-fast equivalence, docs/architecture.md §7), and no attention across trajectories."""

import pytest
import torch

from sao.algo.losses import dis_policy_loss, value_loss
from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.models.critic import build_critic
from sao.models.tiny import load_model
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


def test_actor_pass_same_logprobs_loss_and_gradients(arch_model_dir):
    trajs = _trajectories(LENGTHS)
    grads, outs = [], []
    for packed in (False, True):
        torch.manual_seed(0)
        model = load_model(arch_model_dir).train()
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


def test_critic_pass_same_values_loss_and_gradients(arch_model_dir):
    trajs = _trajectories(LENGTHS, seed=1)
    grads, outs = [], []
    for packed in (False, True):
        critic = build_critic(arch_model_dir)
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
def test_learner_step_same_numbers_packed_or_padded(arch_model_dir, algo, keys):
    """A whole step (v0, K=2 critic updates, v2, then DIS, or PPO minibatch updates against pi_old)
    gives the same metrics either way."""
    trajs = _trajectories(LENGTHS, seed=2)
    runs = []
    for packed in (False, True):
        torch.manual_seed(0)
        actor, critic = load_model(arch_model_dir), build_critic(arch_model_dir)
        learner = Learner(actor, critic, get_algorithm(algo), AlgoConfig(), CriticConfig(warmup_steps=0),
                          TrainConfig(lr=1e-3, pack=packed))
        runs.append(learner.step(collate(trajs, pad_id=0)))
    ref, fast = runs
    assert ref["perf/padded_frac"] > 0.3 and fast["perf/padded_frac"] < ref["perf/padded_frac"]
    for key in keys:
        assert fast[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


def _packed_pass(arch_model_dir, trajs, keep_mask: bool, critic: bool):
    """Outputs and gradients of one packed pass, with the kept 4-D mask or with the model building its own."""
    import sao.trainer.packing as packing

    model = build_critic(arch_model_dir) if critic else load_model(arch_model_dir).train()
    if critic:
        torch.manual_seed(0)
        torch.nn.init.normal_(model.score.weight)
    batch = collate(trajs, pad_id=0)
    batch.packing = pack(batch.input_ids, batch.attention_mask)
    saved = packing.attention_mask
    if not keep_mask:  # the path before masks were kept: no mask given, the model builds one per pass
        packing.attention_mask = lambda model, p: None
    try:
        if critic:
            out = critic_forward(model, batch)
            loss, _ = value_loss(out, batch.rewards.cumsum(1), batch.action_mask)
            outs = [out.detach()]
        else:
            lp, ent = actor_logprobs(model, batch)
            loss, _ = dis_policy_loss(lp, batch.behavior_logprobs, torch.ones_like(lp), batch.action_mask, 0.3, 5.0)
            outs = [lp.detach(), ent]
    finally:
        packing.attention_mask = saved
    loss.backward()
    return outs + [loss.detach()], _grads(model), batch.packing


@pytest.mark.parametrize("critic", [False, True])
def test_kept_attention_mask_same_bits_as_the_models_own(arch_model_dir, critic):
    """The mask built once per batch and reused by every pass gives bit-identical outputs and gradients to
    the model building it from the position ids on each pass; it is built once per (implementation, dtype)."""
    trajs = _trajectories(LENGTHS, seed=3)
    ref_out, ref_grads, _ = _packed_pass(arch_model_dir, trajs, keep_mask=False, critic=critic)
    out, grads, p = _packed_pass(arch_model_dir, trajs, keep_mask=True, critic=critic)
    assert len(p.masks) == 1 and next(iter(p.masks.values())).ndim == 4  # the kept mask was used
    for a, b in zip(ref_out, out):
        assert torch.equal(a, b)
    assert ref_grads.keys() == grads.keys() and all(torch.equal(ref_grads[n], grads[n]) for n in grads)


def test_shared_log_softmax_same_bits_as_two_passes():
    """token_logprobs_and_entropy = token_logprobs + token_entropy, bit for bit, and the same gradient."""
    from sao.models.actor import token_entropy, token_logprobs, token_logprobs_and_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 17, generator=g, requires_grad=True)
    ids = torch.randint(0, 17, (3, 9), generator=g)
    lp_ref, ent_ref = token_logprobs(logits, ids), token_entropy(logits.detach())
    (grad_ref,) = torch.autograd.grad(lp_ref.sum(), logits)
    lp, ent = token_logprobs_and_entropy(logits, ids)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref) and torch.equal(grad, grad_ref)
    assert not ent.requires_grad
    lp2, ent2 = token_logprobs_and_entropy(logits, ids, entropy_grad=True)
    assert ent2.requires_grad and torch.equal(ent2.detach(), ent_ref)


@pytest.mark.parametrize("algo", ["sao", "grpo"])
def test_learner_step_same_bits_with_kept_mask(arch_model_dir, algo, monkeypatch):
    """A whole step whose passes (critic x K, v2, actor; or pi_old and PPO minibatches) reuse one kept
    mask gives every metric and weight bit for bit as when each pass builds its own."""
    import sao.trainer.packing as packing

    trajs = _trajectories(LENGTHS, seed=4)
    runs = []
    for keep in (False, True):
        if not keep:
            monkeypatch.setattr(packing, "attention_mask", lambda model, p: None)
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        actor, critic = load_model(arch_model_dir), build_critic(arch_model_dir)
        learner = Learner(actor, critic, get_algorithm(algo), AlgoConfig(group_size=4), CriticConfig(warmup_steps=0),
                          TrainConfig(lr=1e-3))
        batch = collate(trajs, pad_id=0)
        if algo == "grpo":
            batch.group_ids = [str(i // 4) for i in range(len(trajs))]
        m = learner.step(batch)
        runs.append(({k: v for k, v in m.items() if not k.startswith("perf/")}, actor.state_dict()))
    (m0, w0), (m1, w1) = runs
    assert m0 == m1
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
