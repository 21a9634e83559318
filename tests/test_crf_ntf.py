"""algo.name=crf_ntf (C-RF with negative token filtering, after arXiv 2606.17250; docs/algorithm.md §7): the
outcome 2R - 1 as the advantage, a failed episode's likely tokens out of the loss, DIS. Each checked against
a hand computation."""

import copy
import subprocess
import sys

import pytest
import torch
from conftest import two_turn_trajectories

from sao.algo.baselines import negative_token_filter, outcome_advantages
from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.errors import RunStopped
from sao.trainer.batch import collate
from sao.trainer.learner import Learner
from sao.trainer.packing import actor_logprobs


def test_outcome_advantage_and_the_filter_by_hand():
    assert outcome_advantages(torch.tensor([1.0, 0.0, 0.25])).tolist() == [1.0, -1.0, -0.5]
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1],   # 10 action tokens, advantage -1: keep ceil(1.0) = 1
                         [0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1],   # the same tokens, advantage +1: keep all
                         [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0],   # 11 tokens, negative, keep 0.25: ceil(2.75) = 3
                         [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]).float()  # none: nothing to keep
    lp = torch.tensor([[-9.0, -0.1, -3.0, -0.2, -3.0, -0.3, -9.0, -0.4, -0.5, -0.6, -0.7, -0.8],
                       [-9.0, -0.1, -3.0, -0.2, -3.0, -0.3, -9.0, -0.4, -0.5, -0.6, -0.7, -0.8],
                       [-0.1, -2.0, -0.1, -2.0, -0.1, -0.1, -2.0, -0.1, -0.1, -0.1, -0.1, -9.0],
                       [-1.0] * 12])
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0])[:, None] * mask
    kept = negative_token_filter(adv, lp, mask, 0.1)
    # row 0: -3.0 twice (positions 2 and 4): the tie goes to the earlier one; position 0 and 6 are not actions
    assert kept[0].nonzero().flatten().tolist() == [2]
    assert kept[1].tolist() == mask[1].bool().tolist()
    assert kept[3].sum() == 0
    kept = negative_token_filter(adv, lp, mask, 0.25)
    assert kept[2].nonzero().flatten().tolist() == [1, 3, 6]  # the three -2.0 tokens; position 11 is padding
    assert kept[0].nonzero().flatten().tolist() == [2, 4, 11]  # ceil(2.5) = 3: both -3.0, then -0.8 at 11


def _batch(codec, rewards):
    return collate(two_turn_trajectories(codec, rewards), codec.tokenizer.pad_token_id)


def test_crf_ntf_step_equals_the_hand_computation(tiny):
    """Advantages, the kept tokens, the DIS loss over them and the actor's AdamW step of one learner step,
    recomputed by hand from a copy of the model (behaviour log-probs are the model's own: every ratio is 1)."""
    model, codec = tiny
    rewards = [1.0, 0.0, 0.0, 0.25]
    batch = _batch(codec, rewards)
    batch.trace_rows = batch.size
    hand = copy.deepcopy(model)
    with torch.no_grad():
        batch.behavior_logprobs = actor_logprobs(hand, batch)[0].float() * batch.action_mask
    learner = Learner(copy.deepcopy(model), None, get_algorithm("crf_ntf"), AlgoConfig(ntf_keep=0.2), CriticConfig(),
                      TrainConfig(lr=1e-3, pack=False))

    mask = batch.action_mask
    adv = (2 * torch.tensor(rewards) - 1)[:, None] * mask
    kept = mask.clone()
    for i in (1, 2, 3):  # the failed rows: the ceil(0.2 n) least likely of their n action tokens
        idx = mask[i].nonzero().flatten()
        k = -(-int(idx.numel()) * 2 // 10)
        order = sorted(idx.tolist(), key=lambda t: (float(batch.behavior_logprobs[i, t]), t))[:k]
        kept[i] = 0.0
        kept[i, order] = 1.0
    hand.train()
    opt = torch.optim.AdamW([p for p in hand.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0,
                            betas=(0.9, 0.99))
    lp, _ = actor_logprobs(hand, batch)
    w = torch.exp(lp.detach().float() - batch.behavior_logprobs).detach()
    loss = -(w * adv * lp.float() * kept).sum() / kept.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in hand.parameters() if p.requires_grad], 1.0)
    opt.step()

    metrics = learner.step(batch)
    records = metrics.pop("trace")
    assert 0 < kept.sum() < mask.sum()  # the failed rows lost tokens, the solved one none
    assert metrics["loss/policy"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["ntf/filtered_token_frac"] == pytest.approx(1 - float(kept.sum() / mask.sum()), abs=1e-6)
    for rec in records:
        i = rec["row"]
        on = [a for a, m in zip(rec["adv"], mask[i].tolist()) if m]
        assert on == pytest.approx([float(2 * rewards[i] - 1)] * int(mask[i].sum()))
        assert "whiten" not in rec  # used as it is
        assert [k for k, m in zip(rec["ntf_kept"], mask[i].tolist()) if m] == [int(k) for k, m in
                                                                              zip(kept[i].tolist(), mask[i].tolist()) if m]
    off = max(float((a - b).abs().max()) for a, b in zip(learner.actor.parameters(), hand.parameters()))
    assert off <= 1e-6 and learner.actor_version == 1


def test_crf_ntf_refuses_rewards_outside_zero_one(tiny):
    model, codec = tiny
    learner = Learner(copy.deepcopy(model), None, get_algorithm("crf_ntf"), AlgoConfig(), CriticConfig(), TrainConfig())
    with pytest.raises(RunStopped, match=r"algo.name=crf_ntf: a reward outside \[0, 1\] \(e.g. 2.0\)"):
        learner.step(_batch(codec, [1.0, 2.0]))


def test_sao_train_crf_ntf(tmp_path):
    """The real CLI, async, on the built-in task: no critic is built, the filter counts its tokens."""
    from conftest import TINY
    from faults import rows as _rows

    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "algo.name=crf_ntf", "train.steps=3",
                           "output.name=c", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _rows(tmp_path / "runs" / "c") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["ntf/filtered_token_frac"] < 1 and "critic/version" not in r for r in rows)
