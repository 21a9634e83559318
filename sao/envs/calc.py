"""`calc`: multi-step arithmetic with a calculator tool, the built-in task.

The model reads an expression such as `37*12+5` and either answers at once (`<answer>449</answer>`)
or calls the calculator any number of times (`<calc>37*12</calc>` -> `<result>444</result>`) before
answering, within the agent loop's turn limit. Reward is 1 for a correct final answer, else 0. A
malformed tool call gets an error observation, never a crash.

Why RL has room to improve: the SFT demonstrations (`demo`) answer *directly* on most hard problems
(a tiny model cannot multiply two-digit numbers in its head) and use the tool only at
`demo_tool_rate_hard`. The SFT policy therefore under-uses the tool where it matters, and RL can
learn to call it.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Iterator
from typing import Literal

from pydantic import Field, model_validator

from sao.envs.base import EpisodeContext, Message, StepResult, register_environment
from sao.envs.latency import LatencyOptions, with_latency
from sao.envs.splits import SplitOptions, distinct_tasks, is_heldout, split_side
from sao.types import Task

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_ABS = 10**12
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_INTEGER = re.compile(r"-?\d+")


class CalcError(ValueError):
    pass


def evaluate(expr: str) -> int:
    """Integer arithmetic with + - * and parentheses only; anything else is a CalcError."""
    if len(expr) > 64:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise CalcError("syntax error") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            v = _OPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(v) > _MAX_ABS:
                raise CalcError("number too large")
            return v
        raise CalcError("unsupported expression")

    return ev(tree)


class CalcOptions(SplitOptions, LatencyOptions):
    min_digits: int = Field(1, ge=1, le=6, description="fewest digits of an operand")
    max_digits: int = Field(2, ge=1, le=6, description="most digits of an operand")
    min_ops: int = Field(1, ge=1, le=6, description="fewest operations in a problem")
    max_ops: int = Field(2, ge=1, le=6, description="most operations in a problem")
    ops: str = Field("+-*", pattern=r"^[+\-*]+$", description="operators to draw from")
    demo_tool_rate_easy: float = Field(0.2, ge=0, le=1, description="SFT demos: tool use on easy problems")
    demo_tool_rate_hard: float = Field(0.3, ge=0, le=1, description="SFT demos: tool use on hard problems")
    demo_calls: Literal["whole", "stepwise"] = Field(
        "whole", description="SFT demos call the tool once on the whole expression, or once per operation")
    eval_seed_offset: int = Field(1_000_003, description="held-out tasks are drawn with data_seed + this offset")
    system_prompt: str = Field("", description=(
        "a system message before each problem (empty: none); a pretrained chat model needs the tool and "
        "answer format explained (examples/configs/smollm2_calc.yaml)"))
    accept_untagged: bool = Field(False, description=(
        "a reply with neither <answer> nor <calc> ends the episode and is judged by its last integer "
        "(\"The answer is 9.\"): a small pretrained chat model rarely uses tags at first"))

    @model_validator(mode="after")
    def _ranges(self) -> CalcOptions:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must be <= max_digits")
        if self.min_ops > self.max_ops:
            raise ValueError("min_ops must be <= max_ops")
        return self


def is_easy(operands: list[int]) -> bool:
    """One operation on one-digit numbers: solvable without the tool."""
    return len(operands) == 2 and all(abs(x) < 10 for x in operands)


def stepwise_calls(operands: list[int], ops: list[str]) -> list[tuple[str, int]]:
    """The calculator calls a careful solver makes: one operation at a time, `*` first."""
    nums, ops = list(operands), list(ops)
    calls = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        expr = f"{nums[i]}{ops[i]}{nums[i + 1]}"
        value = evaluate(expr)
        calls.append((expr, value))
        nums[i : i + 2] = [value]
        del ops[i]
    return calls


def with_system(system_prompt: str, messages: list[Message]) -> list[Message]:
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages


class CalcEpisode:
    def __init__(self, system_prompt: str = "", accept_untagged: bool = False) -> None:
        self.system_prompt, self.accept_untagged = system_prompt, accept_untagged
        self.answer: int | None = None
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, task: Task) -> list[Message]:
        self.answer = int(task.answer)
        return with_system(self.system_prompt, [{"role": "user", "content": task.prompt}])

    def step(self, action: str) -> StepResult:
        answer = _ANSWER.search(action)
        if answer:
            try:
                correct = int(answer.group(1).strip()) == self.answer
            except ValueError:
                correct = False
            info = {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "correct": float(correct)}
            return StepResult("", 1.0 if correct else 0.0, True, info)
        call = _CALL.search(action)
        numbers = _INTEGER.findall(action)
        if call is None and self.accept_untagged and numbers:
            correct = int(numbers[-1]) == self.answer
            info = {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "correct": float(correct)}
            return StepResult("", 1.0 if correct else 0.0, True, info)
        self.tool_calls += 1
        if call is None:
            self.tool_errors += 1
            return StepResult("<result>error: call <calc>...</calc> or give <answer>...</answer></result>")
        try:
            return StepResult(f"<result>{evaluate(call.group(1))}</result>")
        except CalcError as exc:
            self.tool_errors += 1
            return StepResult(f"<result>error: {exc}</result>")


class CalcEnvironment:
    """Registered as `calc`. Tasks are drawn from a seeded generator; held-out ones never train."""

    Options = CalcOptions

    def __init__(self, options: CalcOptions, seed: int = 0):
        self.options = options
        self.seed = seed
        self._latency_rng = random.Random(seed)  # env.options.step_latency_s (sao/envs/latency.py)

    def is_heldout(self, prompt: str) -> bool:
        """A fixed split by `data_seed` (not train.seed): `heldout_fraction` of problems, whatever is drawn."""
        return is_heldout(prompt, self.options.heldout_fraction, self.options.data_seed)

    def _problem(self, rng: random.Random) -> tuple[list[int], list[str]]:
        o = self.options
        n_ops = rng.randint(o.min_ops, o.max_ops)
        operands = []
        for _ in range(n_ops + 1):
            d = rng.randint(o.min_digits, o.max_digits)
            operands.append(rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1))
        return operands, [rng.choice(o.ops) for _ in range(n_ops)]

    def _task(self, rng: random.Random) -> Task:
        operands, ops = self._problem(rng)
        text = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:]))
        meta = {"operands": operands, "ops": ops, "easy": is_easy(operands)}
        return Task(id="", prompt=text, answer=evaluate(text), meta=meta)  # split_side numbers it

    def _stream(self, seed: int, split: str, heldout: bool) -> Iterator[Task]:
        rng = random.Random(seed)
        return split_side(lambda: self._task(rng), heldout, self.is_heldout, f"calc-{split}")

    def eval_tasks(self, n: int) -> list[Task]:
        """The first n distinct held-out problems drawn with `data_seed`: the same for every train.seed."""
        return distinct_tasks(self._stream(self.options.data_seed + self.options.eval_seed_offset, "eval", True), n)

    def train_tasks(self) -> Iterator[Task]:
        """Endless seeded stream of problems outside the held-out split."""
        return self._stream(self.seed, "train", heldout=False)

    def new_episode(self, ctx: EpisodeContext) -> CalcEpisode:
        episode = CalcEpisode(self.options.system_prompt, self.options.accept_untagged)
        return with_latency(episode, self.options, self._latency_rng)

    def demo(self, task: Task, rng: random.Random) -> list[Message]:
        """A solved episode for SFT: direct answer, or stepwise tool calls then the answer."""
        o = self.options
        rate = o.demo_tool_rate_easy if task.meta["easy"] else o.demo_tool_rate_hard
        messages = with_system(o.system_prompt, [{"role": "user", "content": task.prompt}])
        if rng.random() < rate:
            calls = (stepwise_calls(task.meta["operands"], task.meta["ops"]) if o.demo_calls == "stepwise"
                     else [(task.prompt, task.answer)])
            for expr, value in calls:
                messages.append({"role": "assistant", "content": f"<calc>{expr}</calc>"})
                messages.append({"role": "tool", "content": f"<result>{value}</result>"})
        messages.append({"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
        return messages


register_environment("calc", CalcEnvironment)
