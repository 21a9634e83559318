"""What every sandbox backend speaks: `run(code, tests, limits) -> Verdict` (see `sao/sandbox/__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

STATUSES = ("passed", "failed", "timeout", "memory", "crashed", "forbidden")


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 5.0  # RLIMIT_CPU (rounded up to whole seconds); SIGXCPU, then SIGKILL 1 s later
    wall_s: float = 10.0  # wall-clock kill by the host, from process start
    memory_mb: int = 512  # the whole run: cgroup memory.max, else RLIMIT_AS per process and the host's watch of all
    max_procs: int = 32  # processes and threads of the run, harness included
    max_file_mb: int = 16  # RLIMIT_FSIZE; the sandbox's only writable directory is a tmpfs of 4x this
    max_output_kb: int = 256  # program output (stdout+stderr) kept; more is read and dropped, never stored
    network: bool = False  # True shares the host network and allows sockets


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class TestResult:
    """One test's outcome. `judge` says who decided it:

    "host": the sandbox returned plain values of the test's calls and the host ran every comparison
    against expected values that never entered the sandbox; "sandbox": the test is not of a form
    the host can judge (see `sao/sandbox/judge.py`), so its own asserts ran in the sandbox and their
    outcome is only as trustworthy as the code under test.
    """

    index: int  # 1-based, in the order the tests were given
    passed: bool
    judge: str  # "host" | "sandbox"
    got: str | None = None  # repr of the last value the sandbox returned (host-judged tests), cut to 200 characters
    error: str = ""  # one line: why it failed ("" when it passed); host-judged: the calls and what they
    # returned, never the expected value


@dataclass
class Verdict:
    status: str  # one of STATUSES
    reason: str  # one line, human readable
    tests: tuple[TestResult, ...] = ()
    output: str = ""  # program output, head and tail; informational only, no verdict is read from it
    mechanism: str = ""  # what contained the run, e.g. "unshare+userns+seccomp+rlimits+guard"
    duration_s: float = 0.0
    solution_error: str = ""  # one line when the setup or the solution did not load
    limits: dict = field(default_factory=dict)

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def failed(self) -> int:
        return self.total - self.passed


class SandboxUnavailable(RuntimeError):
    """No mechanism can contain a run here; the sandbox refuses rather than run code unconfined."""


@runtime_checkable
class Sandbox(Protocol):
    """A place that runs untrusted code against tests. Backends: `namespace` (this package); a
    container or remote service fits the same two methods."""

    name: str

    def run(self, code: str, tests: list[str] | str, limits: Limits = DEFAULT_LIMITS, *, setup: str = "",
            entry: str | None = None) -> Verdict:
        """`tests`: snippets or `judge.Check`s; `entry`: the task's entry point (see `judge.plan`)."""
        ...

    async def run_async(self, code: str, tests: list[str] | str, limits: Limits = DEFAULT_LIMITS, *,
                        setup: str = "", entry: str | None = None) -> Verdict:
        ...


def one_line(text: str, limit: int = 300) -> str:
    """Whitespace collapsed to single spaces, cut to `limit` characters with "..."."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
