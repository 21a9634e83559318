"""algo.name=sppo (SPPO, arXiv 2604.08865; docs/algorithm.md §7): a scalar value of the prompt from the critic's
output at the last prompt token, A = R - sigmoid(logit) from the critic before its updates, binary
cross-entropy value steps, PPO clip. Each checked against a hand computation."""

import copy
import math
import subprocess
import sys

import pytest
import torch
from conftest import two_turn_trajectories

from sao.algo.losses import prompt_value_advantages, prompt_value_loss
from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.errors import RunStopped
from sao.models.critic import build_critic, critic_values
from sao.trainer.batch import collate
from sao.trainer.learner import Learner


def test_prompt_value_advantage_and_loss_by_hand():
    logits = torch.tensor([0.0, 2.0, -1.0, 0.5])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.25])
    adv, value = prompt_value_advantages(logits, rewards)
    # sigmoid(0) = 0.5, sigmoid(2) = 0.880797, sigmoid(-1) = 0.268941, sigmoid(0.5) = 0.622459
    assert value.tolist() == pytest.approx([0.5, 0.880797, 0.268941, 0.622459], abs=1e-6)
    assert adv.tolist() == pytest.approx([0.5, -0.880797, 0.731059, 0.25 - 0.622459], abs=1e-6)
    loss, m = prompt_value_loss(logits, rewards)
    # -[R log s + (1 - R) log(1 - s)] per episode, then the mean over the 4
    by_hand = [-math.log(0.5), -math.log(1 - 0.880797), -math.log(0.268941),
               -(0.25 * math.log(0.622459) + 0.75 * math.log(1 - 0.622459))]
    assert float(loss) == pytest.approx(sum(by_hand) / 4, abs=1e-5) and m["critic/value_loss"] == pytest.approx(float(loss))


def _batch(codec, rewards):
    trajs = two_turn_trajectories(codec, rewards, behavior=-1.0)
    return collate(trajs, codec.tokenizer.pad_token_id), [len(t.token_ids) - len(t.action_mask) + t.prompt_len
                                                          for t in trajs]


def test_sppo_step_equals_the_hand_computation(tiny, tiny_model_dir):
    """Values, advantages (not whitened), K=2 binary cross-entropy critic steps with Adam and the first PPO loss
    (ratio 1 against pi_old) of one learner step, recomputed by hand from copies of the models."""
    model, codec = tiny
    rewards = [1.0, 0.0, 0.0, 0.5]
    batch, prompt_lens = _batch(codec, rewards)
    batch.trace_rows = batch.size
    torch.manual_seed(0)
    critic = build_critic(tiny_model_dir)
    hand_critic = copy.deepcopy(critic)
    ccfg = CriticConfig(warmup_steps=0, updates_per_step=2, lr=1e-2)
    learner = Learner(copy.deepcopy(model), critic, get_algorithm("sppo"), AlgoConfig(ppo_minibatches=1),
                      ccfg, TrainConfig(lr=1e-3))
    # the registry's SPPO trains the critic's attention too (the paper's critic is a whole LM)
    assert all(p.requires_grad for p in critic.parameters())

    r = torch.tensor(rewards)
    rows = torch.arange(batch.size)
    first = torch.tensor(prompt_lens)  # V(s_t) at t is the output after token t-1: here, the whole prompt

    def logits_of(c):
        out = c(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0].float()
        assert torch.allclose(critic_values(c, batch.input_ids, batch.attention_mask, None)[rows, first],
                              out[rows, first - 1])
        return out[rows, first - 1]  # the head's output at the last prompt token

    with torch.no_grad():
        v0 = torch.sigmoid(logits_of(hand_critic))
    adv = r - v0
    opt = torch.optim.AdamW([p for p in hand_critic.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0,
                            betas=(0.9, 0.99))  # the learner's AdamW
    for _ in range(2):  # K critic steps on -[R log s + (1-R) log(1-s)], the mean over episodes
        s = torch.sigmoid(logits_of(hand_critic))
        loss = -(r * s.log() + (1 - r) * (1 - s).log()).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in hand_critic.parameters() if p.requires_grad], ccfg.grad_clip)
        opt.step()

    metrics = learner.step(batch)
    records = metrics.pop("trace")
    mask = batch.action_mask
    for rec in records:
        i = rec["row"]
        assert rec["prompt_value"] == pytest.approx(float(v0[i]), rel=1e-5)
        on = [a for a, m in zip(rec["adv_raw"], mask[i].tolist()) if m]
        assert on == pytest.approx([float(adv[i])] * int(mask[i].sum()), rel=1e-5, abs=1e-6)
        assert rec["adv"] == rec["adv_raw"] and "whiten" not in rec  # SPPO's advantage is used as it is
    # Adam divides by sqrt(v) + eps: an element whose gradient is near eps moves by a share of lr that a 1e-7
    # difference of the two forwards changes (measured: 1.2e-5 at most, one element, lr 1e-2), so weights are
    # compared to 5e-3 x lr and the critic's outputs after its updates tightly
    off = {n: float((a - b).abs().max()) for (n, a), b in zip(critic.named_parameters(), hand_critic.parameters())}
    assert max(off.values()) <= 5e-3 * ccfg.lr, sorted(off.items(), key=lambda x: -x[1])[:5]
    with torch.no_grad():
        assert torch.allclose(logits_of(critic), logits_of(hand_critic), atol=1e-5, rtol=0)
    # PPO's first update has ratio 1: the loss is -sum_t A_t / (action tokens)
    n = mask.sum(1)
    assert metrics["loss/policy"] == pytest.approx(float(-(adv * n).sum() / n.sum()), abs=1e-6)
    assert metrics["critic/version"] == 2 and metrics["critic/value_mean"] == pytest.approx(float(v0.mean()), abs=1e-6)
    assert metrics["critic/return_mean"] == pytest.approx(0.375)


def test_sppo_refuses_rewards_outside_zero_one(tiny, tiny_model_dir):
    model, codec = tiny
    batch, _ = _batch(codec, [1.0, -1.0, 0.0, 1.0])
    learner = Learner(copy.deepcopy(model), build_critic(tiny_model_dir), get_algorithm("sppo"),
                      AlgoConfig(ppo_minibatches=1), CriticConfig(warmup_steps=0), TrainConfig())
    with pytest.raises(RunStopped, match=r"algo.name=sppo: a reward outside \[0, 1\] \(e.g. -1.0\)"):
        learner.step(batch)


@pytest.mark.slow
def test_sao_train_sppo_with_a_separate_critic(tmp_path):
    """The real CLI, async, the critic on its own process (steps 1-3 one batch ahead, as for sao)."""
    from conftest import TINY
    from faults import audit_of
    from faults import rows as _rows

    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "algo.name=sppo", "algo.ppo_minibatches=2",
                           "critic.placement=separate", "train.steps=4", "output.name=s", "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _rows(tmp_path / "runs" / "s") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["critic/version"] == 8
    assert all("ppo/clipfrac" in r for r in rows[1:])  # after the one warm-up step the actor steps with PPO
    audit_of(tmp_path / "runs" / "s")


def test_value_pretraining_fits_the_prompt_value_as_sppo_trains_it(tiny, tiny_model_dir):
    """`sao pretrain-critic algo.name=sppo` (fit_critic, prompt_value=True): one AdamW step of the cross-entropy of
    the head's output after each prompt against the reward, the same loss the SPPO learner takes."""
    from sao.trainer.critic_pretrain import fit_critic

    _, codec = tiny
    rewards = [1.0, 0.0, 0.0, 1.0]
    batch, prompt_lens = _batch(codec, rewards)
    torch.manual_seed(0)
    critic = build_critic(tiny_model_dir)
    hand = copy.deepcopy(critic)
    history = fit_critic(critic, lambda: batch, 1, 1e-2, 10.0, 0.0, 1.0, prompt_value=True)
    rows, first = torch.arange(batch.size), torch.tensor(prompt_lens)
    logits = hand(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0].float()[rows, first - 1]
    loss, _ = prompt_value_loss(logits, torch.tensor(rewards))
    assert history[0]["critic/value_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(hand.parameters()), 10.0)
    opt.step()
    off = max(float((a - b).detach().abs().max()) for a, b in zip(critic.parameters(), hand.parameters()))
    assert off <= 5e-3 * 1e-2  # Adam near eps, as above


def test_pretrain_critic_refuses_an_algorithm_without_a_critic(tmp_path):
    from conftest import TINY

    proc = subprocess.run([sys.executable, "-m", "sao.cli", "pretrain-critic", *TINY, "algo.name=crf_ntf", "--steps", "2",
                           "--out", "c"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "sao: error: algo.name: crf_ntf trains no critic; there is nothing to pretrain"
    assert not (tmp_path / "c").exists()
