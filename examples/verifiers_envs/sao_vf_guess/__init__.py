"""A multi-turn verifiers environment: guess a digit; the environment answers each guess (higher/lower).

The episode's loop is the environment's own (`GuessEnv.run`); the reward is 1 for a right guess, else how
close the last guess came.
"""

import re

import verifiers.v1 as vf


def parse_guess(text: str) -> int | None:
    found = re.findall(r"\d", text or "")
    return int(found[-1]) if found else None


class GuessData(vf.TaskData):
    secret: int
    max_guesses: int = 3


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def closeness(self, trace: vf.Trace) -> float:
        guesses = [parse_guess(m.content or "") for m in trace.assistant_messages]
        if self.data.secret in guesses:
            return 1.0
        last = guesses[-1] if guesses else None
        return 0.0 if last is None else 0.5 * (1 - abs(last - self.data.secret) / 9)

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as it:
            seg = await it.turn()
            for _ in range(task.data.max_guesses - 1):
                guess = parse_guess(seg.last_reply)
                if seg.terminated or guess == task.data.secret:
                    break
                hint = "higher" if guess is None or guess < task.data.secret else "lower"
                seg = await it.turn(f"No, go {hint}. Guess again: one digit.")


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        return [GuessTask(GuessData(prompt=f"Round {k}: I picked a digit 0-9. Guess it; reply with one digit.",
                                    secret=(3 * k + 1) % 10), self.config.task) for k in range(40)]


__all__ = ["GuessTaskset", "GuessEnv"]
