"""What the trainer records per token (sao/trainer/trace.py) is what it used: the log-probs and values
equal the models' outputs before the step, and the DIS mask, the returns and the advantages recomputed
from the recorded inputs with sao.algo equal the recorded ones; GRPO records its group advantage; a
run writes traces/ joined with its trajectories."""

import copy
import json

import pytest
import torch

from sao.algo.baselines import group_advantages
from sao.algo.gae import skip_observation_gae
from sao.algo.losses import dis_mask
from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.models.critic import build_critic
from sao.trainer.learner import Learner
from sao.trainer.packing import critic_forward
from tests.test_critic_ranks import _batches

TOL = 2e-5  # the records are rounded to 6 significant digits


def _row(values: list, fill: float = 0.0) -> torch.Tensor:
    return torch.tensor([[fill if v is None else v for v in values]])


def _close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> bool:
    diff = ((a - b).abs() * mask).max()
    return float(diff) <= TOL * max(1.0, float((b.abs() * mask).max()))


@pytest.mark.parametrize("whiten", [True, False])
def test_sao_records_what_the_step_used(tiny, tiny_model_dir, whiten):
    model, codec = tiny
    batches = _batches(codec, model, 3)
    cfg = AlgoConfig(whiten_advantages=whiten, eps_low=0.02, eps_high=0.02)  # tight: some tokens masked, some kept
    learner = Learner(copy.deepcopy(model), build_critic(tiny_model_dir), get_algorithm("sao"), cfg,
                      CriticConfig(warmup_steps=1), TrainConfig(lr=1e-3))
    learner.step(batches[0])  # warm-up; then an actor step with a moved policy (the DIS ratio is off 1)
    learner.step(batches[1])
    batch = batches[2]
    batch.trace_rows = 3
    logprobs = learner.logprobs(batch)  # (B, T), aligned with the tokens
    with torch.no_grad():
        v0 = critic_forward(learner.critic, batch)
    metrics = learner.step(batch)
    records = metrics.pop("trace")
    assert [r["row"] for r in records] == [0, 1, 2] and all(r["actor"] == "stepped" for r in records)
    for rec in records:
        i, n = rec["row"], int(batch.attention_mask[rec["row"]].sum())
        mask = batch.action_mask[i : i + 1, :n]
        assert rec["version"] == [0 if m else None for m in mask[0].tolist()]
        assert rec["reward"] == float(batch.scalar_rewards[i])
        # the inputs, against the models before the step
        lp = _row(rec["logprob"])
        assert _close(lp, logprobs[i : i + 1, :n], mask)
        assert _close(_row(rec["v_before"]), v0[i : i + 1, :n], mask)
        # the DIS mask and ratio, recomputed
        behavior = _row(rec["behavior_logprob"])
        _, ratio, low, high = dis_mask(lp, behavior, mask, cfg.eps_low, cfg.eps_high)
        assert _close(_row(rec["ratio"]), ratio, mask)
        assert rec["dis"] == [int(h) - int(lo) if m else None
                              for h, lo, m in zip(high[0].tolist(), low[0].tolist(), mask[0].tolist())]
        # returns (lambda=1 on v0) and advantages (lambda_policy on v2), recomputed
        rewards = torch.zeros(1, n)
        rewards[0, max(t for t in range(n) if mask[0, t])] = rec["reward"]
        _, ret = skip_observation_gae(rewards, _row(rec["v_before"]), mask, cfg.gamma, 1.0)
        assert _close(_row(rec["return"]), ret, mask)
        adv, _ = skip_observation_gae(rewards, _row(rec["v_after"]), mask, cfg.gamma, torch.tensor([rec["lambda"]]))
        assert _close(_row(rec["adv_raw"]), adv, mask)
        if whiten:
            w = rec["whiten"]
            assert _close(_row(rec["adv"]), (adv - w["mean"]) / w["std"] * mask, mask)
        else:
            assert "whiten" not in rec and rec["adv"] == rec["adv_raw"]
    signs = [d for r in records for d in r["dis"] if d is not None]
    assert 0 in signs and (1 in signs or -1 in signs), signs  # the test covers both kept and masked tokens
    assert metrics["dis/masked_low_frac"] + metrics["dis/masked_high_frac"] > 0


def test_grpo_records_its_group_advantage(tiny):
    model, codec = tiny
    batch = _batches(codec, model, 1)[0]
    batch.group_ids = ["a", "a", "b", "b"]
    batch.trace_rows = 4
    learner = Learner(copy.deepcopy(model), None, get_algorithm("grpo"), AlgoConfig(group_size=2), CriticConfig(),
                      TrainConfig(lr=1e-3))
    with torch.no_grad():
        pi_old = learner.logprobs(batch)
    records = learner.step(batch).pop("trace")
    expected = group_advantages(batch.scalar_rewards, batch.group_ids)
    for rec in records:
        i = rec["row"]
        assert rec["group"] == batch.group_ids[i]
        assert rec["group_adv"] == pytest.approx(float(expected[i]), abs=TOL)
        assert {a for a in rec["adv"] if a is not None} == {rec["group_adv"]}
        assert "v_before" not in rec and "dis" not in rec  # PPO's clip, not DIS; no critic
        n = len(rec["logprob"])
        mask = batch.action_mask[i : i + 1, :n]
        assert _close(_row(rec["logprob"]), pi_old[i : i + 1, :n], mask)


def test_no_trace_unless_asked(tiny, tiny_model_dir):
    model, codec = tiny
    learner = Learner(copy.deepcopy(model), build_critic(tiny_model_dir), get_algorithm("sao"), AlgoConfig(),
                      CriticConfig(warmup_steps=0), TrainConfig(lr=1e-3))
    assert "trace" not in learner.step(_batches(codec, model, 1)[0])


@pytest.mark.slow
def test_a_run_writes_traces_joined_with_its_trajectories(tmp_path):
    """A real async run: traces/ on the dump steps, each record naming a dumped trajectory of that step
    with the same tokens, and the size per record stays small."""
    import subprocess
    import sys

    from tests.conftest import TINY

    subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "output.name=t", "output.trajectories_every=2",
                    "output.trace_trajectories=2", "output.progress=false"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=300)
    run = tmp_path / "runs" / "t"
    assert sorted(p.name for p in (run / "traces").iterdir()) == ["step_000002.jsonl", "step_000004.jsonl"]
    for step in (2, 4):
        dumped = {json.loads(line)["id"]: json.loads(line)
                  for line in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()}
        records = [json.loads(line) for line in (run / "traces" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert [r["row"] for r in records] == [0, 1]
        for rec in records:
            traj = dumped[rec["trajectory_id"]]
            assert rec["token_ids"] == traj["token_ids"] and rec["step"] == step and rec["algo"] == "sao"
            assert len(rec["text"]) == len(rec["adv"]) == len(traj["token_ids"])
            assert [v is not None for v in rec["v_after"]] == [bool(m) for m in traj["action_mask"]]
            assert rec["version"] == [v if m else None for v, m in zip(traj["token_versions"], traj["action_mask"])]


def test_stale_tokens_by_hand():
    from sao.algo.core import stale_tokens

    versions = torch.tensor([[-1, 0, 1, 2, -1, 3], [-1, -1, 3, 3, 1, -1]])
    mask = (versions >= 0).float()
    got = stale_tokens(versions, mask, version=3, max_lag=1)  # lag = 3 - version; stale when lag > 1
    assert got.tolist() == [[False, True, True, False, False, False], [False, False, False, False, True, False]]
    assert not stale_tokens(versions, mask, version=3, max_lag=3).any()


@pytest.mark.parametrize("algo", ["sao", "grpo"])
def test_max_token_lag_takes_stale_tokens_out_of_the_gradient(tiny, tiny_model_dir, algo):
    """Tokens sampled more than algo.max_token_lag versions ago: advantage 0 in the step (the record shows
    it), the masked fraction counted, and the DIS loss equals the hand sum over the fresh kept tokens
    divided by all action tokens."""
    model, codec = tiny
    batch = _batches(codec, model, 1)[0]
    batch.group_ids = ["a", "a", "b", "b"]
    for i in range(batch.size):  # versions 0..3 along each row's action tokens; the trainer is at version 3
        on = batch.action_mask[i].bool()
        batch.versions[i, on] = torch.arange(int(on.sum())) % 4
    batch.trace_rows = batch.size
    cfg = AlgoConfig(max_token_lag=1, group_size=2, ppo_minibatches=1)
    learner = Learner(copy.deepcopy(model), build_critic(tiny_model_dir) if algo == "sao" else None,
                      get_algorithm(algo), cfg, CriticConfig(warmup_steps=0), TrainConfig(lr=1e-3))
    learner.actor_version = 3
    metrics = learner.step(batch)
    records = metrics.pop("trace")
    mask = batch.action_mask.bool()
    stale = mask & (3 - batch.versions > 1)
    assert metrics["lag/masked_token_frac"] == pytest.approx(float(stale.sum() / mask.sum()))
    total, kept_sum, kept_abs = 0, 0.0, 0.0
    for rec in records:
        i = rec["row"]
        for t, (a, s) in enumerate(zip(rec["adv"], rec["stale"])):
            if a is None:
                continue
            total += 1
            assert s == int(stale[i, t])
            if s:
                assert a == 0.0
            elif algo == "sao" and rec["dis"][t] == 0:
                kept_sum += rec["ratio"][t] * a * rec["logprob"][t]
                kept_abs += abs(rec["ratio"][t] * a * rec["logprob"][t])
    assert total == int(mask.sum())
    if algo == "sao":  # -sum_t w_t A_t logpi_t / (all action tokens): stale ones add nothing, still count below
        # each recorded factor is rounded to 6 significant digits (relative error <= 5e-6 each, three per
        # term): the hand sum is exact to that, which a sum with cancellation can put above rel=1e-4 of it
        assert metrics["loss/policy"] == pytest.approx(-kept_sum / total, abs=2e-5 * kept_abs / total + 1e-7)
