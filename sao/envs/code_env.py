"""`code`: write or fix a small Python function, checked by hidden unit tests in the sandbox.

Owns the code tasks (a seeded template generator, or a JSONL file), the action format, the test
observations and the reward. An episode, within the agent loop's turn limit:

    user:       Write a Python function f(x) that returns x plus 3.
    assistant:  <run_tests>```python\\ndef f(x):\\n    return x + 4\\n```       (optional, any number)
    tool:       0/4 passed\\nFAIL assert f(1) == 4 (got 5)
    assistant:  <submit>```python\\ndef f(x):\\n    return x + 3\\n```       (ends the episode)

`<submit>` without a code block submits the code last sent to `<run_tests>` (a short action: the
tiny model's episodes hold ~256 tokens). Reward is 1 when every hidden test passes, else 0, or
passed/total with `partial_credit`. A submission that times out, runs out of memory or does
something forbidden scores 0 and says so in numeric `info` metrics (`sandbox_timeout`, ...). A
malformed action gets a helpful observation, never a crash. Code runs only in `sao.envs.sandbox`,
through `run_tests_async`, so many episodes test code concurrently.

Generated levels (`min_level`..`max_level`): 1 one-line functions (x + c, max(a, b, c), s * c, len),
2 fix-the-bug (the prompt shows the code with a wrong constant or operator), 3 small
conditionals and comprehensions. The held-out split is fixed by a hash of the prompt, as in `calc`.
"""

from __future__ import annotations

import ast
import asyncio
import random
import re
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from sao.envs.base import EpisodeContext, Message, StepResult, register_environment
from sao.envs.dataset import TaskSplit, check_split, hash_split, option_error, read_rows
from sao.envs.latency import LatencyOptions, with_latency
from sao.envs.sandbox import SandboxLimits, SandboxResult, one_line, run_tests_async
from sao.envs.splits import SplitOptions, distinct_tasks, is_heldout, split_side
from sao.types import Task

RUN, SUBMIT = "<run_tests>", "<submit>"
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.S)
_FAILURE = re.compile(r"^--- (test (\d+)|solution|setup) failed[^\n]*\n(.*?)(?=\n--- |\Z)", re.S | re.M)
FORMAT_HINT = f"error: write {RUN} or {SUBMIT}, then the code in a ```python block"

# Templates: (arguments, statement, body). `{c}` is a drawn constant; every template has one, so
# every template has many prompts and the hash split holds out a few of each.
LEVEL1 = [
    ("x", "f(x) that returns x plus {c}", "return x + {c}"),
    ("x", "f(x) that returns x minus {c}", "return x - {c}"),
    ("x", "f(x) that returns x times {c}", "return x * {c}"),
    ("a, b", "f(a, b) that returns the largest of a, b and {c}", "return max(a, b, {c})"),
    ("a, b", "f(a, b) that returns the smallest of a, b and {c}", "return min(a, b, {c})"),
    ("s", "f(s) that returns s repeated {c} times", "return s * {c}"),
    ("xs", "f(xs) that returns the length of xs plus {c}", "return len(xs) + {c}"),
]
LEVEL3 = [
    ("n", "f(n) that returns {c} + ... + n", "return sum(range({c}, n + 1))"),
    ("xs", "f(xs) that returns the sum of the items of xs above {c}", "return sum(x for x in xs if x > {c})"),
    ("xs", "f(xs) that counts the items of xs equal to {c}", "return xs.count({c})"),
    ("xs", "f(xs) that returns each item of xs times {c}", "return [x * {c} for x in xs]"),
    ("x", "f(x) that returns 'big' if x > {c}, else 'small'", "return 'big' if x > {c} else 'small'"),
    ("s", "f(s) that returns the first {c} letters of s", "return s[:{c}]"),
]
# Level 2 bugs: operator swaps; a template without a swap gets an off-by-one constant instead.
_SWAPS = [(" + ", " - "), (" - ", " + "), (" * ", " + "), ("max(", "min("), ("min(", "max("), (" > ", " < ")]


class CodeOptions(SplitOptions, LatencyOptions):
    min_level: int = Field(1, ge=1, le=3, description="generator: easiest level (1 one-liners, 2 fix the bug, 3 "
                                                      "conditionals and comprehensions)")
    max_level: int = Field(3, ge=1, le=3, description="generator: hardest level")
    max_constant: int = Field(9, ge=2, le=99, description="generator: constants in statements are drawn from 1..this")
    num_tests: int = Field(4, ge=1, le=8, description="generator: hidden asserts per task")
    partial_credit: bool = Field(False, description="reward passed/total instead of 1 only when all tests pass")
    max_failures_shown: int = Field(1, ge=1, description="failing tests listed in a run_tests observation")
    observation_chars: int = Field(160, ge=40, description="a run_tests observation is cut to this many characters")
    demo_run_tests_rate: float = Field(0.3, ge=0, le=1, description="SFT demos: share that run the tests (then "
                                                                     "submit) instead of submitting at once")
    timeout_s: float = Field(3.0, gt=0, description="sandbox wall-clock limit per run (CPU limit: the same)")
    memory_mb: int = Field(256, ge=32, description="sandbox address-space limit per process")
    max_parallel: int = Field(8, ge=1, description="sandbox runs in flight at once per process (each is a process)")
    path: str | None = Field(None, description="tasks from this JSONL file instead of the generator")
    prompt_field: str = Field("prompt", min_length=1, description="JSONL: problem statement (falls back to "
                                                                  "'statement' when the default is missing)")
    tests_field: str = Field("tests", min_length=1, description="JSONL: hidden tests, a list of asserts or one string")
    starter_field: str = Field("starter", min_length=1, description="JSONL: optional starter code shown in the prompt")
    solution_field: str = Field("solution", min_length=1, description="JSONL: optional reference solution (for demos)")
    id_field: str | None = Field("id", description="JSONL: optional task id (default: file stem and row number)")
    eval_seed_offset: int = Field(1_000_003, description="generator: held-out tasks are drawn with data_seed + this "
                                                         "offset")

    @model_validator(mode="after")
    def _ranges(self) -> CodeOptions:
        if self.min_level > self.max_level:
            raise ValueError("min_level must be <= max_level")
        return self


# ---------------------------------------------------------------- task generation


def _inputs(args: str, c: int, rng: random.Random, n: int) -> list[tuple]:
    """n distinct argument tuples that tell a correct function from the usual wrong ones."""
    draw = {
        "x": lambda: (rng.randint(-5, 15),),
        "n": lambda: (rng.randint(c, c + 9),),
        "a, b": lambda: (rng.randint(c - 6, c + 6), rng.randint(c - 6, c + 6)),
        "s": lambda: ("".join(rng.choice("abcxyz") for _ in range(rng.randint(1, c + 3))),),
        "xs": lambda: ([rng.choice([c, c + 1, c - 1, rng.randint(0, c + 3)]) for _ in range(rng.randint(1, 5))],),
    }[args]
    seen: list[tuple] = []
    for _ in range(100 * n):
        value = draw()
        if value not in seen:
            seen.append(value)
        if len(seen) == n:
            break
    return seen


def _call(code: str, inputs: list[tuple]) -> list[Any]:
    """Our own template code, run in-process to compute expected values (never model code)."""
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # noqa: S102 - trusted generator templates only
    return [namespace["f"](*args) for args in inputs]


def _buggy(body: str, c: int, rng: random.Random) -> str:
    swaps = [(a, b) for a, b in _SWAPS if a in body]
    if swaps and (rng.random() < 0.5 or "{c}" not in body):
        a, b = rng.choice(swaps)
        return body.replace(a, b, 1)
    return body.replace("{c}", str(c + rng.choice([-1, 1]) if c > 1 else c + 1))


def _bug_for(args: str, body: str, c: int, inputs: list[tuple], expected: list, rng: random.Random) -> str:
    """Buggy code that still runs on every input but gets at least one expected value wrong."""
    buggy = f"def f({args}):\n    {body.format(c=c + 1)}"
    for _ in range(20):
        candidate = f"def f({args}):\n    {_buggy(body, c, rng).format(c=c)}"
        try:
            if _call(candidate, inputs) != expected:
                return candidate
        except Exception:  # e.g. `s + 3`: a crash is a different lesson than a wrong value
            continue
    return buggy


def generate_task(rng: random.Random, options: CodeOptions) -> Task:
    """One task: prompt, hidden tests (asserts with concrete values) and the reference solution."""
    level = rng.randint(options.min_level, options.max_level)
    args, statement, body = rng.choice(LEVEL3 if level == 3 else LEVEL1 if level == 1 else LEVEL1 + LEVEL3)
    c = rng.randint(1, options.max_constant)
    reference = f"def f({args}):\n    {body.format(c=c)}"
    inputs = _inputs(args, c, rng, options.num_tests)
    expected = _call(reference, inputs)
    prompt = f"Write a Python function {statement.format(c=c)}."
    if level == 2:
        buggy = _bug_for(args, body, c, inputs, expected, rng)
        prompt = f"Fix f so it {statement.format(c=c).split(' that ', 1)[1]}:\n```python\n{buggy}\n```"
    tests = [f"assert f({', '.join(map(repr, a))}) == {e!r}" for a, e in zip(inputs, expected)]
    return Task(id="", prompt=prompt, answer=tests, meta={"reference": reference, "level": level})


# ---------------------------------------------------------------- actions and observations


def parse_action(action: str) -> tuple[str | None, str | None]:
    """(kind, code): kind is "run" or "submit" (the first tag), code the first fenced block after it."""
    positions = {k: action.find(tag) for k, tag in (("run", RUN), ("submit", SUBMIT)) if tag in action}
    if not positions:
        return None, None
    kind = min(positions, key=positions.get)
    block = _FENCE.search(action, positions[kind])
    return kind, block.group(1).strip("\n") if block else None


def with_got(test: str) -> str:
    """`assert f(1) == 4` -> `assert f(1) == 4, 'got ' + repr(f(1))`, so a failure shows the value."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return test
    node = tree.body[0] if len(tree.body) == 1 else None
    if not (isinstance(node, ast.Assert) and node.msg is None and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
        return test
    got = ast.Call(ast.Name("repr", ast.Load()), [node.test.left], [])
    node.msg = ast.BinOp(ast.Constant("got "), ast.Add(), got)
    return ast.unparse(tree)


def describe(result: SandboxResult, tests: list[str], options: CodeOptions) -> str:
    """A short, readable observation of one sandbox run: the count, then the first failures."""
    if result.status not in ("passed", "failed"):
        return one_line(f"{result.status}: {result.reason}", options.observation_chars)
    failures = {m.group(1): (m.group(2), m.group(3).strip()) for m in _FAILURE.finditer(result.output)}
    if "solution" in failures:  # it did not compile or raised on load: no test ran
        return one_line(f"error: {failures['solution'][1]}", options.observation_chars)
    lines = [f"{result.passed}/{result.total} passed"]
    for number, message in list(failures.values())[: options.max_failures_shown]:
        if number is None:
            continue
        detail = message.removeprefix("AssertionError: ") if message.startswith("AssertionError: got ") else message
        lines.append(f"FAIL {one_line(tests[int(number) - 1], 60)} ({one_line(detail, 50)})")
    return "\n".join(lines)[: options.observation_chars]


def passed_observation(n: int) -> str:
    """What `describe` says when all n tests pass (the demos use it without running the sandbox)."""
    return f"{n}/{n} passed"


# ---------------------------------------------------------------- episodes


class CodeEpisode:
    def __init__(self, environment: CodeEnvironment) -> None:
        self.environment = environment
        self.options = environment.options
        self.tests: list[str] = []
        self.wrapped: list[str] = []
        self.last_code: str | None = None
        self.counts = {"run_tests_calls": 0, "format_errors": 0}

    def reset(self, task: Task) -> list[Message]:
        self.tests = list(task.answer)
        self.wrapped = [with_got(t) for t in self.tests]  # run_tests variants that report the value got
        return [{"role": "user", "content": task.prompt}]

    async def step(self, action: str) -> StepResult:
        kind, code = parse_action(action)
        code = code if code is not None else (self.last_code if kind == "submit" else None)
        if kind is None or not code:
            self.counts["format_errors"] += 1
            tag = RUN if kind == "run" else SUBMIT
            hint = FORMAT_HINT if kind is None else f"error: no code; put it in a ```python block after {tag}"
            return StepResult(hint, info=dict(self.counts))
        self.last_code = code
        if kind == "run":
            self.counts["run_tests_calls"] += 1
            result = await self.environment.sandbox(code, self.wrapped)
            return StepResult(describe(result, self.tests, self.options), info=dict(self.counts))
        return self._final(await self.environment.sandbox(code, self.tests))

    def _final(self, result: SandboxResult) -> StepResult:
        graded = result.status in ("passed", "failed")  # timeout/memory/forbidden/crashed score 0
        solved = result.status == "passed"
        frac = result.passed / result.total if graded and result.total else 0.0
        reward = frac if self.options.partial_credit else float(solved)
        info = {**self.counts, "solved": float(solved), "pass_frac": frac, "tests_passed": result.passed,
                "tests_total": result.total, "sandbox_s": result.duration_s}
        for status in ("timeout", "memory", "forbidden", "crashed"):
            info[f"sandbox_{status}"] = float(result.status == status)
        info["syntax_error"] = float(result.status == "failed" and "SyntaxError" in result.reason)
        return StepResult("", reward, True, info)


# ---------------------------------------------------------------- the environment


def _row_field(row: dict, name: str, where: str, required: bool) -> Any:
    value = row.get(name)
    if required and (value is None or (isinstance(value, str) and not value.strip())):
        raise option_error("path", f"{where}: field {name!r} missing or empty (fields: {', '.join(sorted(map(str, row)))})")
    return value


def load_code_tasks(options: CodeOptions) -> list[Task]:
    """Tasks of a JSONL file: statement (+ starter code), tests, optional solution and id."""
    rows = read_rows(options.path, "jsonl", "path")
    if not rows:
        raise option_error("path", f"{options.path!r} has no rows")
    tasks = []
    for i, row in enumerate(rows):
        where = f"{options.path!r} row {i + 1}"
        prompt_field = options.prompt_field
        if prompt_field == "prompt" and "prompt" not in row and "statement" in row:
            prompt_field = "statement"
        prompt = _row_field(row, prompt_field, where, True)
        tests = _row_field(row, options.tests_field, where, True)
        tests = [tests] if isinstance(tests, str) else tests
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise option_error("path", f"{where}: field {options.tests_field!r} must be a test string or a list of them")
        starter = _row_field(row, options.starter_field, where, False)
        if starter:
            prompt = f"{prompt}\n```python\n{str(starter).strip()}\n```"
        task_id = row.get(options.id_field) if options.id_field else None
        tasks.append(Task(id=str(task_id) if task_id is not None else f"{Path(options.path).stem}-{i}",
                          prompt=str(prompt), answer=tests,
                          meta={"reference": _row_field(row, options.solution_field, where, False), "row": i}))
    return tasks


class CodeEnvironment:
    """Registered as `code`. Generated tasks (seeded, hash split) or a JSONL file of tasks."""

    Options = CodeOptions
    # Settings that suit this environment (longer actions, lighter SFT, lr, whitening) are a recipe:
    # examples/configs/code.yaml, passed as the config file.

    def __init__(self, options: CodeOptions, seed: int = 0):
        self.options = options
        self.seed = seed
        self._latency_rng = random.Random(seed)  # env.options.step_latency_s (sao/envs/latency.py)
        self.limits = SandboxLimits(cpu_s=options.timeout_s, wall_s=options.timeout_s, memory_mb=options.memory_mb)
        self._gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one semaphore per event loop
        self.file: TaskSplit | None = None  # tasks of a JSONL file, split by data_seed
        if options.path is not None:
            self.file = TaskSplit(*hash_split(load_code_tasks(options), options.heldout_fraction, options.data_seed))
            check_split(self.file.train, self.file.heldout, "hash", options)

    async def sandbox(self, code: str, tests: list[str]) -> SandboxResult:
        """Run code against tests; at most `max_parallel` sandboxes at once on this event loop."""
        loop = asyncio.get_running_loop()
        if loop not in self._gates:
            self._gates[loop] = asyncio.Semaphore(self.options.max_parallel)
        gate = self._gates[loop]
        async with gate:
            return await run_tests_async(code, tests, self.limits)

    def is_heldout(self, prompt: str) -> bool:
        """A fixed split by `data_seed` (not train.seed): `heldout_fraction` of prompts, whatever inputs are drawn."""
        return is_heldout(prompt, self.options.heldout_fraction, self.options.data_seed)

    def _stream(self, seed: int, split: str, heldout: bool) -> Iterator[Task]:
        rng = random.Random(seed)
        return split_side(lambda: generate_task(rng, self.options), heldout, self.is_heldout, f"code-{split}")

    def eval_tasks(self, n: int) -> list[Task]:
        """n held-out tasks, the same for every train.seed. The generator has a few hundred distinct
        prompts, so its held-out ones (30 at the defaults) repeat in turn, as a file's do."""
        if self.file is not None:
            return self.file.eval_tasks(n)
        return distinct_tasks(self._stream(self.options.data_seed + self.options.eval_seed_offset, "eval", True), n)

    def train_tasks(self) -> Iterator[Task]:
        """Endless seeded stream of tasks outside the held-out split."""
        if self.file is not None:
            return self.file.train_stream(self.seed)
        return self._stream(self.seed, "train", heldout=False)

    def new_episode(self, ctx: EpisodeContext) -> CodeEpisode:
        return with_latency(CodeEpisode(self), self.options, self._latency_rng)  # on top of the sandbox's own

    def demo(self, task: Task, rng: random.Random) -> list[Message]:
        """A solved episode for SFT: submit the reference, or run the tests on it first, then submit."""
        reference = task.meta.get("reference")
        if not reference:
            raise option_error("solution_field", f"task {task.id!r} has no reference solution for the SFT demos; "
                                                 "add one or give model.path")
        block = f"```python\n{reference}\n```"
        messages: list[Message] = [{"role": "user", "content": task.prompt}]
        if rng.random() < self.options.demo_run_tests_rate:
            messages.append({"role": "assistant", "content": f"{RUN}{block}"})
            messages.append({"role": "tool", "content": passed_observation(len(task.answer))})
            messages.append({"role": "assistant", "content": SUBMIT})
        else:
            messages.append({"role": "assistant", "content": f"{SUBMIT}{block}"})
        return messages


register_environment("code", CodeEnvironment)
