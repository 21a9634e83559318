"""A task the SFT-warm-started tiny model solves: guess a number from 1 to 8, told higher or lower after
each wrong guess (the shape of the number-guessing OpenEnv task a user trained on). Its demonstrations
are binary search, so after SFT the policy is near-deterministic and right every time: the case where a
batch's rewards are all 1 (tests/test_solved_task.py)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from pydantic import Field

from sao.envs.base import EnvOptions, EpisodeContext, Message, StepResult
from sao.types import Task

_GUESS = re.compile(r"<guess>(\d+)</guess>")


class GuessOptions(EnvOptions):
    high: int = Field(8, ge=2, le=99, description="the secret is drawn from 1..high")


class GuessEpisode:
    def __init__(self, high: int) -> None:
        self.high, self.secret = high, 0

    def reset(self, task: Task) -> list[Message]:
        self.secret = int(task.answer)
        return [{"role": "user", "content": f"Guess my number from 1 to {self.high}."}]

    def step(self, text: str) -> StepResult:
        found = _GUESS.search(text)
        if not found:
            return StepResult("<result>format</result>")
        guess = int(found.group(1))
        if guess == self.secret:
            return StepResult("", 1.0, True)
        return StepResult("<result>higher</result>" if self.secret > guess else "<result>lower</result>")


class GuessEnvironment:
    Options = GuessOptions

    def __init__(self, options: GuessOptions, seed: int = 0) -> None:
        self.options, self.seed = options, seed

    def _task(self, name: str, rng: random.Random) -> Task:
        return Task(id=name, prompt=f"guess 1-{self.options.high}", answer=str(rng.randint(1, self.options.high)))

    def train_tasks(self) -> Iterator[Task]:
        rng, i = random.Random(self.seed), 0
        while True:
            i += 1
            yield self._task(f"g{i}", rng)

    def eval_tasks(self, n: int) -> list[Task]:
        rng = random.Random(10_000 + self.seed)
        return [self._task(f"e{i}", rng) for i in range(n)]

    def new_episode(self, ctx: EpisodeContext) -> GuessEpisode:
        return GuessEpisode(self.options.high)

    def demo(self, task: Task, rng: random.Random) -> list[Message]:
        """Binary search, as chat messages."""
        episode = GuessEpisode(self.options.high)
        messages, low, high = episode.reset(task), 1, self.options.high
        while True:
            guess = (low + high) // 2
            messages.append({"role": "assistant", "content": f"<guess>{guess}</guess>"})
            result = episode.step(messages[-1]["content"])
            if result.done:
                return messages
            messages.append({"role": "tool", "content": result.observation})
            low, high = (guess + 1, high) if "higher" in result.observation else (low, guess - 1)
