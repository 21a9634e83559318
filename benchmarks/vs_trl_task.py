"""The task and model of benchmarks/vs_trl.py, shared by both frameworks: one turn of "What is a+b?".

One code path for both sides, so neither gets an easier task:

    tasks(seed, n)            (a, b) pairs with a, b in 0..4, seeded; the prompt text and the answer a+b
    reward(text, answer, eos) 1 if the completion ended with EOS and its answer equals a+b, else 0
    build_model(out, seed)    the ~1.8M-parameter char-level Qwen2 (random init) + tokenizer + ChatML
                              template, in HF layout: `AutoModelForCausalLM` / `AutoTokenizer` load it

The answer is the text in `<answer>...</answer>` when present, else the last integer of the reply
(as `calc` judges an untagged reply), so an untrained char-level model has a small chance to score.
`AdditionEnvironment` is the sao side (`env.name=benchmarks.vs_trl_task:AdditionEnvironment`); the
TRL side imports `tasks` and `reward` (this module imports nothing of sao at module level, so the
TRL venv, which has no sao, can import it).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_INTEGER = re.compile(r"-?\d+")
MAX_OPERAND = 4
# ~1.8M parameters: the size of benchmarks/stability.py --large-model
MODEL = dict(arch="qwen2", hidden_size=192, num_layers=4, num_heads=4, intermediate_size=512)


def prompt(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def tasks(seed: int, n: int) -> list[tuple[str, int]]:
    """n (prompt, answer) pairs drawn uniformly from a, b in 0..MAX_OPERAND."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        out.append((prompt(a, b), a + b))
    return out


def reward(text: str, answer: int, eos: bool) -> float:
    """1.0 if the reply ended with EOS (not cut at the token limit) and its answer is `answer`."""
    if not eos:
        return 0.0
    tagged = _ANSWER.search(text)
    numbers = _INTEGER.findall(tagged.group(1) if tagged else text)
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


def build_model(out_dir: str | Path, seed: int = 0, **sizes) -> Path:
    """The shared model folder (needs sao: the main venv builds it, both frameworks load it); `sizes`
    replace `MODEL`'s (vs_trl.py builds a smaller critic with the same tokenizer that way)."""
    from sao.models.tiny import build_tiny_model

    return build_tiny_model(out_dir, seed=seed, **{**MODEL, **sizes})


try:  # the sao side; the TRL venv has no sao and only needs the functions above
    from sao.envs.base import EnvOptions, EpisodeContext, Message, StepResult
    from sao.types import Task
except ImportError:
    pass
else:

    class AdditionEpisode:
        def __init__(self) -> None:
            self.answer = 0

        def reset(self, task: Task) -> list[Message]:
            self.answer = int(task.answer)
            return [{"role": "user", "content": task.prompt}]

        def step(self, action: str) -> StepResult:
            # sao calls step only for a reply that ended with EOS (a cut one is truncated, reward 0)
            r = reward(action, self.answer, eos=True)
            return StepResult("", r, True, {"correct": r})

    class AdditionEnvironment:
        """Training tasks from the run's seed; eval tasks: all 25 pairs (there is nothing held out)."""

        Options = EnvOptions

        def __init__(self, options: EnvOptions, seed: int = 0):
            self.seed = seed

        def train_tasks(self) -> Iterator[Task]:
            i = 0
            while True:
                for text, answer in tasks(self.seed * 1_000_003 + i, 1000):
                    yield Task(id=f"add-{i}", prompt=text, answer=answer)
                    i += 1

        def eval_tasks(self, n: int) -> list[Task]:
            pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
            return [Task(id=f"add-eval-{i}", prompt=prompt(a, b), answer=a + b)
                    for i, (a, b) in enumerate((pairs * (n // len(pairs) + 1))[:n])]

        def new_episode(self, ctx: EpisodeContext) -> AdditionEpisode:
            return AdditionEpisode()
