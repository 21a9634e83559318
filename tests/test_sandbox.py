"""sao.envs.sandbox: normal runs, then escape attempts, each contained with the right status.

Every test that runs code is parametrized over the mechanisms that work here (bwrap, and the unshare
fallback that a fresh CI machine uses); afterwards each test checks that no process of its runs is left.
Tests with `guard=False` check the OS layers alone, without the in-process audit hook.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from textwrap import dedent

import pytest

from sao.envs import sandbox
from sao.envs.sandbox import MECHANISMS, SandboxLimits, SandboxUnavailable, run_tests, run_tests_async

PROJECT = Path(__file__).resolve().parents[1]
WORKING = [m for m in MECHANISMS if sandbox.mechanism_works(m)]
FAST = SandboxLimits(cpu_s=1, wall_s=4, memory_mb=256, max_procs=8, max_file_mb=4)
ADD = "def add(a, b):\n    return a + b\n"
mechanisms = pytest.mark.parametrize("mech", WORKING)


def _processes_of(uids: set[int]) -> list[int]:
    """Pids whose real uid is in `uids` (read from status: /proc entries of non-dumpable processes belong to root)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            uid_line = next(x for x in Path(f"/proc/{entry}/status").read_text().splitlines() if x.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) in uids:
            pids.append(int(entry))
    return pids


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch):
    """After each test, no process of its runs' uids is left and their temporary directories are gone.

    Only this test's runs count: other sandboxes may run on the machine at the same time.
    """
    uids, dirs, init = set(), [], sandbox._Run.__init__

    def recording_init(run, *args, **kwargs):
        init(run, *args, **kwargs)
        uids.add(json.loads(run.payload)["uid"])
        dirs.append(run.dir)

    monkeypatch.setattr(sandbox._Run, "__init__", recording_init)
    yield
    deadline = time.monotonic() + 5  # the kernel tears a PID namespace down asynchronously
    while _processes_of(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_of(uids) == [], "a sandboxed process outlived its run"
    assert not [d for d in dirs if os.path.exists(d)], "a run left its temporary directory"


def test_a_mechanism_works_as_root_and_none_refuses(monkeypatch):
    if os.geteuid() == 0:
        assert sandbox.available_mechanism() in MECHANISMS, "neither bwrap nor unshare can contain a run here"
    monkeypatch.setattr(sandbox, "mechanism_works", lambda name: False)
    assert sandbox.available_mechanism() == "none"
    with pytest.raises(SandboxUnavailable, match="refusing to run model code unconfined"):
        run_tests(ADD, ["assert add(1, 2) == 3"])
    with pytest.raises(SandboxUnavailable):
        run_tests(ADD, ["assert add(1, 2) == 3"], mechanism="docker")


@pytest.mark.skipif(not WORKING, reason="no mechanism works here (see the test above)")
def test_the_environment_variable_forces_a_mechanism(monkeypatch):
    monkeypatch.setenv(sandbox.MECHANISM_ENV, WORKING[-1])
    assert run_tests(ADD, "assert add(1, 2) == 3", FAST).mechanism.startswith(WORKING[-1] + "+uid+rlimits")


# --- normal cases ---------------------------------------------------------------------------------

@mechanisms
def test_a_correct_solution_passes(mech):
    r = run_tests(ADD + "print('hello')", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"],
                  FAST, mechanism=mech)
    assert (r.status, r.passed, r.failed, r.total) == ("passed", 3, 0, 3), r
    assert r.output == "hello" and r.mechanism == f"{mech}+uid+rlimits+guard" and r.duration_s < 3


@mechanisms
def test_a_wrong_solution_fails_with_the_assertion_message(mech):
    r = run_tests(ADD, ["assert add(1, 2) == 3", "assert add(2, 2) == 5, 'add(2, 2) should be 5'"], FAST, mechanism=mech)
    assert (r.status, r.passed, r.failed, r.total) == ("failed", 1, 1, 2)
    assert "AssertionError: add(2, 2) should be 5" in r.output and "test 2" in r.reason


@mechanisms
def test_a_syntax_error_fails_with_a_clear_reason(mech):
    r = run_tests("def add(a, b)\n    return a + b", ["assert add(1, 2) == 3"], FAST, mechanism=mech)
    assert (r.status, r.passed, r.total) == ("failed", 0, 1)
    assert "the solution failed: SyntaxError" in r.reason and "line 1" in r.reason
    bad_test = run_tests(ADD, ["assert add(1, 2) == 3", "assert add(1,"], FAST, mechanism=mech)
    assert (bad_test.status, bad_test.passed) == ("failed", 1) and "SyntaxError" in bad_test.reason


@mechanisms
def test_setup_runs_first_and_its_failure_is_a_crash(mech):
    assert run_tests("def f(x):\n    return sqrt(x)", "assert f(4) == 2", FAST, setup="from math import sqrt",
                     mechanism=mech).status == "passed"
    r = run_tests(ADD, "assert add(1, 2) == 3", FAST, setup="import no_such_module", mechanism=mech)
    assert r.status == "crashed" and "setup code failed: ModuleNotFoundError" in r.reason


@mechanisms
def test_code_runs_on_the_base_python_without_project_packages(mech):
    sol = "import sys\nprefix = sys.prefix\ntry:\n    import sao\nexcept ImportError:\n    sao = None\n"
    r = run_tests(sol, [f"assert prefix == {os.path.realpath(sys.base_prefix)!r}", "assert sao is None"], FAST, mechanism=mech)
    assert r.status == "passed", r


@mechanisms
def test_common_stdlib_works_under_the_guard(mech):
    sol = dedent("""
        from collections import namedtuple
        import asyncio, enum, logging, threading, typing
        P = namedtuple('P', 'x y')
        T = typing.TypeVar('T')
        Color = enum.Enum('Color', 'red green')
        logging.getLogger().warning('logged')
        async def triple(x):
            return 3 * x
        out = []
        threads = [threading.Thread(target=out.append, args=(i,)) for i in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        open('scratch.txt', 'w').write('ok')
        def depth(n):
            return 0 if n == 0 else 1 + depth(n - 1)
        """)
    tests = ["assert P(1, 2).y == 2", "assert asyncio.run(triple(2)) == 6", "assert sorted(out) == [0, 1, 2]",
             "assert open('/tmp/scratch.txt').read() == 'ok'",  # /tmp is the sandbox's own directory
             "import sys\nsys.setrecursionlimit(30000)\nassert depth(20000) == 20000"]
    r = run_tests(sol, tests, FAST, mechanism=mech)
    assert r.status == "passed", r
    assert "logged" in r.output


# --- escape attempts: resources -------------------------------------------------------------------

@mechanisms
def test_an_infinite_loop_hits_the_cpu_limit(mech):
    r = run_tests("while True:\n    pass", ["assert True"], FAST, mechanism=mech)
    assert r.status == "timeout" and "CPU time limit of 1 s" in r.reason, r


@mechanisms
def test_a_hang_hits_the_wall_clock_and_keeps_earlier_credit(mech):
    limits = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, max_procs=8, max_file_mb=4)
    r = run_tests(ADD, ["assert add(1, 2) == 3", "import time\ntime.sleep(60)", "assert add(1, 1) == 2"], limits, mechanism=mech)
    assert (r.status, r.passed, r.total) == ("timeout", 1, 3), r
    assert "wall-clock limit of 2 s exceeded (during test 2)" in r.reason and 2 <= r.duration_s < 3.5


@mechanisms
def test_a_memory_bomb_hits_the_memory_limit(mech):
    for bomb in ("x = bytearray(10 ** 10)", "x = []\nwhile True:\n    x.append(' ' * 10 ** 6)"):
        r = run_tests(ADD, ["assert add(1, 2) == 3", bomb], FAST, mechanism=mech)
        assert (r.status, r.passed) == ("memory", 1), r
        assert "memory limit of 256 MB exceeded (during test 2)" in r.reason


@mechanisms
def test_a_huge_file_hits_the_file_size_limit_and_leaves_nothing(mech):
    name = f"sao-escape-{uuid.uuid4().hex}"
    r = run_tests(f"open('/tmp/{name}', 'wb').write(b'x' * (64 << 20))", ["assert True"], FAST, mechanism=mech)
    assert r.status == "crashed" and "file size limit of 4 MB exceeded" in r.reason, r
    assert not Path("/tmp", name).exists()
    many = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))"
    r = run_tests(many, ["assert True"], FAST, mechanism=mech)
    assert r.status == "failed" and "No space left on device" in r.output  # the directory is a 16 MB tmpfs


SLEEPERS = dedent("""
    import os, time
    n = 0
    for _ in range(50):
        try:
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            n += 1
        except OSError:
            break
    print('forked', n)
    """)


@mechanisms
def test_forking_is_forbidden_by_the_guard(mech):
    r = run_tests(SLEEPERS, ["assert True"], FAST, mechanism=mech)
    assert r.status == "forbidden" and "forking" in r.reason


@mechanisms
def test_a_fork_bomb_is_capped_by_the_os_layers_and_leaves_no_process(mech):
    # First harmless: sleeping children, capped by RLIMIT_NPROC of the run's uid.
    r = run_tests(SLEEPERS, ["assert True"], FAST, mechanism=mech, guard=False)
    assert r.status == "passed" and "forked 6" in r.output, r  # max_procs 8 = harness, worker thread and 6 children
    r = run_tests("import os\nwhile True:\n    os.fork()", ["assert True"], FAST, mechanism=mech, guard=False)
    assert r.status == "failed" and "BlockingIOError" in r.reason, r  # forks up to the cap, then fails
    spinning = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    small = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, max_procs=4, max_file_mb=4)
    r = run_tests(spinning, ["assert True"], small, mechanism=mech, guard=False)  # never ends on its own
    assert r.status == "timeout", r
    assert subprocess.run(["true"]).returncode == 0  # this machine can still start processes


# --- escape attempts: filesystem, network, processes ----------------------------------------------

@mechanisms
@pytest.mark.parametrize("guard", [True, False])
def test_writes_outside_the_sandbox_do_not_land(mech, guard, tmp_path):
    name = f"sao-escape-{uuid.uuid4().hex}"
    targets = [Path("/root") / name, Path.home() / name, tmp_path / name, PROJECT / name, Path("/tmp") / name]
    sol = dedent(f"""
        results = {{}}
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, 'w').write('escaped')
                results[path] = 'written'
            except OSError as e:
                results[path] = type(e).__name__
        print(results)
        """)
    r = run_tests(sol, ["assert True"], FAST, mechanism=mech, guard=guard)
    assert r.status == "passed", r
    assert not [t for t in targets if t.exists()]
    assert f"'/tmp/{name}': 'written'" in r.output  # /tmp inside is the sandbox's own directory
    assert r.output.count("'written'") == 1  # every other write failed inside


@mechanisms
def test_the_project_and_the_host_are_not_readable(mech):
    tests = [f"open({str(PROJECT / 'pyproject.toml')!r}).read()", "open('/etc/passwd').read()",
             "import os\nassert not {'work', 'home', 'proc', 'var'} & set(os.listdir('/'))",
             "import os\nassert not os.path.exists('/proc/1')"]
    r = run_tests("", tests, FAST, mechanism=mech)
    assert (r.status, r.passed, r.total) == ("failed", 2, 4), r
    assert r.output.count("FileNotFoundError") == 2


@pytest.fixture()
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def _accepted(server) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


@mechanisms
def test_sockets_are_forbidden_and_the_network_unreachable(mech, listener):
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=1)"
    guarded = run_tests("", [connect], FAST, mechanism=mech)
    assert guarded.status == "forbidden" and "network socket" in guarded.reason
    bare = run_tests("", [connect], FAST, mechanism=mech, guard=False)  # the network namespace alone
    assert bare.status == "failed" and ("ConnectionRefusedError" in bare.output or "Network is unreachable" in bare.output), bare
    assert not _accepted(listener)
    shared = run_tests("", [connect], SandboxLimits(wall_s=4, network=True), mechanism=mech)
    assert shared.status == "passed" and _accepted(listener)  # network=True really opens it


@mechanisms
def test_processes_are_forbidden_and_harmless_without_the_guard(mech):
    for attempt in ("import os\nos.system('true')", "import subprocess\nsubprocess.run(['true'])",
                    "import os\nos.execv('/bin/true', ['true'])"):
        r = run_tests("", [attempt], FAST, mechanism=mech)
        assert r.status == "forbidden", (attempt, r)
    name = f"sao-escape-{uuid.uuid4().hex}"
    sol = dedent(f"""
        import subprocess
        cat = subprocess.run(['cat', {str(PROJECT / 'pyproject.toml')!r}], capture_output=True)
        subprocess.run(['sh', '-c', 'sleep 60 & touch /tmp/{name}'])
        ls = subprocess.run(['ls', '/'], capture_output=True, text=True)
        """)
    tests = ["assert cat.returncode != 0", "assert 'work' not in ls.stdout.split()"]
    r = run_tests(sol, tests, FAST, mechanism=mech, guard=False)
    assert r.status == "passed", r
    assert not Path("/tmp", name).exists()  # and the autouse check: the backgrounded sleep is gone


@mechanisms
@pytest.mark.parametrize("guard", [True, False])
def test_killing_the_parent_is_contained(mech, guard):
    # The harness is pid 2; its parent is the namespace's pid 1 (root), not this process.
    tests = ["import os, signal\nassert os.getppid() == 1\nos.kill(os.getppid(), signal.SIGKILL)",
             "import os, signal\nos.kill(1, signal.SIGTERM)"]
    r = run_tests("", tests, FAST, mechanism=mech, guard=guard)
    assert (r.status, r.passed) == ("failed", 0), r
    assert r.output.count("PermissionError") == 2
    os.kill(os.getpid(), 0)  # the trainer (here: pytest) is alive


# --- escape attempts: faking the verdict ----------------------------------------------------------

CHEATS = {
    "sys.exit in solution": "import sys\nsys.exit(0)",
    "SystemExit in solution": "raise SystemExit(0)",
    "os._exit in solution": "import os\nos._exit(0)",
    "sys.exit in atexit": "import atexit, sys\natexit.register(sys.exit, 0)",
    "kill self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "silence print and exec": "import builtins\nbuiltins.print = lambda *a, **k: None\nbuiltins.exec = lambda *a, **k: None\n"
                              "builtins.compile = lambda *a, **k: compile('pass', 'x', 'exec')",
    "patch __main__": "import __main__\nfor k in list(vars(__main__)):\n    if k.startswith('_h_'):\n"
                      "        setattr(__main__, k, lambda *a, **k: ('ok', ''))\n_h_describe = lambda e: ('ok', '')",
    "fake output": "print('all 2 tests passed')\nprint('run done')\nimport sys\nsys.stderr.write('test1 ok \\ntest2 ok \\n')",
    "forge records on every fd": dedent("""
        import os
        for fd in range(64):
            for line in (b'test1 ok \\n', b'test2 ok \\n', b'run done \\n'):
                try:
                    os.write(fd, b'0' * 32 + b' ' + line)
                except OSError:
                    pass
        """),
    "read the nonce from stdin": "import sys, os\nleak = sys.stdin.read() + os.read(0, 100).decode()\nassert leak == ''",
    "walk the stack": "import sys\nsys._getframe(1)",
    "traceback frames": "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    e.__traceback__.tb_frame.f_back.f_locals",
    "walk the heap": "import gc\ngc.get_objects()",
    "ctypes": "import ctypes",
    "trace the harness": "import sys\nsys.settrace(lambda *a: None)",
    "signal handler": "import signal\nsignal.signal(signal.SIGALRM, lambda *a: None)",
    "interrupt main": "import _thread, time\n_thread.interrupt_main()\ntime.sleep(0.2)",
}


@mechanisms
@pytest.mark.parametrize("cheat", CHEATS, ids=list(CHEATS))
def test_faking_a_pass_does_not_pass(mech, cheat):
    """Each cheat runs before tests that fail honestly; the verdict must not be `passed`."""
    r = run_tests(ADD + CHEATS[cheat], ["assert add(1, 2) == 4", "assert add(1, 1) == 3"], FAST, mechanism=mech)
    assert r.status != "passed" and r.passed == 0, r
    in_test = run_tests(ADD, [CHEATS[cheat] + "\nassert add(1, 2) == 4"], FAST, mechanism=mech)
    assert in_test.status != "passed" and in_test.passed == 0, in_test


# --- concurrency --------------------------------------------------------------------------------

@mechanisms
def test_async_runs_overlap_and_each_gets_its_own_verdict(mech):
    async def main():
        limits = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, max_procs=8, max_file_mb=4)
        jobs = [run_tests_async(ADD, ["assert add(1, 2) == 3"], limits, mechanism=mech),
                run_tests_async(ADD, ["assert add(1, 2) == 4"], limits, mechanism=mech),
                run_tests_async("import time\ntime.sleep(60)", ["assert True"], limits, mechanism=mech),
                run_tests_async("import os\nos.fork()", ["assert True"], limits, mechanism=mech)]
        start = time.monotonic()
        results = await asyncio.gather(*jobs)
        return results, time.monotonic() - start

    results, elapsed = asyncio.run(main())
    assert [r.status for r in results] == ["passed", "failed", "timeout", "forbidden"]
    assert elapsed < 3.5  # concurrent: the 2 s timeout does not add up with the others

