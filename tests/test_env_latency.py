"""Sampled environment latency (sao/envs/latency.py): log-normal around its median, awaited without
blocking other episodes, recorded per episode, off by default."""

import asyncio
import random
import statistics
import time

import pytest

from sao.envs import make_environment
from sao.envs.base import EpisodeContext
from sao.envs.latency import sample_delay


def test_delay_is_lognormal_with_the_given_median():
    rng = random.Random(0)
    xs = [sample_delay(rng, 2.0, 1.0) for _ in range(4001)]
    assert statistics.median(xs) == pytest.approx(2.0, rel=0.1)
    # P(X > 5 * median) = P(z > ln 5 = 1.61) = 5.4% for sigma 1: the long tail
    assert 0.04 < sum(x > 10.0 for x in xs) / len(xs) < 0.07
    assert sample_delay(rng, 2.0, 0.0) == 2.0


@pytest.mark.parametrize("name", ["calc", "style_shift", "code"])
def test_steps_wait_concurrently_and_report_the_wait(name):
    env = make_environment(name, {"step_latency_s": 0.2, "step_latency_sigma": 0.0}, 0)
    task = next(iter(env.train_tasks()))

    async def one():
        ep = env.new_episode(EpisodeContext())
        await ep.reset(task)
        return await ep.step("<answer>0</answer>")

    async def many():
        return await asyncio.gather(*(one() for _ in range(8)))

    t0 = time.perf_counter()
    results = asyncio.run(many())
    wall = time.perf_counter() - t0
    assert all(r.info["env_latency_s"] == pytest.approx(0.2) for r in results)
    assert 0.2 <= wall < 0.2 * 8  # eight 0.2 s waits overlap: far less than 1.6 s in a row


def test_no_latency_by_default_and_bad_values_name_the_option():
    env = make_environment("calc", {}, 0)
    assert type(env.new_episode(EpisodeContext())).__name__ == "CalcEpisode"
    with pytest.raises(ValueError, match="env.options.step_latency_s"):
        make_environment("calc", {"step_latency_s": -1}, 0)


def test_latency_does_not_change_the_cached_sft_model():
    """The delay only slows steps (same demos, same SFT model): an experiment with tool latency reuses
    the cached starting policy instead of spending minutes rebuilding an identical one."""
    from sao.config import load_config
    from sao.runtime.model_setup import base_model_key

    plain = base_model_key(load_config(None, []))
    slow = base_model_key(load_config(None, ["env.options.step_latency_s=0.3", "env.options.step_latency_sigma=1.0"]))
    assert slow == plain
    assert base_model_key(load_config(None, ["env.options.max_digits=3"])) != plain
