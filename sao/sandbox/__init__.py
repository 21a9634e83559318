"""Run model-written code against tests, and judge it where that code cannot reach.

    from sao.sandbox import get_sandbox
    verdict = get_sandbox().run("def add(a, b):\\n    return a + b", ["assert add(1, 2) == 3"])
    verdict.status, verdict.passed, verdict.total, verdict.tests[0]   # "passed", 1, 1, TestResult(...)

Threat model. A policy optimizes whatever the reward measures, so the code under test is an
adversary that may read and write any memory of its own process (frames, the garbage collector,
ctypes, its own C extension), call any syscall the kernel lets it, and print anything. The verdict
must not depend on anything it can reach. Hence:

- The judge lives in the host process, outside the sandbox's namespaces. Nothing secret enters the
  sandbox: of a test, only its calls of the entry point with literal arguments (`f(1)`) go in; the
  sandbox returns `repr(value)` over a capped pipe, and the host parses it as data and runs every
  comparison, boolean operator and tolerance check itself (sao/sandbox/judge.py, hosteval.py).
  Records are structured JSON lines, each only the code's claim about its own values, read totally
  (sao/sandbox/verdict.py); the first per call counts, and a forged one can only claim a value,
  which passes only if it is the expected one. Tests of other forms are judged inside and marked
  `judge="sandbox"`; the code environment does not reward them by default.
- Per-test results are data (`Verdict.tests`); program output is kept for people and never parsed
  for a verdict or an observation (sao/envs/code_env.py builds `<run_tests>` from `Verdict.tests`).
- Host resources are capped from outside: memory per run, disk (only capped pipes and a
  size-limited tmpfs; no host file to `fallocate`), processes, CPU and wall time; a run over one
  gets its reason (sao/sandbox/namespace.py lists the layers).
- Without root it uses unprivileged user namespaces; where nothing can contain a run, it refuses
  with `SandboxUnavailable`, one line naming what is missing. It never runs code unconfined.

Not covered: a kernel exploit, and CPU caches/timing side channels. Backends implement the
`Sandbox` protocol (`run(code, tests, limits) -> Verdict`, and `run_async`); `namespace` is the one
here, a container or remote service can stand in. Standard library only (tests/test_import_boundaries.py).
"""

from __future__ import annotations

from sao.sandbox.namespace import MECHANISM_ENV, MECHANISMS, NamespaceSandbox, available_mechanism, mode, probe
from sao.sandbox.protocol import DEFAULT_LIMITS, STATUSES, Limits, Sandbox, SandboxUnavailable, TestResult, Verdict, one_line

__all__ = ["DEFAULT_LIMITS", "MECHANISMS", "MECHANISM_ENV", "STATUSES", "Limits", "NamespaceSandbox", "Sandbox",
           "SandboxUnavailable", "TestResult", "Verdict", "available_mechanism", "get_sandbox", "mode", "one_line",
           "probe"]


def get_sandbox(mechanism: str | None = None, *, guard: bool = True) -> Sandbox:
    """The default backend (namespaces on this machine). It probes lazily: the first run raises
    `SandboxUnavailable` if nothing here can contain code."""
    return NamespaceSandbox(mechanism, guard=guard)
