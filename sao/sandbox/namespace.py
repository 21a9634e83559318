"""The namespace backend: Linux namespaces + seccomp + rlimits, via bubblewrap or util-linux unshare.

Two modes, chosen by who we are. As root: no user namespace; the harness switches to a uid of its
own per run (RLIMIT_NPROC then binds, and runs cannot signal each other). As anyone else: an
unprivileged user namespace (`unshare --user --map-root-user`, or `bwrap --unshare-user`), in
which the harness builds the file tree and then gives up every capability. Where neither works,
`SandboxUnavailable` names what is missing; nothing runs unconfined. Layers, outermost first:

1. PID, mount, IPC, UTS and (unless `network`) network namespaces: when the run ends the kernel
   kills every process left in it. The file tree holds /usr, the base Python (read-only; not the
   venv), a few /dev nodes and `/sandbox`, a tmpfs of `4 * max_file_mb` (`/tmp` points there).
   Nothing in the sandbox can write a host file: program output and results are pipes the host
   reads with caps, so there is nothing for `fallocate` to grow.
2. No privilege (the run's uid, or no capabilities), no_new_privs, and a seccomp filter
   (sao/sandbox/harness.py `_h_seccomp`): no memfd, SysV shared memory, new namespaces, mounts,
   ptrace. So every byte the run holds is in memory RLIMIT_AS counts, or in the capped tmpfs.
3. Limits: a cgroup per run (v2 memory.max + pids.max, or v1 memory.limit_in_bytes + pids.max)
   when this process may create one (root); always RLIMIT_AS/CPU/NPROC/FSIZE/NOFILE and a host-side watch that sums the
   resident memory (shared pages included) of every process of the run and kills it over
   `memory_mb`; the wall clock, by the host. Each exceeded limit is the verdict's reason.
4. An audit hook (`guard`) that turns process creation, sockets and ctypes into a clear
   `forbidden` status; a convenience for the policy's learning signal, not a wall.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import secrets
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time

from sao.sandbox import harness, hosteval, judge
from sao.sandbox.hostlimits import cgroup_for, cgroup_oom, remove_cgroups, tree_rss_kib
from sao.sandbox.protocol import DEFAULT_LIMITS, Limits, SandboxUnavailable, Verdict, one_line
from sao.sandbox.verdict import RESULTS_CAP, build_verdict, parse_records

MECHANISMS = ("bwrap", "unshare")  # in order of preference
MECHANISM_ENV = "SAO_SANDBOX_MECHANISM"  # forces one of MECHANISMS
UID_BASE, UID_SPAN = 1_500_000_000, 100_000_000  # root mode: each run gets its own uid from this range
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8"}
_WATCH_S = 0.05  # how often the host sums the run's resident memory


def mode() -> str:
    """"root" (a uid per run) or "user" (an unprivileged user namespace)."""
    return "root" if os.geteuid() == 0 else "user"


class NamespaceSandbox:
    """`Sandbox` on this machine's kernel. `mechanism`: "bwrap" | "unshare" | None (the best that
    works; $SAO_SANDBOX_MECHANISM overrides). `guard=False` drops layer 4, to test the others alone."""

    def __init__(self, mechanism: str | None = None, guard: bool = True):
        self.requested, self.guard = mechanism, guard
        self.name = "namespace"

    def run(self, code: str, tests: list[str] | str, limits: Limits = DEFAULT_LIMITS, *, setup: str = "",
            entry: str | None = None) -> Verdict:
        return _sync(self.run_async(code, tests, limits, setup=setup, entry=entry))

    async def run_async(self, code: str, tests: list[str] | str, limits: Limits = DEFAULT_LIMITS, *,
                        setup: str = "", entry: str | None = None) -> Verdict:
        mechanism = await asyncio.to_thread(choose, self.requested)  # the first call probes (blocking)
        # planning runs the host's interpreter over each test (its collect pass): off the event loop too
        run = await asyncio.to_thread(_Run, code, tests, limits, setup, mechanism, self.guard, entry)
        return await run.execute()


    async def evaluate_async(self, code: str, exprs: list[str], limits: Limits = DEFAULT_LIMITS, *,
                             setup: str = "", links: tuple[tuple[str, str], ...] = ()
                             ) -> tuple[Verdict, list[tuple[str, str]]]:
        """The Verdict of a run that evaluates `exprs` after `code`, and each one's (kind, text): ("value",
        repr) or ("fail", message). Nothing here is judged: for a task's reference solution
        (sao/sandbox/derive.py) and for programs whose output the caller reads as data (sao/sandbox/shell.py).
        `links`: (path, target) symlinks added to the file tree, e.g. ("/app", "/sandbox/app")."""
        mechanism = await asyncio.to_thread(choose, self.requested)
        checks = [judge.Check(expr, hosteval.Program((), (), None), (expr,)) for expr in exprs]
        run = _Run(code, checks, limits, setup, mechanism, self.guard, links=links)
        verdict = await run.execute()
        steps = parse_records(getattr(run, "records", ""))[0]
        return verdict, [steps.get(f"test{i + 1}.1", ("missing", "was not run")) for i in range(len(exprs))]

    def evaluate(self, code: str, exprs: list[str], limits: Limits = DEFAULT_LIMITS, *,
                 setup: str = "") -> tuple[Verdict, list[tuple[str, str]]]:
        return _sync(self.evaluate_async(code, exprs, limits, setup=setup))


def _sync(coro):
    """Run a coroutine to its end from sync code, also when called from inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: list = []  # called from inside an event loop: run on a thread of its own
    thread = threading.Thread(target=lambda: out.append(asyncio.run(coro)))
    thread.start()
    thread.join()
    return out[0]


def available_mechanism() -> str:
    """The mechanism used by default: "bwrap", "unshare", or "none" (runs would be refused)."""
    return next((m for m in MECHANISMS if mechanism_works(m)), "none")


def mechanism_works(name: str) -> bool:
    return probe(name) == ""


@functools.cache
def probe(name: str) -> str:
    """"" when `name` contains a real run here, else why not (one line). Probed once per process."""
    if name not in MECHANISMS:
        return f"unknown mechanism {name!r}"
    if shutil.which(name) is None:
        return "not installed" + (" (apt-get install bubblewrap)" if name == "bwrap" else " (util-linux)")
    try:
        verdict = asyncio.run(_Run("x = 1", ["assert x == 1"], Limits(wall_s=30), "", name, True).execute())
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if verdict.status == "passed":
        return ""
    first = verdict.output.strip().splitlines()[-1:] or [verdict.reason]
    return one_line(first[0], 200)


def choose(mechanism: str | None) -> str:
    name = mechanism or os.environ.get(MECHANISM_ENV)
    names = [name] if name else list(MECHANISMS)
    why = {n: probe(n) for n in names}
    usable = [n for n in names if not why[n]]
    if usable:
        return usable[0]
    raise SandboxUnavailable(
        f"sandbox: nothing can contain a run here ({mode()} mode, euid {os.geteuid()}): "
        + "; ".join(f"{n}: {w}" for n, w in why.items())
        + (" (unprivileged user namespaces may be disabled: sysctl kernel.unprivileged_userns_clone, "
           "user.max_user_namespaces)" if mode() == "user" else "")
        + "; refusing to run model code unconfined")


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
    for path in map(os.path.realpath, (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(exe)),
                                       libdir)):
        if not any(path == r or path.startswith(r + "/") for r in ro):
            ro.append(path)
    if os.path.exists("/etc/ld.so.cache"):
        ro.append("/etc/ld.so.cache")  # lets the loader find libraries in multiarch dirs
    links.append(("/tmp", "/sandbox"))
    return tuple(ro), tuple(links), exe


def _bwrap_argv(ro, links, disk_mb: int, network: bool) -> list[str]:
    if mode() == "root":  # no user namespace: bwrap keeps only what the harness needs to switch uid
        argv = ["bwrap", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # bwrap drops every capability of the sandboxed process itself
        argv = ["bwrap", "--unshare-user"]
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session"]
    argv += [] if network else ["--unshare-net"]
    inside = list(ro) + [link for link, _ in links] + list(_DEVICES) + ["/sandbox"]
    for d in sorted(p for p in _ancestors(map(os.path.dirname, inside))
                    if not any(p == r or p.startswith(r + "/") for r in ro)):
        argv += ["--perms", "0755", "--dir", d]  # bwrap would make them 0700: the uid could not reach Python
    for path in ro:
        argv += ["--ro-bind", path, path]
    for link, target in links:
        argv += ["--symlink", target, link]
    for dev in _DEVICES:
        argv += ["--dev-bind", dev, dev]
    # The root is bwrap's own tmpfs, with no size cap: read-only once built, so only /sandbox takes writes.
    return argv + ["--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", "/sandbox", "--remount-ro", "/",
                   "--chdir", "/sandbox"]


def _ancestors(paths) -> set[str]:
    out = set()
    for p in paths:
        while p not in ("/", ""):
            out.add(p)
            p = os.path.dirname(p)
    return out


def _unshare_argv(network: bool) -> list[str]:
    # --kill-child: if unshare dies, pid 1 of the namespace (and so everything in it) dies too.
    user = [] if mode() == "root" else ["--user", "--map-root-user"]
    return ["unshare", *user, "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--ipc",
            "--uts"] + ([] if network else ["--net"])


class _Run:
    """One sandboxed execution: job, command line, capped pipes, the watch; then the Verdict."""

    def __init__(self, code: str, tests, limits: Limits, setup: str, mechanism: str, guard: bool,
                 entry: str | None = None, links: tuple[tuple[str, str], ...] = ()):
        tests = [tests] if isinstance(tests, (str, judge.Check)) else list(tests)
        self.checks = [t if isinstance(t, judge.Check) else judge.plan(t, entry) for t in tests]
        self.limits, self.mechanism, self.guard = limits, mechanism, guard
        self.uid = UID_BASE + secrets.randbelow(UID_SPAN)
        self.dir = tempfile.mkdtemp(prefix="sao-sandbox-")  # stays empty: only a mount point, inside
        ro, host_links, exe = _host_paths()
        links = host_links + tuple(links)
        disk_mb = 4 * limits.max_file_mb
        steps = [["setup", "exec", setup], ["solution", "exec", code]]
        for i, c in enumerate(self.checks):  # a host-judged test sends only its calls: expected values stay here
            steps += ([[f"test{i + 1}.{j + 1}", "value", call] for j, call in enumerate(c.calls)] if c.host_judged
                      else [[f"test{i + 1}", "exec", c.source]])
        self.step_names = [name for name, _, _ in steps]
        self.cgroups = cgroup_for(limits)  # joined by a shell that then becomes the mechanism: all of it is inside
        job = {"steps": steps, "uid": self.uid, "guard": guard, "network": limits.network, "limits": vars(limits),
               "root": self.dir, "ro": ro, "links": links, "devices": _DEVICES, "disk_mb": disk_mb,
               "cgroup": bool(self.cgroups)}
        self.payload = json.dumps(job).encode()
        prefix = _bwrap_argv(ro, links, disk_mb, limits.network) if mechanism == "bwrap" else _unshare_argv(limits.network)
        joins = "".join(f"echo $$ > {d}/cgroup.procs; " for d in self.cgroups)
        join = ["sh", "-c", joins + 'exec "$@"', "sh"] if self.cgroups else []
        self.layers = "+".join([mechanism, "uid" if mode() == "root" else "userns", "seccomp", "rlimits"]
                               + (["cgroup"] if self.cgroups else []) + (["guard"] if guard else []))
        self.argv = join + prefix + [exe, "-I", "-S", "-B", "-u", "-c", _harness_source(), mechanism, mode()]

    async def execute(self) -> Verdict:
        start = time.monotonic()
        read_fd, write_fd = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, str(write_fd), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True, env=_ENV, cwd="/")
        except BaseException:
            os.close(read_fd)
            self._cleanup()
            raise
        finally:
            os.close(write_fd)
        try:
            return await self._supervise(proc, read_fd, start)
        finally:
            if proc.returncode is None:
                _kill(proc)
                await proc.wait()
            if self.cgroups:  # removing a cgroup may wait for the kernel: not on the event loop
                await asyncio.to_thread(self._cleanup)
            else:
                self._cleanup()

    async def _supervise(self, proc, read_fd: int, start: float) -> Verdict:
        loop = asyncio.get_running_loop()
        results = asyncio.StreamReader(limit=RESULTS_CAP)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(results),
                                                    os.fdopen(read_fd, "rb", 0))
        output, records, events = _Output(self.limits.max_output_kb << 10), bytearray(), set()

        async def read_results():
            while chunk := await results.read(1 << 16):
                records.extend(chunk)
                if len(records) > RESULTS_CAP:
                    events.add("results")
                    _kill(proc)
                    return

        async def read_output():
            while chunk := await proc.stdout.read(1 << 16):
                output.add(chunk)

        readers = [asyncio.ensure_future(read_results()), asyncio.ensure_future(read_output())]
        watch = asyncio.ensure_future(self._watch(proc, events))
        try:
            proc.stdin.write(self.payload)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died before reading its job; the missing records say so
        try:
            await asyncio.wait_for(proc.wait(), self.limits.wall_s)
        except asyncio.TimeoutError:
            # A busy event loop (an engine step on it, a stopped process) can see the exit and the timer
            # together, and wait_for then raises after the exit was handled: a run that ended is not killed.
            if proc.returncode is None:
                events.add("wall")
                _kill(proc)
            await proc.wait()
        watch.cancel()
        await asyncio.wait(readers, timeout=2)  # the namespace is gone, so the pipes close
        for task in readers:
            task.cancel()
        transport.close()
        if cgroup_oom(self.cgroups):
            events.add("memory")
        self.records = records.decode("utf-8", "replace")
        # judging runs the host's interpreter over what the run returned: on a thread, never on the event loop
        return await asyncio.to_thread(build_verdict, self, self.records, output.text(), proc.returncode, events,
                                       time.monotonic() - start)

    async def _watch(self, proc, events: set) -> None:
        """Sum the resident memory (shared pages included) of every process of the run; kill it over the limit."""
        cap = self.limits.memory_mb << 10  # KiB, as /proc reports
        while proc.returncode is None:
            if tree_rss_kib(proc.pid) > cap or cgroup_oom(self.cgroups):
                events.add("memory")
                _kill(proc)
                return
            await asyncio.sleep(_WATCH_S)

    def _cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        remove_cgroups(self.cgroups)


def _kill(proc) -> None:
    """SIGKILL the run, if it is still there: asyncio raises ProcessLookupError once it has handled the exit."""
    try:
        proc.kill()
    except ProcessLookupError:
        pass


class _Output:
    """Program output, capped: the first half of the cap and the last half, the middle dropped unread."""

    def __init__(self, cap: int):
        self.half, self.head, self.tail, self.dropped = cap // 2, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        self.head.extend(chunk[:room])
        self.tail.extend(chunk[room:] if room > 0 else chunk)
        if len(self.tail) > self.half:
            self.dropped += len(self.tail) - self.half
            del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        cut = f"\n[... {self.dropped} bytes cut ...]\n".encode() if self.dropped else b""
        return bytes(self.head + cut + self.tail).decode("utf-8", "replace")


@functools.cache
def _harness_source() -> str:
    """The program run inside the sandbox: the `_h_` functions of `sao.sandbox.harness`, shipped as source."""
    h = harness
    funcs = (h._h_main, h._h_enter_root, h._h_confine, h._h_seccomp, h._h_guard, h._h_run, h._h_steps, h._h_describe)
    return "\n".join(textwrap.dedent(inspect.getsource(f)) for f in funcs) + "\n_h_main()\n"
