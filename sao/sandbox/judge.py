"""The host-side judge: which part of a test the sandbox may see, and everything it may not.

A test is *host-judged* when the host can run all of it but the sandbox calls
(sao/sandbox/hosteval.py): `assert f(1) == 3 and f(2) == 7`, `assert math.isclose(f(x), y)`,
`assert abs(f(x) - y) < 1e-9`, `assert not f(x) != y`, `x = f(1); assert x in (1, 2)`, loops over
host values, and HumanEval's `def check(candidate): assert candidate(...) == ...`. Only the calls
(`f(1)`, with literal arguments) go into the sandbox, which returns `repr(value)`; the host parses
that as data and runs every comparison, boolean operator and tolerance check itself, with its own
objects and functions, against expected values that never entered the sandbox. The code under
test can make a call return anything, but it passes only by returning what the test asks for.

Anything else (a call whose argument is another call's result, a `try`, a helper the test defines,
an attribute of a returned object) is *sandbox-judged*: it runs whole inside and its outcome is the
code's own word (`TestResult.judge == "sandbox"`, `Check.reason` says why). The `code` environment
does not pay reward for those by default (sao/envs/code_env.py, `sandbox_judged`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sao.sandbox import hosteval
from sao.sandbox.hosteval import MAX_VALUE_CHARS, CallError, NotHostJudged, Program

__all__ = ["MAX_VALUE_CHARS", "Check", "judge", "plan"]


@dataclass(frozen=True)
class Check:
    """How one test is judged. `calls` (host-judged) or `source` (sandbox-judged) enters the sandbox."""

    source: str
    program: Program | None = None  # None: sandbox-judged
    calls: tuple[str, ...] = ()  # the sandbox evaluations, one per call the test makes, in order (literal arguments)
    reason: str = ""  # why the test is sandbox-judged

    @property
    def host_judged(self) -> bool:
        return self.program is not None


def plan(test: str, entry: str | None = None) -> Check:
    """The Check for one test snippet. `entry`: the task's entry point (the only name the sandbox
    may supply); None lets any name the host does not know be a sandbox call (generated tasks' `f`)."""
    try:
        program = hosteval.program_of(test, entry)
        calls = hosteval.collect(program)
    except NotHostJudged as e:
        return Check(test, reason=str(e))
    except hosteval.TestFailed as e:
        return Check(test, reason=f"the host cannot plan it: {e}")
    except Exception as e:  # noqa: BLE001 - a form the planner does not expect is judged inside, and says so
        return Check(test, reason=f"the host cannot plan it ({type(e).__name__})")
    return Check(test, program, tuple(calls))


def judge(check: Check, results: list[tuple[str, str]]) -> tuple[bool, str, str | None]:
    """(passed, error, got) for a host-judged check, from the sandbox's (kind, text) of each evaluation in
    `check.calls`, in order.

    kind "value": text is the call's repr; anything else: the call failed with text as its message."""
    values = []
    for k in range(len(check.calls)):
        kind, text = results[k] if k < len(results) else ("missing", "was not run")
        if kind == "value":
            values.append(hosteval.parse_value(text))
        else:
            raised = kind in ("fail", "memory") and not text.startswith("not run")
            values.append(CallError(f"raised {text}" if raised else text))
    return hosteval.run(check.program, list(check.calls), values)
