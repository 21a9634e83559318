"""Run model-written Python code against test snippets in a sandbox (docs/architecture.md §2: `sao/envs/`).

    result = run_tests("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3"])
    result.status, result.passed, result.total        # "passed", 1, 1

Each test snippet counts separately; callers compute partial credit as `passed / total`. Statuses:
passed, failed (a test or the solution raised, or it does not compile), timeout (wall clock or CPU),
memory, crashed (the program died before reporting every test, e.g. `os._exit`, a signal, the file-size
limit, or the caller's `setup` failed) and forbidden (the guard below caught a forbidden action).

Containment, outermost first; tests/test_sandbox.py checks each layer on its own:

1. Namespaces: `bwrap` (bubblewrap) when installed, else util-linux `unshare` plus a root built here
   (`_h_enter_root`). New PID, network, mount, IPC and UTS namespaces: no interface reaches the host
   network, and when the run ends the kernel kills every process left in it. The file tree holds only
   /usr, the base Python installation (read-only; not the venv, so no project package is importable), a
   few /dev nodes and `/sandbox`: a private tmpfs of `4 * max_file_mb`, the working directory (`/tmp`
   points to it). Nothing the code writes touches the host disk.
2. A per-run unprivileged uid. Sessions and CI run as root and RLIMIT_NPROC does not bind root, so
   without it a fork bomb takes the machine; a uid of its own also keeps concurrent runs from sharing a
   process budget or signalling each other.
3. rlimits (CPU, address space, processes+threads, file size, open files, no core) and `nice` 10. The
   parent kills the run at the wall-clock limit. If the parent dies, a bwrap run dies with it and an
   unshare run within `wall_s + 5` s (its pid 1 keeps an alarm).
4. An in-process guard (a PEP 578 audit hook, irremovable): process creation, network sockets and
   ctypes are forbidden (recorded, so a caught exception does not hide them); stack frames, gc heap
   walks and tracing are unavailable, because they are how code would reach the harness's state (so
   `traceback.print_exc()` and `inspect.stack()` raise in the sandbox).

Verdicts cannot be printed or faked by the code under test. The harness reads a random nonce from
stdin and closes it before any untrusted code runs; the code runs in a worker thread (which cannot
install signal handlers, and whose frames it cannot reach); the main thread writes each step's
outcome and a final record, prefixed by the nonce, to a descriptor the parent reads, from a C-level
iterator chain that no Python frame holds. A missing record is not a pass: `sys.exit(0)` fails the
test and `os._exit(0)` crashes the run.

Not a proof: CPython does not isolate code within one process, so layer 4 raises the bar rather than
closing every path (code that writes and imports its own C extension is beyond it); layers 1-3 do not
rely on it. And `assert f(x) == y` passes when `f` returns an object whose `__eq__` is always true;
tests should compare types too where that matters.
"""

from __future__ import annotations

import asyncio
import binascii
import functools
import inspect
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from dataclasses import dataclass

from sao.envs import sandbox_harness

MECHANISMS = ("bwrap", "unshare")  # in order of preference
MECHANISM_ENV = "SAO_SANDBOX_MECHANISM"  # forces one of MECHANISMS
UID_BASE, UID_SPAN = 1_500_000_000, 100_000_000  # each run gets its own uid from this range
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_OUTPUT_CHARS = 4000  # of program output kept in SandboxResult.output (head and tail)
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 5.0  # RLIMIT_CPU (rounded up to whole seconds); SIGXCPU, then SIGKILL 1 s later
    wall_s: float = 10.0  # wall-clock kill, from process start
    memory_mb: int = 512  # RLIMIT_AS of each process
    max_procs: int = 32  # RLIMIT_NPROC of the run's uid: processes and threads, harness included
    max_file_mb: int = 16  # RLIMIT_FSIZE; the working directory holds 4x this
    network: bool = False  # True shares the host network and allows sockets


DEFAULT_LIMITS = SandboxLimits()


@dataclass
class SandboxResult:
    status: str  # "passed" | "failed" | "timeout" | "memory" | "crashed" | "forbidden"
    reason: str  # one line, human readable
    passed: int = 0  # number of tests that passed
    failed: int = 0
    total: int = 0
    output: str = ""  # program output (truncated) then one block per failed step: an observation
    mechanism: str = ""  # what contained the run, e.g. "bwrap+uid+rlimits+guard"
    duration_s: float = 0.0


class SandboxUnavailable(RuntimeError):
    """No mechanism can contain a run here; the sandbox refuses rather than run code unconfined."""


def run_tests(solution: str, tests: list[str] | str, limits: SandboxLimits = DEFAULT_LIMITS, setup: str = "",
              *, mechanism: str | None = None, guard: bool = True) -> SandboxResult:
    """Run `setup`, then `solution`, then each test snippet in a copy of its namespace.

    `setup` is the caller's trusted preamble (e.g. imports) run in the same sandbox; if it fails the
    run is `crashed`. `mechanism` forces "bwrap" or "unshare" (default: $SAO_SANDBOX_MECHANISM, else
    the best that works). `guard=False` drops layer 4 and exists to test the OS layers on their own.
    """
    return _Run(solution, tests, limits, setup, _choose(mechanism), guard).execute()


async def run_tests_async(solution: str, tests: list[str] | str, limits: SandboxLimits = DEFAULT_LIMITS,
                          setup: str = "", *, mechanism: str | None = None, guard: bool = True) -> SandboxResult:
    """`run_tests` on asyncio subprocesses, so many episodes can run concurrently."""
    chosen = await asyncio.to_thread(_choose, mechanism)  # the first call probes (blocking)
    return await _Run(solution, tests, limits, setup, chosen, guard).execute_async()


def available_mechanism() -> str:
    """The mechanism `run_tests` uses by default: "bwrap", "unshare", or "none" (it would refuse)."""
    return next((m for m in MECHANISMS if mechanism_works(m)), "none")


@functools.cache
def mechanism_works(name: str) -> bool:
    """Probed once per process with a real run: being installed is not enough (e.g. no permission)."""
    if name not in MECHANISMS or os.geteuid() != 0 or shutil.which(name) is None:
        return False  # root is needed to switch the run to its own uid
    try:
        return _Run("x = 1", ["assert x == 1"], SandboxLimits(wall_s=30), "", name, True).execute().status == "passed"
    except OSError:
        return False


def _choose(mechanism: str | None) -> str:
    name = mechanism or os.environ.get(MECHANISM_ENV) or available_mechanism()
    if name == "none" or not mechanism_works(name):
        raise SandboxUnavailable(
            f"sandbox mechanism {name!r} does not work here (euid {os.geteuid()}; tried {', '.join(MECHANISMS)}): "
            "run as root with bubblewrap (apt-get install bubblewrap) or util-linux unshare; "
            "refusing to run model code unconfined")
    return name


@functools.cache
def _host_paths() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...], str]:
    """(read-only binds, (link, target) symlinks, interpreter) that make up the sandbox's file tree."""
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    ro, links = ["/usr"], []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append((top, os.readlink(top)))  # merged /usr: /lib -> usr/lib
        elif os.path.isdir(top):
            ro.append(top)
    libdir = sysconfig.get_config_var("LIBDIR") or sys.base_prefix
    for path in map(os.path.realpath, (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(exe)), libdir)):
        if not any(path == r or path.startswith(r + "/") for r in ro):
            ro.append(path)
    if os.path.exists("/etc/ld.so.cache"):
        ro.append("/etc/ld.so.cache")  # lets the loader find libraries in multiarch dirs
    links.append(("/tmp", "/sandbox"))
    return tuple(ro), tuple(links), exe


def _bwrap_argv(ro, links, disk_mb: int, network: bool) -> list[str]:
    # No user namespace: as root, bwrap then keeps only the two capabilities the harness needs to
    # switch to the run's uid (with a user namespace that uid would still be root on the host).
    argv = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] + ([] if network else ["--unshare-net"])
    inside = list(ro) + [link for link, _ in links] + list(_DEVICES) + ["/sandbox"]
    for d in sorted(p for p in _ancestors(map(os.path.dirname, inside)) if not any(p == r or p.startswith(r + "/") for r in ro)):
        argv += ["--perms", "0755", "--dir", d]  # bwrap would make them 0700: the uid could not reach Python
    for path in ro:
        argv += ["--ro-bind", path, path]
    for link, target in links:
        argv += ["--symlink", target, link]
    for dev in _DEVICES:
        argv += ["--dev-bind", dev, dev]
    return argv + ["--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", "/sandbox", "--chdir", "/sandbox"]


def _ancestors(paths) -> set[str]:
    out = set()
    for p in paths:
        while p not in ("/", ""):
            out.add(p)
            p = os.path.dirname(p)
    return out


def _unshare_argv(network: bool) -> list[str]:
    # --kill-child: if unshare dies, pid 1 of the namespace (and so everything in it) dies too.
    return ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--ipc", "--uts"] + (
        [] if network else ["--net"])


class _Run:
    """One sandboxed execution: temporary files, command line and job, turned into a SandboxResult."""

    def __init__(self, solution: str, tests, limits: SandboxLimits, setup: str, mechanism: str, guard: bool):
        self.tests = [tests] if isinstance(tests, str) else list(tests)
        self.limits, self.mechanism, self.guard = limits, mechanism, guard
        self.nonce = secrets.token_hex(16)
        self.dir = tempfile.mkdtemp(prefix="sao-sandbox-")
        self.out = open(os.path.join(self.dir, "output"), "wb")  # noqa: SIM115 - closed in _cleanup
        self.results_fd = os.open(os.path.join(self.dir, "results"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        ro, links, exe = _host_paths()
        disk_mb = 4 * limits.max_file_mb
        steps = [["setup", setup], ["solution", solution]] + [[f"test{i + 1}", t] for i, t in enumerate(self.tests)]
        job = {"nonce": self.nonce, "steps": steps, "uid": UID_BASE + secrets.randbelow(UID_SPAN), "guard": guard,
               "network": limits.network, "limits": vars(limits), "root": os.path.join(self.dir, "root"),
               "ro": ro, "links": links, "devices": _DEVICES, "disk_mb": disk_mb}
        self.payload = json.dumps(job).encode()
        if mechanism == "bwrap":
            prefix = _bwrap_argv(ro, links, disk_mb, limits.network)
        else:
            os.mkdir(job["root"])  # the mount point of the fresh root, inside the private mount namespace
            prefix = _unshare_argv(limits.network)
        self.argv = prefix + [exe, "-I", "-S", "-B", "-u", "-c", _harness_source(), mechanism, str(self.results_fd)]

    def _popen_kwargs(self) -> dict:
        return dict(stdin=subprocess.PIPE, stdout=self.out, stderr=subprocess.STDOUT, pass_fds=(self.results_fd,),
                    start_new_session=True, env=_ENV, cwd="/")

    def execute(self) -> SandboxResult:
        start, timed_out = time.monotonic(), False
        try:
            proc = subprocess.Popen(self.argv, **self._popen_kwargs())
            try:
                proc.communicate(self.payload, timeout=self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                proc.kill()  # a no-op once it has exited; killing the leader tears the namespaces down
                proc.wait()
                proc.stdin.close()
            return self._result(proc.returncode, timed_out, time.monotonic() - start)
        finally:
            self._cleanup()

    async def execute_async(self) -> SandboxResult:
        start, timed_out = time.monotonic(), False
        try:
            proc = await asyncio.create_subprocess_exec(*self.argv, **self._popen_kwargs())
            try:
                await asyncio.wait_for(self._feed(proc), self.limits.wall_s)
            except asyncio.TimeoutError:
                timed_out = True
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
            return self._result(proc.returncode, timed_out, time.monotonic() - start)
        finally:
            self._cleanup()

    async def _feed(self, proc) -> None:
        try:
            proc.stdin.write(self.payload)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died before reading its job; the missing records say so
        await proc.wait()

    def _cleanup(self) -> None:
        self.out.close()
        os.close(self.results_fd)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _records(self) -> tuple[dict[str, tuple[str, str]], list[str], bool]:
        """Per-step (kind, message), forbidden actions, and whether the final record arrived."""
        steps, forbidden, done = {}, [], False
        with open(os.path.join(self.dir, "results"), "rb") as f:
            lines = f.read().split(b"\n")
        for line in lines:
            parts = line.split(b" ")
            if len(parts) != 4 or parts[0] != self.nonce.encode():
                continue  # not written by the harness
            step, kind = parts[1].decode(errors="replace"), parts[2].decode(errors="replace")
            try:
                message = binascii.a2b_base64(parts[3]).decode("utf-8", "replace")
            except binascii.Error:
                continue
            if kind == "forbidden":
                forbidden.append(message)
            elif step == "run":
                done = done or kind == "done"
            else:
                steps.setdefault(step, (kind, message))
        return steps, forbidden, done

    def _result(self, returncode: int, timed_out: bool, duration: float) -> SandboxResult:
        steps, forbidden, done = self._records()
        output = _read_output(os.path.join(self.dir, "output"))
        passed = sum(steps.get(f"test{i + 1}", ("", ""))[0] == "ok" for i in range(len(self.tests)))
        status, reason = _classify(self, steps, forbidden, done, returncode, timed_out, output)
        failures = [f"--- {_title(step)} failed{_snippet(step, self.tests)}\n{message}"
                    for step, (kind, message) in steps.items() if kind != "ok" and not message.startswith("not run:")]
        mechanism = f"{self.mechanism}+uid+rlimits" + ("+guard" if self.guard else "")
        return SandboxResult(status, reason, passed, len(self.tests) - passed, len(self.tests),
                             "\n".join([output.rstrip("\n")] + failures).strip("\n"), mechanism, round(duration, 3))


def _classify(run: _Run, steps, forbidden, done, returncode, timed_out, output) -> tuple[str, str]:
    lim, total = run.limits, len(run.tests)
    sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    expected = ["setup", "solution"] + [f"test{i + 1}" for i in range(total)]
    missing = next((s for s in expected if s not in steps), None)
    bad = [(s, steps[s]) for s in expected if s in steps and steps[s][0] != "ok"]
    if forbidden:
        return "forbidden", f"forbidden: {forbidden[0]}"
    if timed_out:
        return "timeout", f"wall-clock limit of {lim.wall_s:g} s exceeded" + _during(missing)
    if sig == signal.SIGXCPU:
        return "timeout", f"CPU time limit of {lim.cpu_s:g} s exceeded" + _during(missing)
    memory = next((s for s, (kind, _) in bad if kind == "memory"), None)
    if memory or (missing and "MemoryError" in output):
        return "memory", f"memory limit of {lim.memory_mb} MB exceeded" + _during(memory or missing)
    if sig == signal.SIGXFSZ:
        return "crashed", f"file size limit of {lim.max_file_mb} MB exceeded (SIGXFSZ)" + _during(missing)
    if steps.get("setup", ("ok",))[0] != "ok":
        return "crashed", f"the setup code failed: {one_line(steps['setup'][1])}"
    if missing or not done:
        how = f"was killed by {signal.Signals(sig).name}" if sig in set(signal.Signals) else f"exited with code {returncode}"
        hint = "" if missing is None or returncode else " (sys.exit/os._exit do not pass tests)"
        first = output.strip().splitlines()[:1] if steps.get("setup") is None else []
        return "crashed", f"the program {how} before reporting {_title(missing or 'its end')}{hint}" + (
            f": {one_line(first[0])}" if first else "")
    if steps["solution"][0] != "ok":
        return "failed", f"the solution failed: {one_line(steps['solution'][1])}"
    if not bad:
        return "passed", f"all {total} tests passed"
    step, (_, message) = bad[0]
    return "failed", f"{len(bad)} of {total} tests failed; first: {_title(step)}: {one_line(message)}"


def _title(step: str) -> str:
    return f"test {step[4:]}" if step.startswith("test") else step


def _during(step: str | None) -> str:
    return f" (during {_title(step)})" if step else ""


def _snippet(step: str, tests: list[str]) -> str:
    return f": {one_line(tests[int(step[4:]) - 1], 200)}" if step.startswith("test") else ""


def one_line(text: str, limit: int = 300) -> str:
    """Whitespace collapsed to single spaces, cut to `limit` characters with "..."."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_output(path: str) -> str:
    size, half = os.path.getsize(path), _OUTPUT_CHARS // 2
    with open(path, "rb") as f:
        if size <= _OUTPUT_CHARS:
            data = f.read()
        else:  # the start says what went wrong first, the end where it stopped
            head = f.read(half)
            f.seek(size - half)
            data = head + f"\n[... {size - 2 * half} bytes cut ...]\n".encode() + f.read()
    return data.decode("utf-8", "replace")


@functools.cache
def _harness_source() -> str:
    """The program run inside the sandbox: the `_h_` functions of `sandbox_harness`, shipped as source."""
    h = sandbox_harness
    funcs = (h._h_main, h._h_enter_root, h._h_confine, h._h_guard, h._h_serve, h._h_start_worker, h._h_worker,
             h._h_describe)
    prelude = "__builtins__ = dict(vars(__builtins__))  # the harness's own: patching `builtins` cannot reach it\n"
    return prelude + "\n".join(textwrap.dedent(inspect.getsource(f)) for f in funcs) + "\n_h_main()\n"
