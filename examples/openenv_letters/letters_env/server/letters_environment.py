"""Write a line that uses one letter as often as possible, over `rounds` rounds.

reset(seed) picks the letter from the seed; each step scores the line: the fraction of its
characters that are that letter (0 for an empty line). Each round's reward is its score / rounds,
so an episode's rewards sum to the mean score. The episode ends after `rounds` steps.
"""

import random
import uuid

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from letters_env.models import LetterAction, LetterObservation

LETTERS = "aeiost"


def score(text: str, letter: str) -> float:
    return text.count(letter) / len(text) if text else 0.0


class LettersEnvironment(Environment[LetterAction, LetterObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared mutable state between instances

    def __init__(self, rounds: int = 2):
        super().__init__()
        self.rounds = rounds
        self.letter = "a"
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def _prompt(self) -> str:
        return f"Write one line using the letter '{self.letter}' as often as you can."

    def reset(self, seed=None, episode_id=None, **kwargs) -> LetterObservation:
        self.letter = random.Random(seed).choice(LETTERS)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return LetterObservation(prompt=self._prompt())

    def step(self, action: LetterAction, timeout_s=None, **kwargs) -> LetterObservation:
        self._state.step_count += 1
        s = score(action.text, self.letter)
        done = self._state.step_count >= self.rounds
        return LetterObservation(prompt="" if done else self._prompt(), feedback=f"round {self._state.step_count}: "
                                 f"{round(100 * s)}% '{self.letter}'", reward=s / self.rounds, done=done)

    @property
    def state(self) -> State:
        return self._state
