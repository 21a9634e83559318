"""A verifiers environment in the older API (verifiers < 0.4), as the Prime Environments Hub ships them:
`load_environment(**kwargs)` returns a MultiTurnEnv with a dataset, an eval_dataset and a rubric.

Guess a digit; the environment answers each wrong guess with higher/lower. The reward is 1 for a right
guess, else how close the last guess came (graded, so a random policy's rewards differ).
"""

import re

import verifiers as vf
from datasets import Dataset


def parse_guess(text) -> int | None:
    found = re.findall(r"\d", str(text or ""))
    return int(found[-1]) if found else None


class GuessEnv(vf.MultiTurnEnv):
    @vf.stop
    async def guessed_right(self, state) -> bool:
        if not state["trajectory"]:
            return False
        return parse_guess(state["trajectory"][-1]["completion"][-1].content) == int(state["answer"])

    async def env_response(self, messages, state, **kwargs):
        guess = parse_guess(messages[-1].content)
        hint = "higher" if guess is None or guess < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=f"No, go {hint}. One digit.")]


def closeness(completion, answer) -> float:
    guesses = [parse_guess(m["content"]) for m in completion if m["role"] == "assistant"]
    if int(answer) in guesses:
        return 1.0
    last = guesses[-1] if guesses else None
    return 0.0 if last is None else 0.5 * (1 - abs(last - int(answer)) / 9)


def guesses(completion) -> float:
    return float(sum(m["role"] == "assistant" for m in completion))


def load_environment(max_turns: int = 3, rounds: int = 40, **kwargs) -> vf.Environment:
    rows = [{"question": f"Round {k}: I picked a digit 0-9. Guess it; reply with one digit.", "answer": str((3 * k + 1) % 10)}
            for k in range(rounds)]
    rubric = vf.Rubric(funcs=[closeness])
    rubric.add_metric(guesses)
    return GuessEnv(dataset=Dataset.from_list(rows[8:]), eval_dataset=Dataset.from_list(rows[:8]), rubric=rubric,
                    max_turns=max_turns, **kwargs)
