"""An example user environment: spell a made-up word backwards, with one retry after feedback.

Everything `sao` needs from an environment is here, in one file outside the package:

    Options         a pydantic `EnvOptions` subclass: typed, documented, unknown keys rejected
    train_tasks()   an endless iterator of `Task`s
    eval_tasks(n)   n held-out tasks, disjoint from the training ones and the same every run
    new_episode()   one `Env` per episode: `reset(task) -> messages`, `step(text) -> StepResult`
    demo()          (optional) a solved episode, so the built-in tiny model can be SFT-warm-started

Use it without touching `sao`:

    sao train env.name=examples.word_env.word_env:WordEnvironment env.options.max_len=5

or register a short name in your own launcher before calling sao's Python API:

    from sao.envs import register_environment
    register_environment("word", WordEnvironment)

Episode: the user message is `reverse: kotamu`; the model answers `<answer>umatok</answer>`.
A wrong answer gets `<result>3 of 6 letters right</result>` and another try (`max_attempts`).
Reward 1 for a correct answer, else 0; `info` carries per-episode metrics (`env/char_acc`, ...).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator

from pydantic import Field, model_validator

from sao.envs.base import EnvOptions, EpisodeContext, Message, StepResult
from sao.types import Task

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


class WordOptions(EnvOptions):
    min_len: int = Field(3, ge=2, le=12, description="fewest letters in a word")
    max_len: int = Field(6, ge=2, le=12, description="most letters in a word")
    max_attempts: int = Field(2, ge=1, le=8, description="answers allowed per episode (feedback after a wrong one)")
    heldout_every: int = Field(10, ge=2, description="one word in this many (by hash) is held out for evaluation")

    @model_validator(mode="after")
    def _lengths(self) -> WordOptions:
        if self.min_len > self.max_len:
            raise ValueError("min_len must be <= max_len")
        return self


def make_word(rng: random.Random, length: int) -> str:
    """A pronounceable made-up word: consonant-vowel pairs, so it never repeats a dictionary."""
    return "".join(rng.choice(_VOWELS if i % 2 else _CONSONANTS) for i in range(length))


class WordEpisode:
    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.target = ""
        self.attempts = 0

    def reset(self, task: Task) -> list[Message]:
        self.target, self.attempts = task.answer, 0
        return [{"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        self.attempts += 1
        m = _ANSWER.search(action)
        guess = m.group(1).strip() if m else ""
        right = sum(a == b for a, b in zip(guess, self.target))
        correct = guess == self.target
        if correct or self.attempts >= self.max_attempts:
            info = {"correct": float(correct), "char_acc": right / len(self.target), "attempts": self.attempts}
            return StepResult("", 1.0 if correct else 0.0, True, info)
        return StepResult(f"<result>{right} of {len(self.target)} letters right</result>")


class WordEnvironment:
    """Made-up words from a seeded generator; a hash of the word decides the held-out split."""

    Options = WordOptions

    def __init__(self, options: WordOptions, seed: int = 0):
        self.options, self.seed = options, seed

    def is_heldout(self, word: str) -> bool:
        digest = hashlib.sha256(word.encode()).digest()  # no seed: the split is the same for every run
        return int.from_bytes(digest[:4], "big") % self.options.heldout_every == 0

    def _stream(self, seed: int, split: str, heldout: bool) -> Iterator[Task]:
        rng, i = random.Random(seed), 0
        while True:
            word = make_word(rng, rng.randint(self.options.min_len, self.options.max_len))
            if self.is_heldout(word) == heldout:
                yield Task(id=f"word-{split}-{i}", prompt=f"reverse: {word}", answer=word[::-1])
                i += 1

    def train_tasks(self) -> Iterator[Task]:
        return self._stream(self.seed, "train", heldout=False)

    def eval_tasks(self, n: int) -> list[Task]:
        stream = self._stream(1_000_003, "eval", heldout=True)  # fixed: every run evaluates the same words
        return [next(stream) for _ in range(n)]

    def new_episode(self, ctx: EpisodeContext) -> WordEpisode:
        return WordEpisode(self.options.max_attempts)

    def demo(self, task: Task, rng: random.Random) -> list[Message]:
        """A solved episode for the SFT warm start: the answer at the first try."""
        return [{"role": "user", "content": task.prompt},
                {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]
