"""`math`: answer a math problem; the final answer is checked with math-verify (or reasoning-gym's scorer).

The model replies in free text and ends with its final answer as `\\boxed{...}` or
`<answer>...</answer>` (the last one in the reply counts). With `max_attempts` 1 the episode is
single-turn: the first reply is scored. With more, a reply without a final answer or with a wrong
one gets a short feedback observation and the model tries again; reward is the score of the last
reply (1 when correct, else 0; reasoning-gym scorers may give partial credit).

Task sources (`source`):
  - `file` (default): JSONL, Parquet or a `datasets` folder through `sao.envs.dataset`, with
    configurable field names and a fixed train/held-out split. Answers are compared by
    math-verify, so `\\boxed{1/2}` matches `0.5` and `\\frac{1}{2}`.
  - `reasoning_gym`: a procedurally generated reasoning-gym dataset (e.g. `chain_sum`), works
    offline, scored by the dataset's own `score_answer`; needs `pip install sao[tasks]`.

math-verify and reasoning-gym are imported on first use, so registering `math` costs nothing.
"""

from __future__ import annotations

import functools
import random
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import Field

from sao.envs.base import EpisodeContext, Message, StepResult, register_environment
from sao.envs.dataset import EXTRA, DatasetOptions, TaskSplit, hash_split, load_task_split
from sao.types import Task

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\s*\{")
_WORDS = re.compile(r"[A-Za-z]{2,}(?:\s+[A-Za-z]+)*")  # answers like "yes" or "blue whale"
VERIFY_TIMEOUT_S = 5  # math-verify's own signal-based limit; only usable in the main thread

Scorer = Callable[[str, Task], float]


class MathOptions(DatasetOptions):
    source: Literal["file", "reasoning_gym"] = Field("file", description="tasks from a file (path) or reasoning-gym")
    dataset: str | None = Field(None, description="reasoning-gym dataset name, e.g. chain_sum (source=reasoning_gym)")
    dataset_config: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the reasoning-gym dataset, e.g. {max_terms: 3}")
    size: int = Field(2000, ge=2, description="reasoning-gym: tasks generated (split into train and held-out)")
    system_prompt: str | None = Field(None, description="system message before every problem (none by default)")
    max_attempts: int = Field(1, ge=1, le=32, description="answers the model may give; 1 = single-turn")
    demo_format: Literal["answer", "boxed"] = Field(
        "answer", description="SFT demos end with <answer>x</answer> or \\boxed{x}")


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(position, content) of the last `\\boxed{...}` whose braces balance."""
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = (m.start(), text[m.end(): i - 1])
    return found


def extract_answer(text: str) -> str | None:
    """The final answer of a reply: the last `\\boxed{...}` or `<answer>...</answer>`, or None."""
    candidates = [(m.start(), m.group(1)) for m in _ANSWER.finditer(text)][-1:]
    boxed = _last_boxed(text)
    if boxed is not None:
        candidates.append(boxed)
    if not candidates:
        return None
    return max(candidates)[1].strip()


def _timeout() -> int | None:
    return VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _latex(text: str) -> str:
    return text if "$" in text or "\\boxed" in text else f"${text}$"


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str) -> tuple:
    from math_verify import parse

    return tuple(parse(_latex(gold), parsing_timeout=_timeout()))


def answers_match(pred: str, gold: Any) -> bool:
    """math-verify equivalence of a predicted and a reference answer; exact text when either won't parse."""
    from math_verify import parse, verify

    gold_text = str(gold).strip()
    if _WORDS.fullmatch(gold_text):  # sympy would read "cab" as c*a*b == "abc": compare words as text
        return " ".join(pred.lower().split()) == " ".join(gold_text.lower().split())
    parsed_gold = _parse_gold(gold_text)
    parsed_pred = parse(_latex(pred), parsing_timeout=_timeout())
    if parsed_gold and parsed_pred:
        return bool(verify(list(parsed_gold), parsed_pred, timeout_seconds=_timeout()))
    return " ".join(pred.split()) == " ".join(gold_text.split())


def math_verify_score(pred: str, task: Task) -> float:
    return 1.0 if answers_match(pred, task.answer) else 0.0


def reasoning_gym_tasks(options: MathOptions) -> tuple[list[Task], Scorer]:
    """Generate `size` tasks of one reasoning-gym dataset; score with the dataset's own scorer."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"env.options.source: reasoning_gym needs the reasoning-gym package; {EXTRA}") from None
    if not options.dataset:
        raise ValueError("env.options.dataset: required with source=reasoning_gym (e.g. chain_sum)")
    try:
        data = reasoning_gym.create_dataset(options.dataset, size=options.size, seed=options.data_seed,
                                            **options.dataset_config)
    except ValueError as exc:
        if "not registered" in str(exc):
            raise ValueError(f"env.options.dataset: unknown reasoning-gym dataset {options.dataset!r}") from None
        raise ValueError(f"env.options.dataset_config: {exc}") from None
    except (TypeError, AssertionError) as exc:  # unknown keyword, or the dataset's own config checks
        raise ValueError(f"env.options.dataset_config: {exc}") from None
    tasks = [Task(id=f"{options.dataset}-{i}", prompt=entry["question"], answer=entry["answer"],
                  meta={"entry": entry}) for i, entry in enumerate(data)]

    def score(pred: str, task: Task) -> float:
        return float(data.score_answer(answer=pred, entry=task.meta["entry"]))

    return tasks, score


def reasoning_gym_split(options: MathOptions) -> tuple[TaskSplit, Scorer]:
    tasks, score = reasoning_gym_tasks(options)
    train, heldout = hash_split(tasks, options.heldout_fraction, options.data_seed)
    if not train or not heldout:
        raise ValueError(f"env.options.size: {options.size} tasks leave an empty split at "
                         f"heldout_fraction={options.heldout_fraction}; raise size")
    return TaskSplit(train, heldout), score


class MathEpisode:
    def __init__(self, score: Scorer, options: MathOptions) -> None:
        self.score, self.options = score, options
        self.task: Task | None = None
        self.attempts = 0

    def reset(self, task: Task) -> list[Message]:
        self.task, self.attempts = task, 0
        system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
        return [*system, {"role": "user", "content": task.prompt}]

    def step(self, action: str) -> StepResult:
        self.attempts += 1
        pred = extract_answer(action)
        reward = self.score(pred, self.task) if pred is not None else 0.0
        correct = reward >= 1.0
        if correct or self.attempts >= self.options.max_attempts:
            info = {"correct": float(correct), "answered": float(pred is not None), "attempts": self.attempts}
            return StepResult("", reward, True, info)
        if pred is None:
            return StepResult("No final answer found: end your reply with \\boxed{...} or <answer>...</answer>.")
        return StepResult("Incorrect. Try again.")


class MathEnvironment:
    """Registered as `math`. Tasks from a file or reasoning-gym; held-out tasks never train."""

    Options = MathOptions

    def __init__(self, options: MathOptions, seed: int = 0):
        self.options, self.seed = options, seed
        if options.source == "reasoning_gym":
            self.split, self.score = reasoning_gym_split(options)
        else:
            if options.dataset:
                raise ValueError("env.options.dataset: only used with source=reasoning_gym")
            self.split, self.score = load_task_split(options), math_verify_score

    def train_tasks(self) -> Iterator[Task]:
        return self.split.train_stream(self.seed)

    def eval_tasks(self, n: int) -> list[Task]:
        return self.split.eval_tasks(n)

    def new_episode(self, ctx: EpisodeContext) -> MathEpisode:
        return MathEpisode(self.score, self.options)

    def demo(self, task: Task, rng: random.Random) -> list[Message]:
        """A solved single-turn episode for SFT: the reference answer in the demo format."""
        answer = f"<answer>{task.answer}</answer>" if self.options.demo_format == "answer" else f"\\boxed{{{task.answer}}}"
        return [*MathEpisode(self.score, self.options).reset(task), {"role": "assistant", "content": answer}]


register_environment("math", MathEnvironment)
