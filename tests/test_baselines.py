"""The baselines of docs/algorithm.md §7 with values derived by hand in the comments: group advantage, PPO clip
with ratios away from 1, the prompt-keyed running mean, step-level GAE, whole-group queueing, and
the combinations preflight refuses."""

import math

import pytest
import torch

from sao.algo.baselines import RunningMeanBaseline, group_advantages
from sao.algo.gae import step_level_gae
from sao.algo.losses import ppo_clip_loss
from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig, load_config
from sao.runtime.groups import GroupQueue, grouped
from sao.trainer.batch import collate
from sao.trainer.learner import Learner
from sao.types import Status, Task, Trajectory


def test_group_advantage_by_hand():
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    g = ["a"] * 4 + ["b"] * 4 + ["c"] * 3
    adv = group_advantages(r, g)
    # a: mean 0.5, population std 0.5            -> (1-0.5)/0.5 = 1, (0-0.5)/0.5 = -1
    # b: all equal, std 0                          -> 0 (no signal)
    # c: mean 1/3, var ((2/3)^2 + 2 (1/3)^2)/3 = 2/9, std = 0.4714 -> 1: 1.4142, 0: -0.7071
    expected = [1, -1, -1, 1, 0, 0, 0, 0, math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-4)


def test_ppo_clip_with_ratios_away_from_one():
    old = torch.zeros(1, 5)
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1]])
    logp = ratios.log().requires_grad_(True)
    adv = torch.tensor([[1.0, 1, -1, -1, 1]])
    loss, m = ppo_clip_loss(logp, old, adv, torch.ones(1, 5), 0.2, 0.28)
    # per token -min(r A, clip(r, 0.8, 1.28) A):
    #   r=1.5 A=+1: min(1.5, 1.28) = 1.28 (clipped)   -> -1.28
    #   r=0.5 A=+1: min(0.5, 0.8)  = 0.5  (unclipped) -> -0.5
    #   r=0.5 A=-1: min(-0.5,-0.8) = -0.8 (clipped)   -> +0.8
    #   r=1.5 A=-1: min(-1.5,-1.28)= -1.5 (unclipped) -> +1.5
    #   r=1.1 A=+1: 1.1 inside the range              -> -1.1
    # token mean: (-1.28 - 0.5 + 0.8 + 1.5 - 1.1) / 5 = -0.116
    assert float(loss.detach()) == pytest.approx(-0.116, abs=1e-6)
    loss.backward()
    # d/dlogp of -r A / 5 where the unclipped branch is taken (dr/dlogp = r), 0 where clipped:
    # [0, -0.5/5, 0, 1.5/5, -1.1/5] = [0, -0.1, 0, 0.3, -0.22]
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.1, 0.0, 0.3, -0.22]]), atol=1e-6)
    assert m["ppo/clipfrac"] == pytest.approx(0.8)  # 4 of 5 ratios outside (0.8, 1.28)


def test_running_mean_is_keyed_by_prompt_and_window():
    keys, rewards = ["p", "q", "p", "p", "p"], [1.0, 0.0, 0.0, 1.0, 1.0]
    per_prompt = RunningMeanBaseline(window=2, per_prompt=True).advantages(rewards, keys)
    # p: 1 - 0 (empty window) = 1; q: 0 - 0 = 0; p: 0 - 1 = -1; p: 1 - mean(1, 0) = 0.5; p: 1 - mean(0, 1) = 0.5
    assert per_prompt == pytest.approx([1.0, 0.0, -1.0, 0.5, 0.5])
    glob = RunningMeanBaseline(window=2, per_prompt=False).advantages(rewards, keys)
    # one window: 1 - 0 = 1; 0 - 1 = -1; 0 - mean(1, 0) = -0.5; 1 - mean(0, 0) = 1; 1 - mean(0, 1) = 0.5
    assert glob == pytest.approx([1.0, -1.0, -0.5, 1.0, 0.5])


def test_step_level_gae_one_advantage_per_turn_lambda_from_turns():
    # positions: 0 prompt | 1 2 turn 0 | 3 observation | 4 5 6 turn 1 | 7 padding
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 0.4, 0.5, 0.6, 9.0]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 0, 1.0, 0]])
    adv, lam = step_level_gae(rewards, values, mask, gamma=1.0, alpha=1.5, mode="last")
    # n = 2 turns -> lambda = 1 - 1/(1.5*2) = 2/3 (token-level would use 5 tokens: 1 - 1/7.5 = 0.867)
    # last-token values V0 = 0.2, V1 = 0.6: A1 = 1 + 0 - 0.6 = 0.4; A0 = 0 + 0.6 - 0.2 + (2/3)*0.4 = 0.6667
    assert float(lam[0]) == pytest.approx(2 / 3)
    a0, a1 = 0.4 + 0.8 / 3, 0.4
    assert torch.allclose(adv, torch.tensor([[0, a0, a0, 0, a1, a1, a1, 0]]), atol=1e-6)
    adv, _ = step_level_gae(rewards, values, mask, 1.0, 1.5, mode="state")
    # values of the states each turn starts from (critic head before the turn) V0 = 0.1, V1 = 0.4:
    # A1 = 1 - 0.4 = 0.6; A0 = 0 + 0.4 - 0.1 + (2/3)*0.6 = 0.7
    a0, a1 = 0.7, 0.6
    assert torch.allclose(adv, torch.tensor([[0, a0, a0, 0, a1, a1, a1, 0]]), atol=1e-6)
    adv, _ = step_level_gae(rewards, values, mask, 1.0, 1.5, mode="mean")
    # turn means V0 = 0.15, V1 = 0.5: A1 = 0.5; A0 = 0.5 - 0.15 + (2/3)*0.5 = 0.6833
    a0, a1 = 0.35 + 1 / 3, 0.5
    assert torch.allclose(adv, torch.tensor([[0, a0, a0, 0, a1, a1, a1, 0]]), atol=1e-6)


def _traj(i, task_id, version=0, status=Status.OK, prompt=(1, 2), reward=0.0):
    ids = list(prompt) + [3, 4]
    return Trajectory(id=str(i), task_id=task_id, token_ids=ids, action_mask=[0] * len(prompt) + [1, 1],
                      behavior_logprobs=[0.0] * len(ids), token_versions=[-1] * len(prompt) + [version] * 2,
                      prompt_len=len(prompt), status=status, reward=reward)


def test_group_queue_releases_whole_groups_and_drops_them_whole():
    q = GroupQueue(group_size=2)
    q.put(_traj(0, "a"))
    q.put(_traj(1, "b"))
    assert q.get_batch(2, 0, 1) == ([], [])  # no group complete yet
    q.put(_traj(2, "b"))
    batch, dropped = q.get_batch(2, 0, 1)
    assert [t.id for t in batch] == ["1", "2"] and not dropped  # b finished first: trained first
    q.put(_traj(3, "a", version=0))  # a's oldest token is version 0: lag 2 at version 2
    q.put(_traj(4, "c", status=Status.ENV_ERROR))
    q.put(_traj(5, "c", version=2))
    q.put(_traj(6, "d", version=2))
    q.put(_traj(7, "d", version=1))
    batch, dropped = q.get_batch(2, current_version=2, max_lag=1)
    assert [t.id for t in batch] == ["6", "7"]  # lag of d = 2 - 1 = 1
    assert sorted(t.id for t in dropped) == ["0", "3", "4", "5"]  # a stale, c has a failed member
    assert q.dropped_stale == 2 and q.failed == {"env_error": 1} and q.dropped_group == 1
    reasons = {t.id: q.drop_reason(t) for t in dropped}  # what the audit records per member
    assert reasons == {"0": "stale", "3": "stale", "4": "env_error", "5": "group_member_failed"}


def test_grouped_stream_repeats_each_draw_with_a_unique_key():
    tasks = iter([Task("t1", "x"), Task("t1", "x"), Task("t2", "y")])  # a dataset may repeat an id
    ids = [t.id for t in grouped(tasks, 2)]
    assert ids == ["t1#g0", "t1#g0", "t1#g1", "t1#g1", "t2#g2", "t2#g2"]


def _on_policy(model, codec, specs):
    from sao.models.actor import sequence_logprobs

    trajs = []
    for i, (task_id, prompt, text, reward) in enumerate(specs):
        p = codec.prompt_ids([{"role": "user", "content": prompt}])
        ids = p + codec.action_ids(text)
        with torch.no_grad():
            lp = sequence_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
        mask = [0] * len(p) + [1] * (len(ids) - len(p))
        trajs.append(Trajectory(str(i), task_id, ids, mask, [x * m for x, m in zip(lp, mask)],
                                [0 if m else -1 for m in mask], len(p), reward=reward))
    return collate(trajs, codec.tokenizer.pad_token_id)


def test_running_mean_learner_keys_by_prompt_content_and_does_not_whiten(tiny):
    model, codec = tiny
    learner = Learner(model, None, get_algorithm("running_mean"), AlgoConfig(running_mean_window=8),
                      CriticConfig(), TrainConfig(lr=1e-6))
    # the same prompt drawn twice under two task ids shares one window
    first = _on_policy(model, codec, [("draw-1", "1+2", "<answer>3</answer>", 1.0)])
    learner.step(first)
    m = learner.step(_on_policy(model, codec, [("draw-2", "1+2", "<answer>3</answer>", 0.0),
                                               ("draw-3", "2+2", "<answer>4</answer>", 1.0)]))
    # advantages 0 - 1 = -1 (window of "1+2" holds 1) and 1 - 0 = 1 (new prompt), used as computed:
    # their token mean depends on the lengths, it is not whitened to 0
    assert learner.running_mean.state_dict()[first.prompt_keys[0]] == [1.0, 0.0]
    n1, n2 = (len(codec.action_ids(t)) for t in ("<answer>3</answer>", "<answer>4</answer>"))
    assert m["adv/mean_raw"] == pytest.approx((-n1 + n2) / (n1 + n2), abs=1e-6)


def test_vapo_takes_several_updates_against_one_pi_old(tiny, tiny_model_dir):
    from sao.models.critic import build_critic

    model, codec = tiny
    learner = Learner(model, build_critic(tiny_model_dir), get_algorithm("vapo"),
                      AlgoConfig(ppo_minibatches=2, ppo_epochs=2), CriticConfig(warmup_steps=0), TrainConfig(lr=1e-2))
    batch = _on_policy(model, codec, [("a", "1+2", "<calc>1+2</calc>", 1.0), ("b", "3+4", "<answer>9</answer>", 0.0)])
    m = learner.step(batch)
    # 2 epochs x 2 minibatches; pi_old is the policy before the first update, so only that first update
    # sees ratio 1 everywhere: the mean KL to pi_old over the four updates is > 0
    assert m["ppo/updates"] == 4 and m["ppo/approx_kl"] > 0 and learner.actor_version == 1


def test_grpo_learner_needs_whole_groups(tiny):
    model, codec = tiny
    cfg = AlgoConfig(group_size=2, ppo_minibatches=1)
    learner = Learner(model, None, get_algorithm("grpo"), cfg, CriticConfig(), TrainConfig(lr=1e-3))
    texts = ["<answer>3</answer>", "<answer>34</answer>", "<answer>4</answer>", "<answer>4</answer>"]
    batch = _on_policy(model, codec, [("g0", "1+2", texts[0], 1.0), ("g0", "1+2", texts[1], 0.0),
                                      ("g1", "2+2", texts[2], 1.0), ("g1", "2+2", texts[3], 1.0)])
    m = learner.step(batch)
    # g0: advantages +1, -1 on every action token; g1: all rewards equal -> 0. On policy (one minibatch,
    # ratio 1) the loss is -(token mean of A) = -(n0 - n1) / (n0 + n1 + n2 + n3), not whitened
    n = [len(codec.action_ids(t)) for t in texts]
    assert m["loss/policy"] == pytest.approx(-(n[0] - n[1]) / sum(n), abs=1e-6) and learner.actor_version == 1
    with pytest.raises(RuntimeError, match="groups of sizes"):
        learner.step(batch.rows(torch.tensor([0, 1, 2])))


@pytest.mark.parametrize("overrides,needle", [
    (["algo.name=grpo", "train.batch_size=12"], "train.batch_size: 12 is not a multiple of algo.group_size=8"),
    (["algo.name=grpo", "algo.group_size=1"], "algo.group_size: Input should be greater than or equal to 2"),
    (["algo.name=vapo", "train.batch_size=6"], "train.batch_size: 6 is not a multiple of algo.ppo_minibatches=4"),
])
def test_invalid_combinations_are_refused_with_one_line(tmp_path, sao_cli, overrides, needle):
    proc = sao_cli("train", *overrides, "output.root=runs", cwd=tmp_path)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_code_recipe_sets_the_coding_dis_bounds():
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "examples" / "configs" / "code.yaml"
    cfg = load_config(recipe)
    assert (cfg.env.name, cfg.algo.eps_low, cfg.algo.eps_high) == ("code", 0.8, 3.0)
    assert load_config(recipe, ["algo.eps_high=5.0"]).algo.eps_high == 5.0  # the user's value wins
