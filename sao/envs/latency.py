"""Environment latency that looks like agentic work: a sampled delay before each environment step.

Tool calls and test runs in real agentic tasks take seconds to minutes with a long tail; the
built-in environments answer in microseconds, which hides what asynchrony buys. With
`env.options.step_latency_s > 0` every step (a tool call, a test run, the final check) first waits
a delay drawn from a log-normal distribution with that median and `step_latency_sigma`
(sigma 1: a quarter of the steps take over 2x the median, one in 20 over 5x). The wait is an
`asyncio.sleep`, so other episodes keep decoding meanwhile, as they would while a real tool runs.
The `code` environment also has its real sandbox time on top.
"""

from __future__ import annotations

import inspect
import math
import random

from pydantic import Field

from sao.envs.base import EnvOptions, StepResult
from sao.types import Task


class LatencyOptions(EnvOptions):
    step_latency_s: float = Field(0.0, ge=0, description=(
        "median of a sampled delay before every environment step, in seconds (0: none)"))
    step_latency_sigma: float = Field(1.0, ge=0, description=(
        "log-normal sigma of that delay: 0 constant, 1 a long tail (5% of steps over 5x the median)"))


def sample_delay(rng: random.Random, median_s: float, sigma: float) -> float:
    """median * exp(sigma * z), z ~ N(0, 1): a log-normal delay with the given median."""
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class DelayedEpisode:
    """Wraps an episode: reset passes through; each step first sleeps a sampled delay."""

    def __init__(self, inner, rng: random.Random, median_s: float, sigma: float):
        self.inner, self.rng, self.median_s, self.sigma = inner, rng, median_s, sigma
        self.waited_s = 0.0

    async def reset(self, task: Task):
        return await _maybe_await(self.inner.reset(task))

    async def step(self, action: str) -> StepResult:
        import asyncio

        delay = sample_delay(self.rng, self.median_s, self.sigma)
        await asyncio.sleep(delay)
        self.waited_s += delay
        result = await _maybe_await(self.inner.step(action))
        result.info = {**result.info, "env_latency_s": self.waited_s}
        return result


def with_latency(episode, options: LatencyOptions, rng: random.Random):
    """`episode` itself when no latency is configured, else the delayed wrapper (own seeded stream)."""
    if options.step_latency_s <= 0:
        return episode
    return DelayedEpisode(episode, random.Random(rng.getrandbits(64)), options.step_latency_s,
                          options.step_latency_sigma)
