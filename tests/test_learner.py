"""One optimizer step: the order of docs/algorithm.md §5, K critic updates, warm-up, frozen attention, DIS."""

import pytest
import torch

from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.models.critic import build_critic
from sao.trainer.batch import collate
from sao.trainer.learner import Learner
from sao.types import Trajectory


def _batch(codec, model):
    """Two trajectories whose behavior log-probs are the actor's own (on-policy, ratio 1)."""
    from sao.models.actor import sequence_logprobs

    trajs = []
    for i, (text, reward) in enumerate([("<calc>1+2</calc>", 1.0), ("<answer>9</answer>", 0.0)]):
        p = codec.prompt_ids([{"role": "user", "content": "1+2"}])
        a = codec.action_ids(text)
        ids = p + a
        with torch.no_grad():
            lp = sequence_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
        mask = [0] * len(p) + [1] * len(a)
        trajs.append(Trajectory(str(i), f"task{i}", ids, mask, [x * m for x, m in zip(lp, mask)],
                                [0 if m else -1 for m in mask], len(p), reward=reward))
    return collate(trajs, codec.tokenizer.pad_token_id)


def _learner(model, critic, algo="sao", **critic_kw):
    return Learner(model, critic, get_algorithm(algo), AlgoConfig(), CriticConfig(**critic_kw), TrainConfig(lr=1e-3))


def test_warmup_updates_critic_only_then_actor(tiny, tiny_model_dir):
    model, codec = tiny
    critic = build_critic(tiny_model_dir)
    learner = _learner(model, critic, warmup_steps=2, updates_per_step=2)
    batch = _batch(codec, model)
    actor_before = [p.detach().clone() for p in model.parameters()]
    attn_before = critic.model.layers[0].self_attn.q_proj.weight.detach().clone()
    m = learner.step(batch)
    assert m["train/critic_warmup"] == 1.0 and "loss/policy" not in m
    assert all(torch.equal(a, b) for a, b in zip(actor_before, model.parameters()))  # actor untouched
    assert learner.critic_version == 2 and learner.actor_version == 0  # K = 2 critic steps
    learner.step(batch)
    m = learner.step(batch)  # warm-up over: critic K steps, then one actor step
    assert learner.critic_version == 6 and learner.actor_version == 1
    assert m["critic/version"] == 6 and "dis/masked_low_frac" in m
    assert not all(torch.equal(a, b) for a, b in zip(actor_before, model.parameters()))
    assert torch.equal(attn_before, critic.model.layers[0].self_attn.q_proj.weight)  # frozen attention
    assert critic.score.weight.abs().sum() > 0  # the value head learned


def test_on_policy_batch_masks_nothing_and_moves_toward_reward(tiny, tiny_model_dir):
    model, codec = tiny
    learner = _learner(model, build_critic(tiny_model_dir), warmup_steps=0)
    batch = _batch(codec, model)
    m = learner.step(batch)
    assert m["dis/masked_low_frac"] == 0.0 and m["dis/masked_high_frac"] == 0.0
    assert m["dis/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    from sao.models.actor import sequence_logprobs

    with torch.no_grad():
        lp = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    # the rewarded trajectory became more likely relative to the unrewarded one
    gain = ((lp - batch.behavior_logprobs) * batch.action_mask).sum(1)
    assert gain[0] > gain[1]


def test_k1_ablation_takes_one_critic_step(tiny, tiny_model_dir):
    model, codec = tiny
    learner = _learner(model, build_critic(tiny_model_dir), algo="sao_k1", warmup_steps=0)
    learner.step(_batch(codec, model))
    assert learner.critic_version == 1


def test_running_mean_advantages_drive_the_actor_step(tiny):
    """Both trajectories of `_batch` answer the same prompt, rewards 1 then 0; the window (per prompt)
    is filled in batch order and each reward is judged against the rewards before it:
      step 1: A = 1 - 0 = 1 (empty window), 0 - mean[1] = -1
      step 2: A = 1 - mean[1, 0] = 0.5, 0 - mean[1, 0, 1] = -2/3
    Every action token of a trajectory carries its advantage (not whitened), so with n0, n1 action tokens
    adv/mean_raw = (n0 * A0 + n1 * A1) / (n0 + n1)."""
    model, codec = tiny
    batch = _batch(codec, model)
    n0, n1 = batch.action_mask.sum(1).tolist()
    learner = Learner(model, None, get_algorithm("running_mean"), AlgoConfig(), CriticConfig(), TrainConfig(lr=1e-3))
    m = learner.step(batch)
    assert learner.actor_version == 1 and "critic/version" not in m
    assert m["adv/mean_raw"] == pytest.approx((n0 * 1 + n1 * -1) / (n0 + n1), abs=1e-6)
    from sao.models.actor import sequence_logprobs

    with torch.no_grad():
        lp = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    gain = ((lp - batch.behavior_logprobs) * batch.action_mask).sum(1)
    assert gain[0] > 0 > gain[1]  # the positive advantage became more likely, the negative one less
    m = learner.step(batch)
    assert m["adv/mean_raw"] == pytest.approx((n0 * 0.5 + n1 * -2 / 3) / (n0 + n1), abs=1e-6)


def test_entropy_bonus_is_off_by_default_and_raises_entropy_when_on(tiny, tiny_model_dir):
    from sao.models.actor import token_entropy
    from sao.models.tiny import load_model

    model, codec = tiny
    batch = _batch(codec, model)

    def entropy_after(coef):
        m = load_model(tiny_model_dir)
        learner = Learner(m, None, get_algorithm("running_mean"), AlgoConfig(entropy_coef=coef), CriticConfig(),
                          TrainConfig(lr=1e-2))
        for _ in range(3):
            learner.step(batch)
        with torch.no_grad():
            ent = token_entropy(m(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits)
        return float((ent * batch.action_mask).sum() / batch.action_mask.sum())

    assert AlgoConfig().entropy_coef == 0.0
    assert entropy_after(1.0) > entropy_after(0.0)


def test_non_finite_loss_skips_the_update_and_too_many_in_a_row_stop_the_run(tiny, tiny_model_dir):
    from sao.trainer.learner import NonFiniteError

    model, codec = tiny
    critic = build_critic(tiny_model_dir)
    learner = Learner(model, critic, get_algorithm("sao"), AlgoConfig(), CriticConfig(warmup_steps=0),
                      TrainConfig(lr=1e-3, max_nonfinite_steps=2))
    good = _batch(codec, model)
    bad = _batch(codec, model)
    bad.rewards[0][bad.rewards[0] != 0] = float("nan")  # e.g. an environment that returned NaN
    weights = [p.detach().clone() for p in [*model.parameters(), *critic.parameters()]]
    opt_state = len(learner.actor_opt.state)
    m = learner.step(bad)  # NaN returns -> both critic losses NaN; NaN advantages -> actor loss NaN
    assert m["guard/skipped_updates"] == 3 and m["guard/skipped_updates_total"] == 3
    assert all(torch.equal(a, b) for a, b in zip(weights, [*model.parameters(), *critic.parameters()]))
    assert learner.actor_version == 0 and learner.critic_version == 0 and len(learner.actor_opt.state) == opt_state
    m = learner.step(good)  # a finite step resets the run of skipped steps
    assert m["guard/skipped_updates"] == 0 and learner.actor_version == 1 and learner.critic_version == 2
    learner.step(bad)
    resumed = Learner(model, critic, get_algorithm("sao"), AlgoConfig(), CriticConfig(warmup_steps=0),
                      TrainConfig(lr=1e-3, max_nonfinite_steps=2))
    resumed.load_guard_state(learner.guard_state())  # what a checkpoint carries (sao/runtime/checkpoint.py)
    assert resumed.guard_state() == {"skipped_total": 6, "consecutive_skipped": 1}
    with pytest.raises(NonFiniteError, match="train.max_nonfinite_steps=2"):
        resumed.step(bad)  # the run of skipped steps goes on counting across a resume
    with pytest.raises(NonFiniteError, match="train.max_nonfinite_steps=2"):
        learner.step(bad)


def test_non_finite_gradient_with_finite_loss_skips_the_update(tiny, tiny_model_dir):
    model, _ = tiny
    learner = Learner(model, None, get_algorithm("running_mean"), AlgoConfig(), CriticConfig(), TrainConfig())
    before = [p.detach().clone() for p in model.parameters()]
    p0 = next(model.parameters())
    loss = (p0.sum() * 0).sqrt()  # sqrt(0) = 0 is finite; its gradient 0.5 / sqrt(0) * 0 is NaN
    assert torch.isfinite(loss) and learner._apply(learner.actor_opt, loss, 1.0) is None
    assert learner.skipped_in_step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_whitening_does_not_blow_critic_noise_up_when_no_reward_varies(tiny, tiny_model_dir):
    """Every reward 0: the raw advantages are the critic's noise. Floored whitening keeps them small;
    an unfloored std (1e-6) scales that noise to unit size and the actor moves on nothing (measured:
    entropy 4.68 -> 0.8 in 200 steps at reward 0)."""
    model, codec = tiny
    batch = _batch(codec, model)
    batch.rewards.zero_()
    batch.scalar_rewards.zero_()
    norms = {}
    for floor in (1e-6, AlgoConfig().whiten_min_std):
        torch.manual_seed(0)
        actor = type(model)(model.config)
        actor.load_state_dict(model.state_dict())
        critic = build_critic(tiny_model_dir)
        with torch.no_grad():
            critic.score.weight.normal_(0, 1e-3)  # a critic that is not exactly zero: noise of ~1e-3
        # the floor matters where such batches train the actor: algo.skip_uniform_rewards off
        learner = Learner(actor, critic, get_algorithm("sao"), AlgoConfig(whiten_min_std=floor, skip_uniform_rewards=False),
                          CriticConfig(warmup_steps=0), TrainConfig(lr=1e-3))
        m = learner.step(batch)
        assert m["reward/mean"] == 0.0 and m["adv/std_raw"] < 1e-2
        norms[floor] = m["actor/grad_norm"]
    assert norms[1e-6] > 5 * norms[AlgoConfig().whiten_min_std]  # measured: 2.91 vs 0.30


def test_no_actor_step_on_a_batch_whose_rewards_are_all_equal(tiny, tiny_model_dir):
    """algo.skip_uniform_rewards: the critic learns, the actor's weights, optimizer state and version do
    not move (tests/test_solved_task.py shows why); one differing reward and the actor steps again."""
    model, codec = tiny
    batch = _batch(codec, model)
    last = batch.action_mask.cumsum(1).argmax(1)
    batch.rewards.zero_()
    batch.rewards[torch.arange(batch.size), last] = 1.0
    batch.scalar_rewards.fill_(1.0)
    actor = type(model)(model.config)
    actor.load_state_dict(model.state_dict())
    learner = Learner(actor, build_critic(tiny_model_dir), get_algorithm("sao"), AlgoConfig(),
                      CriticConfig(warmup_steps=0), TrainConfig(lr=1e-3))
    before = [p.detach().clone() for p in actor.parameters()]
    critic_before = [p.detach().clone() for p in learner.critic.parameters()]
    m = learner.step(batch)
    assert m["actor/uniform_skipped"] == 1.0 and "actor/grad_norm" not in m and learner.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, actor.parameters()))
    assert not learner.actor_opt.state  # Adam saw nothing: no momentum to carry on
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, learner.critic.parameters()))
    batch.scalar_rewards[0] = 0.0
    batch.rewards[0, last[0]] = 0.0
    m = learner.step(batch)
    assert m["actor/uniform_skipped"] == 0.0 and m["actor/grad_norm"] > 0 and learner.version == 1
