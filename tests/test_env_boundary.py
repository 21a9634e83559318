"""Untrusted values at the environment boundary (sao/rollout/trajectory.py, sao/rollout/agent_loop.py),
for every environment: a reward that is not a finite number ends the episode as `env_error` (counted,
never trained); an observation or reset prompt too large for the episode's token budget never becomes
part of a trainable trajectory and costs bounded time; no trainable trajectory is over
rollout.max_episode_tokens or has a turn over rollout.max_action_tokens. A seeded fuzz over both."""

import asyncio
import random
import time

import pytest

from sao.engine.torch_engine import TorchEngine
from sao.envs.base import StepResult
from sao.rollout.agent_loop import EpisodeLimits, run_episode
from sao.types import TRAINABLE, SamplingParams, Status, Task

LIMITS = EpisodeLimits(max_turns=3, max_action_tokens=8, max_episode_tokens=200, step_timeout_s=10)


class Hostile:
    """An environment that answers with whatever it was given: a reward, an observation, a prompt."""

    def __init__(self, reward=1.0, observation="ok", done=True, prompt="1+2", info=None):
        self.reward, self.observation, self.done, self.prompt, self.info = reward, observation, done, prompt, info or {}

    def reset(self, task):
        return [{"role": "user", "content": self.prompt}]

    def step(self, action):
        return StepResult(self.observation, self.reward, self.done, self.info)


def _run(tiny, env, limits=LIMITS):
    model, codec = tiny
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)

    async def go():
        try:
            return await run_episode(env, Task("t", "1+2"), engine, codec, SamplingParams(), limits)
        finally:
            await engine.close()

    t0 = time.perf_counter()
    traj = asyncio.run(go())
    return traj, time.perf_counter() - t0


def _finishing(tiny):
    """Make the random tiny model end its turns: its end-of-turn token is the only one it can sample."""
    model, codec = tiny
    import torch

    bias = torch.full((model.config.vocab_size,), -1e4)
    bias[codec.eos_id] = 0.0
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    return tiny


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf"), "nan", "1.0", True, None, [1.0],
                                    10.0 ** 308 * 10])
def test_a_reward_that_is_not_a_finite_number_is_an_env_error(tiny, reward):
    traj, _ = _run(_finishing(tiny), Hostile(reward=reward))
    assert traj.status == Status.ENV_ERROR and "reward" in traj.status_reason, (reward, traj.status_reason)
    assert traj.status not in TRAINABLE


def test_a_finite_reward_is_kept_and_non_finite_info_is_dropped(tiny):
    traj, _ = _run(_finishing(tiny), Hostile(reward=0.25, info={"a": 1.5, "b": float("nan"), "c": True, "d": "x"}))
    assert (traj.status, traj.reward) == (Status.OK, 0.25)
    assert traj.metrics == {"a": 1.5}


def test_a_huge_observation_ends_the_episode_in_bounded_time_without_entering_it(tiny):
    traj, took = _run(_finishing(tiny), Hostile(observation="x" * 6_000_000, done=False))
    assert traj.status == Status.TRUNCATED and traj.status_reason == "observation over the token budget"
    assert len(traj.token_ids) <= LIMITS.max_episode_tokens and "x" * 50 not in "".join(map(str, traj.token_ids))
    assert took < 5, took  # it is never tokenized whole (that took ~10 s on main)


def test_a_huge_reset_prompt_is_an_env_error_in_bounded_time(tiny):
    traj, took = _run(tiny, Hostile(prompt="y" * 6_000_000))
    assert traj.status == Status.ENV_ERROR and "max_episode_tokens" in traj.status_reason
    assert took < 5, took


def test_fuzz_no_trainable_trajectory_is_over_its_limits_or_has_a_non_finite_reward(tiny):
    """Seeded: random rewards (finite, non-finite, not numbers) and observations of random sizes."""
    rng = random.Random(0)
    rewards = [0.0, 1.0, -3.5, 1e-9, float("nan"), float("inf"), "0.5", None, False, 7]
    tiny = _finishing(tiny)
    for _ in range(25):
        size = rng.choice([0, 5, 60, 150, 400, 10_000, 2_000_000])
        env = Hostile(reward=rng.choice(rewards), observation="z" * size, done=rng.random() < 0.3,
                      prompt="p" * rng.choice([1, 50, 180]))
        traj, took = _run(tiny, env)
        assert took < 5
        if traj.status in TRAINABLE:
            assert isinstance(traj.reward, float) and traj.reward == traj.reward and abs(traj.reward) < float("inf")
            assert len(traj.token_ids) <= LIMITS.max_episode_tokens
            run = longest = 0
            for m in traj.action_mask:
                run = run + 1 if m else 0
                longest = max(longest, run)
            assert longest <= LIMITS.max_action_tokens


def test_numpy_and_torch_scalar_rewards_are_numbers(tiny):
    import numpy as np
    import torch

    for reward in (np.float32(0.5), np.int64(1), torch.tensor(0.25)):
        traj, _ = _run(_finishing(tiny), Hostile(reward=reward))
        assert traj.status == Status.OK and traj.reward == pytest.approx(float(reward)), (reward, traj.status_reason)
    traj, _ = _run(_finishing(tiny), Hostile(reward=torch.tensor([1.0, 2.0])))
    assert traj.status == Status.ENV_ERROR and "not one number" in traj.status_reason
