"""sao.sandbox: normal runs, then escape attempts, each contained with the right status.

Every test that runs code is parametrized over the mechanisms that work here (bwrap when installed,
and util-linux unshare). As root, `test_the_suite_passes_as_an_unprivileged_user` runs this whole
file again as a user it creates, on the user-namespace path. After each test, no process of its
runs is left. `guard=False` runs check the OS layers without the in-process audit hook.
The attack classes found in review: forged records, introspection of the harness, the nested-name import,
fallocate on outputs, memfd and shared memory (here); printed fake failures (tests/test_code_env.py).
"""

import asyncio
import os
import pwd
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from textwrap import dedent

import pytest

from sao.sandbox import MECHANISMS, Limits, NamespaceSandbox, SandboxUnavailable, get_sandbox, hostlimits, judge, namespace

PROJECT = Path(__file__).resolve().parents[1]
AS_USER_ENV = "SAO_SANDBOX_SUITE_AS_USER"  # set in the copy of this suite that runs unprivileged
WORKING = [m for m in MECHANISMS if namespace.mechanism_works(m)]
FAST = Limits(cpu_s=1, wall_s=4, memory_mb=256, max_procs=8, max_file_mb=4)
ADD = "def add(a, b):\n    return a + b\n"
# descriptors a cheat tries (also spelled 4096 in the code strings below): all a run can have; the
# harness's record pipe is numbered after whatever the host process holds open, which passed 64 once
FDS = 4096
# A mechanism that cannot contain a run here is skipped with the reason (`pytest -rs` prints it).
mechanisms = pytest.mark.parametrize("mech", [pytest.param(m, marks=pytest.mark.skipif(
    m not in WORKING, reason=f"sandbox mechanism {m}: {namespace.probe(m)}")) for m in MECHANISMS])


def run(code, tests, limits=FAST, *, mech, guard=True, setup=""):
    return NamespaceSandbox(mech, guard=guard).run(code, tests, limits, setup=setup)


def _leftovers(uids: set[int]) -> list[int]:
    """Root mode: processes of the runs' uids. User mode: our own processes in another PID namespace."""
    own_ns, pids = os.readlink("/proc/self/ns/pid"), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            uid = int(next(x for x in status.splitlines() if x.startswith("Uid:")).split()[1])
            if uid in uids or (namespace.mode() == "user" and uid == os.getuid()
                               and os.readlink(f"/proc/{entry}/ns/pid") != own_ns):
                pids.append(int(entry))
        except (OSError, StopIteration):
            continue
    return pids


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch):
    """After each test, no process of its runs is left and their mount-point directories are gone."""
    uids, dirs, init = set(), [], namespace._Run.__init__

    def recording_init(r, *args, **kwargs):
        init(r, *args, **kwargs)
        uids.add(r.uid)
        dirs.append(r.dir)

    monkeypatch.setattr(namespace._Run, "__init__", recording_init)
    yield
    deadline = time.monotonic() + 5  # the kernel tears a PID namespace down asynchronously
    while _leftovers(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leftovers(uids) == [], "a sandboxed process outlived its run"
    assert not [d for d in dirs if os.path.exists(d)], "a run left its temporary directory"


def test_a_mechanism_works_here_and_none_refuses_with_what_is_missing(monkeypatch):
    why = {m: namespace.probe(m) for m in MECHANISMS}
    if os.geteuid() != 0 and not WORKING:  # e.g. unprivileged user namespaces disabled by the kernel
        pytest.skip(f"no sandbox mechanism for an unprivileged user here: {why}")
    assert WORKING, f"nothing contains a run here as root: {why}"  # unshare (util-linux) always can
    monkeypatch.setattr(namespace, "probe", lambda name: "not installed" if name == "bwrap" else "unshare failed: EPERM")
    assert namespace.available_mechanism() == "none"
    with pytest.raises(SandboxUnavailable, match=r"bwrap: not installed; unshare: unshare failed: EPERM.*"
                                                 r"refusing to run model code unconfined") as error:
        get_sandbox().run(ADD, ["assert add(1, 2) == 3"])
    assert "\n" not in str(error.value)
    with pytest.raises(SandboxUnavailable, match="docker"):
        get_sandbox("docker").run(ADD, ["assert add(1, 2) == 3"])


@pytest.mark.skipif(not WORKING, reason="no mechanism works here (see the test above)")
def test_the_environment_variable_forces_a_mechanism(monkeypatch):
    monkeypatch.setenv(namespace.MECHANISM_ENV, WORKING[-1])
    layers = "uid" if os.geteuid() == 0 else "userns"
    assert get_sandbox().run(ADD, "assert add(1, 2) == 3", FAST).mechanism.startswith(f"{WORKING[-1]}+{layers}+seccomp")


# --- the judge ----------------------------------------------------------------------------------

def _judge(test, got, entry=None):
    """Judge `test` as if the sandbox had returned `got` (a repr, or an exception message) for each call."""
    check = judge.plan(test, entry)
    assert check.host_judged, check.reason
    return judge.judge(check, [got if isinstance(got, tuple) else ("value", got) for _ in check.calls])


def test_host_judging_is_bounded_in_cpu_time_and_runs_off_the_event_loop(monkeypatch):
    """Found in review: values shaped to be expensive cost the trainer's process seconds of CPU per run, on the
    rollout worker's event loop (~10 s blocked). Judging now has a CPU budget per test and runs on a thread."""
    from sao.sandbox import hosteval

    slow = "y = f()\nassert all(y != i for i in range(40000))"
    assert _judge(slow, "-1")[0] is True  # within the budgets as they are
    check = judge.plan(slow)
    monkeypatch.setattr(hosteval, "MAX_HOST_CPU_S", 0.01)
    ok, error, _ = judge.judge(check, [("value", "-1")] * len(check.calls))
    assert not ok and "took over 0.01 s of CPU" in error
    monkeypatch.undo()

    async def go():
        gaps, done = [], asyncio.Event()

        async def tick():
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                gaps.append(time.perf_counter() - t)

        ticker = asyncio.ensure_future(tick())
        t0 = time.perf_counter()
        verdict = await NamespaceSandbox().run_async("def f():\n    return -1\n", [slow] * 4, FAST)
        judged_s = time.perf_counter() - t0
        done.set()
        await ticker
        return verdict, judged_s, max(gaps)

    verdict, judged_s, worst = asyncio.run(go())
    assert verdict.status == "passed", verdict
    assert worst < 0.25, (worst, judged_s)  # the loop kept ticking while four slow tests were judged


def test_the_host_keeps_expected_values_and_judges_data_only():
    check = judge.plan("assert f(1, (2,)) == {'a': (3, None)}")
    assert check.calls == ("f(1, (2,))",) and "3" not in "".join(check.calls)  # the expected value stays here
    assert judge.plan("assert 5 == f(1)").calls == ("f(1)",) and judge.plan("assert not f(0)").host_judged
    assert judge.plan("assert f(2) in (1, 2), 'msg'").host_judged and judge.plan("assert f() is None").host_judged
    assert judge.plan("x = f(1)\nassert x == 2").calls == ("f(1)",)  # statements run on the host too
    assert judge.plan("assert all(f(x) == x + 1 for x in range(3))").calls == ("f(0)", "f(1)", "f(2)")
    for snippet in ("assert f(f(1)) == 2", "assert g(f(1)) == 2", "assert f(", "print(1)", "try:\n    f(1)\nexcept: pass",
                    "assert f(1).real == 2", "assert f(1) is 3"):
        assert not judge.plan(snippet).host_judged, snippet
    assert "neither the entry point" in judge.plan("assert g(1) == 2", entry="f").reason
    # found in review: without an entry point every unknown name was a sandbox call, so the code under test
    # defined the expected value too (`assert f(1) == expected(1)`); now only the first may come from it
    for snippet in ("assert f(1) == expected(1)", "assert f(1) == EXPECTED", "x = f(2)\nassert x == g(2)"):
        check = judge.plan(snippet)
        assert not check.host_judged and "names the host does not know" in check.reason, (snippet, check)
    assert judge.plan("assert f(1) == 2 and f(2) == 4\nassert abs(f(3) - 6) < 1e-9").host_judged
    assert _judge("assert f() == 3", "3.0")[0] is True  # as `==` does
    assert _judge("assert f() == [1]", "(1,)")[0] is False
    assert _judge("assert f() == {1, 2}", "{2, 1}")[0] and _judge("assert f() == set()", "set()")[0]
    assert _judge("assert math.isnan(f())", "nan")[0] and _judge("assert f() == [float('inf')]", "[inf]")[0]
    assert "not plain data" in _judge("assert f() == 3", "<Always object at 0x1>")[1]
    assert "too large" in _judge("assert f() == 3", "1" * 70000)[1]
    assert _judge("assert f(2) == 5", ("fail", "ValueError: no"))[1] == "f(2) raised ValueError: no"


@mechanisms
def test_the_judge_sees_what_a_call_did_to_its_arguments_and_each_call_apart(mech):
    """Found in review: only the returned value came back, so a test of an argument the function must change in
    place was judged on the host's unchanged copy, and identical calls shared one evaluation, so a function
    whose result must change between calls was judged as if it were pure."""
    sort_in_place = "x = [3, 1, 2]\nassert f(x) is None\nassert x == [1, 2, 3]"
    fill = "d = {}\nf(d, k='a')\nassert d == {'a': 1}"
    counter = "assert f() == 1\nassert f() == 2\nassert [f(), f()] == [3, 4]"
    right = {sort_in_place: "def f(x):\n    x.sort()\n", fill: "def f(d, k):\n    d[k] = 1\n",
             counter: "n = [0]\ndef f():\n    n[0] += 1\n    return n[0]\n"}
    wrong = {sort_in_place: "def f(x):\n    return None\n", fill: "def f(d, k):\n    return {k: 1}\n",
             counter: "def f():\n    return 1\n"}
    for test in (sort_in_place, fill, counter):
        assert judge.plan(test).host_judged, test
        good, bad = run(right[test], [test], mech=mech), run(wrong[test], [test], mech=mech)
        assert good.status == "passed" and good.tests[0].judge == "host", (test, good)
        assert bad.status == "failed" and bad.tests[0].judge == "host", (test, bad)
    assert len(judge.plan(counter).calls) == 4  # four evaluations, in order
    # a branch the host decides is planned as the run takes it: no extra evaluation, no extra random draw
    plan = judge.plan("import random\nk = random.randint(0, 9)\nassert (f(k) if k > 100 else f(k + 1)) == 1\n"
                      "assert f(random.randint(0, 9)) == 2")
    assert len(plan.calls) == 2, plan.calls


@mechanisms
def test_a_walk_the_sandbox_decides_is_refused_not_guessed(mech):
    """Found in review: where a sandbox value decided a branch, the sandbox evaluated the calls of both sides, so
    a counter the test reads afterwards was one ahead and correct code failed; a random draw on both sides moved
    the run's later draws off the planned ones. Such tests are now not host-judged (refused at load, or derived)."""
    counter = "n = [0]\ndef f():\n    n[0] += 1\n    return n[0]\n"
    undecided = ["assert (f() if f() == 1 else f()) == 2\nassert f() == 3",
                 "assert f() == 1 or f() == 5\nassert f() == 2",
                 "assert [f() for _ in range(3) if f() > 100] == []\nassert f() == 4",
                 "import random\nassert (random.random() if f() else 0) < 1\nassert f(random.randint(0, 9)) == 2",
                 "for x in f():\n    assert f() == x"]
    for test in undecided:
        check = judge.plan(test)
        assert not check.host_judged and ("value from the sandbox" in check.reason
                                          or "by a value from" in check.reason), (test, check)
    # stopping early fails the assert anyway: `and` at the top of an assert and comparison chains stay host-judged
    for test in ("assert f() == 1 and f() == 2\nassert f() == 3", "assert 0 < f() < f()\nassert f() == 3"):
        check = judge.plan(test)
        assert check.host_judged, (test, check)
        good = run(counter, [test], mech=mech)
        assert good.status == "passed" and good.tests[0].judge == "host", (test, good)
    # a loop over the host's own values is walked as the run walks it
    assert judge.plan("for k in range(3):\n    assert f() == k + 1").host_judged


def test_compound_and_tolerance_asserts_are_decided_by_the_host():
    """Found in review: these forms were host-judged in name only: the comparison ran inside, with the code's objects."""
    cases = [("assert f(1) == 3 and f(2) == 7", {"f(1)": "3", "f(2)": "7"}, {"f(1)": "3", "f(2)": "8"}),
             ("assert all([f(1) == 3, f(2) == 7])", {"f(1)": "3", "f(2)": "7"}, {"f(1)": "4", "f(2)": "7"}),
             ("import math\nassert math.isclose(f(1), 0.5)", {"f(1)": "0.5000000001"}, {"f(1)": "0.6"}),
             ("assert abs(f(1) - 0.5) < 1e-9", {"f(1)": "0.5"}, {"f(1)": "0.50001"}),
             ("assert f(1) - 3 == 0", {"f(1)": "3"}, {"f(1)": "2"}),
             ("assert not f(1) != 3", {"f(1)": "3"}, {"f(1)": "2"})]
    for test, right, wrong in cases:
        check = judge.plan(test)
        assert check.host_judged and set(check.calls) == set(right), test
        assert judge.judge(check, [("value", right[c]) for c in check.calls])[0] is True, test
        passed, error = judge.judge(check, [("value", wrong[c]) for c in check.calls])[:2]
        assert passed is False and "returned" in error and " 7" not in error.split("returned")[0], (test, error)


def test_host_evaluation_is_bounded_and_total():
    for test in ("assert f() * 10 ** 9 == 'x'", "assert 2 ** f() > 0", "assert len(range(f())) > 0",
                 "assert f() << f() > 0", "assert sorted(f()) == 1"):
        check = judge.plan(test)
        assert check.host_judged, test
        got = {"assert 2 ** f() > 0": str(10 ** 12), "assert len(range(f())) > 0": str(10 ** 18)}.get(test, repr("ab" * 30000))
        values = [("value", v) for c, v in zip(check.calls, ["100000000000", "10000000"] if "<<" in test else [got])]
        passed, error, _ = judge.judge(check, values)
        assert passed is False and ("for the host" in error or "sorted" in test), (test, error)  # a bound, not MemoryError
    bomb = "[" * 5000 + "]" * 5000
    assert "not plain data" in _judge("assert f() == 3", bomb)[1]
    from sao.sandbox import verdict
    assert verdict.parse_records("[" * 5000 + "\n" + '["' + "[" * 5000 + "\n") == ({}, [], False)
    assert verdict.clean("a\ud800b") == "a?b"


@mechanisms
def test_lying_objects_and_patched_helpers_do_not_pass(mech):
    """Found in review, each attack with an honest control: a returned object whose __eq__/__sub__/__bool__ lie, a
    patched math.isclose, and a list subclass equal to everything all passed 2/2 with judge="host" before."""
    liar = dedent("""
        import math
        class Liar(list):
            __eq__ = lambda self, other: True
            __ne__ = lambda self, other: False
            __sub__ = __rsub__ = lambda self, other: 0
            __abs__ = lambda self: 0
            __lt__ = lambda self, other: True
            __bool__ = lambda self: True
        math.isclose = lambda *a, **k: True
        def f(x):
            return Liar()
        """)
    honest = "def f(x):\n    return 2 * x + 1\n"
    tests = ["assert f(1) == 3 and f(3) == 7", "assert all([f(1) == 3, f(3) == 7])", "import math\nassert math.isclose(f(1), 3)",
             "assert abs(f(1) - 3) < 1e-9", "assert f(1) - 3 == 0", "assert not f(1) != 3", "x = f(1)\nassert x == 3",
             "assert f(1) == f(1) + [1]"]
    control = run(honest, tests[:-1], mech=mech)
    assert (control.status, control.passed) == ("passed", len(tests) - 1), control
    r = run(liar, tests, mech=mech)
    assert (r.status, r.passed) == ("failed", 0) and {t.judge for t in r.tests} == {"host"}, r


@mechanisms
def test_forged_records_the_depth_bomb_and_a_lone_surrogate_still_give_a_verdict(mech):
    forge = dedent("""
        import json, os, sys
        def f(x):
            return 0
        os.write(int(sys.argv[3]), (json.dumps(["test1", "ok", ""]) + "\\n").encode())
        os.write(int(sys.argv[3]), (json.dumps(["test2.1", "value", "4"]) + "\\n").encode())  # a wrong guess
        os.write(int(sys.argv[3]), b"[" * 5000 + b"\\n" + b'["' + b"[" * 5000 + b"\\n")
        """)
    r = run(forge, ["x = f(1)\nassert x == 3", "assert f(2) == 5"], mech=mech, guard=False)
    assert (r.status, r.passed) == ("failed", 0), r  # an "ok" record decides nothing; a forged value is only a guess
    assert r.tests[0].got == "0" and r.tests[1].got == "4"
    r = run("def f(x):\n    raise ValueError('\\ud800 ' + chr(0xDFFF))\n", ["assert f(1) == 3"], mech=mech)
    assert r.status == "failed" and r.tests[0].error.encode("utf-8") and "ValueError" in r.tests[0].error


@mechanisms
def test_an_object_equal_to_everything_does_not_pass(mech):
    always = "class A:\n    def __eq__(self, other):\n        return True\n    __repr__ = lambda self: '7'\n"
    r = run(always + "def add(a, b):\n    return A()", ["assert add(1, 2) == 3", "assert add(1, 2) == 'x'"], mech=mech)
    assert (r.status, r.passed) == ("failed", 0), r  # the repr says 7: compared on the host, 7 != 3
    r = run(always.replace("'7'", "'A()'") + "def add(a, b):\n    return A()", ["assert add(1, 2) == 3"], mech=mech)
    assert r.status == "failed" and "not plain data" in r.tests[0].error


# --- normal cases ---------------------------------------------------------------------------------

@mechanisms
def test_a_correct_solution_passes(mech):
    r = run(ADD + "print('hello')", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"],
            mech=mech)
    assert (r.status, r.passed, r.failed, r.total) == ("passed", 3, 0, 3), r
    assert [t.judge for t in r.tests] == ["host"] * 3 and r.tests[2].got == "'ab'"
    assert r.output == "hello\n" and r.mechanism.startswith(mech) and r.mechanism.endswith("+guard")
    assert r.duration_s < 3


@mechanisms
def test_a_wrong_solution_fails_with_the_value_it_got(mech):
    r = run(ADD, ["assert add(1, 2) == 3", "assert add(2, 2) == 5, 'add(2, 2) should be 5'",
                  "assert add(2, 2) == 5 and True", "x = add(2, 2)\nassert x == 5, 'should be 5'"], mech=mech)
    assert (r.status, r.passed, r.failed, r.total) == ("failed", 1, 3, 4)
    assert r.tests[1].error == "add(2, 2) returned 4" and "test 2: add(2, 2) returned 4" in r.reason
    assert r.tests[2].error == "add(2, 2) returned 4" and r.tests[3].judge == "host"  # the host ran `x = ...` too
    assert "5" not in "".join(t.error for t in r.tests)  # the expected value is never in a message


@mechanisms
def test_a_syntax_error_fails_with_a_clear_reason(mech):
    r = run("def add(a, b)\n    return a + b", ["assert add(1, 2) == 3"], mech=mech)
    assert (r.status, r.passed, r.total) == ("failed", 0, 1)
    assert "the solution failed: SyntaxError" in r.reason and "line 1" in r.reason
    assert r.solution_error.startswith("solution: SyntaxError")
    bad_test = run(ADD, ["assert add(1, 2) == 3", "assert add(1,"], mech=mech)
    assert (bad_test.status, bad_test.passed) == ("failed", 1) and "SyntaxError" in bad_test.reason


@mechanisms
def test_setup_runs_first_and_its_failure_is_a_crash(mech):
    assert run("def f(x):\n    return sqrt(x)", "assert f(4) == 2", setup="from math import sqrt",
               mech=mech).status == "passed"
    r = run(ADD, "assert add(1, 2) == 3", setup="import no_such_module", mech=mech)
    assert r.status == "crashed" and "setup code failed: ModuleNotFoundError" in r.reason


@mechanisms
def test_code_runs_on_the_base_python_without_project_packages(mech):
    sol = "import sys\nprefix = sys.prefix\ntry:\n    import sao\nexcept ImportError:\n    sao = None\n"
    r = run(sol, [f"assert prefix == {os.path.realpath(sys.base_prefix)!r}", "assert sao is None"], mech=mech)
    assert r.status == "passed", r


@mechanisms
def test_common_stdlib_works_under_the_guard(mech):
    sol = dedent("""
        from collections import namedtuple
        import asyncio, enum, logging, threading, traceback, typing, inspect
        P = namedtuple('P', 'x y')
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
        here = inspect.stack()[0].function
        """)
    # asyncio's loop needs a socketpair, refused where no cgroup counts socket buffers (user mode here)
    loop = "assert asyncio.run(triple(2)) == 6" if hostlimits.cgroup_parents() else (
        "import socket\ntry:\n    socket.socketpair()\nexcept PermissionError:\n    pass\nelse:\n    raise SystemExit")
    tests = ["assert P(1, 2).y == 2", loop, "assert sorted(out) == [0, 1, 2]",
             "assert open('/tmp/scratch.txt').read() == 'ok'",  # /tmp is the sandbox's own directory
             "import sys\nsys.setrecursionlimit(30000)\nassert depth(20000) == 20000", "assert here == '<module>'"]
    r = run(sol, tests, mech=mech)
    assert r.status == "passed", r
    assert "logged" in r.output


@mechanisms
def test_socket_buffers_cannot_hold_memory_outside_the_limit(mech):
    """Found in review: as non-root (no cgroup), six children started with _posixsubprocess.fork_exec (no audit
    event) filled Unix socket buffers and held ~5 GiB with memory_mb=256. Without a cgroup, socketpair
    and AF_UNIX sockets are now refused, pidfds too, fork_exec is forbidden, and descriptors are fewer."""
    hoard = dedent("""
        import os, socket, resource
        refused = []
        for make in (socket.socketpair, lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)):
            try:
                make()
            except PermissionError:
                refused.append(1)
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        try:
            os.pidfd_open(os.getpid())
            pidfd = "open"
        except (PermissionError, AttributeError):
            pidfd = "refused"
        """)
    no_cgroup = not hostlimits.cgroup_parents()
    r = run(hoard, [f"assert refused == {[1, 1] if no_cgroup else []}", f"assert files == {64 if no_cgroup else 256}",
                    "assert pidfd == 'refused'"], mech=mech, guard=False)
    assert r.status == "passed", r
    spawn = run("import _posixsubprocess, os\n_posixsubprocess.fork_exec(*([None] * 23))", ["assert True"], mech=mech)
    assert r.status == "passed" and spawn.status == "forbidden" and "subprocess" in spawn.reason, spawn


# --- escape attempts: resources -------------------------------------------------------------------

@mechanisms
def test_an_infinite_loop_hits_the_cpu_limit(mech):
    r = run("while True:\n    pass", ["assert True"], Limits(cpu_s=1, wall_s=15, memory_mb=256, max_procs=8), mech=mech)
    assert r.status == "timeout" and "CPU time limit of 1 s" in r.reason, r  # wall room for a loaded machine


@mechanisms
def test_a_hang_hits_the_wall_clock_and_keeps_earlier_credit(mech):
    limits = Limits(cpu_s=1, wall_s=2, memory_mb=256, max_procs=8, max_file_mb=4)
    r = run(ADD, ["assert add(1, 2) == 3", "import time\ntime.sleep(60)", "assert add(1, 1) == 2"], limits, mech=mech)
    assert (r.status, r.passed, r.total) == ("timeout", 1, 3), r
    assert "wall-clock limit of 2 s exceeded (during test 2)" in r.reason and 2 <= r.duration_s < 5


@mechanisms
def test_a_memory_bomb_hits_the_memory_limit(mech):
    for bomb in ("x = bytearray(10 ** 10)", "x = []\nwhile True:\n    x.append(' ' * 10 ** 6)"):
        r = run(ADD, ["assert add(1, 2) == 3", bomb], mech=mech)
        assert (r.status, r.passed) == ("memory", 1), r
        assert "memory limit of 256 MB exceeded (during test 2)" in r.reason


@mechanisms
def test_memory_spread_over_processes_counts_for_the_run(mech):
    # Each process stays under its address-space limit; together they exceed the run's memory.
    spread = dedent("""
        import os, time
        for _ in range(4):  # 4 x 120 MB; the fork cap (8 tasks) leaves room for 4 in every mode
            if os.fork() == 0:
                block = bytearray(120 << 20)
                time.sleep(10)
                os._exit(0)
        time.sleep(10)
        """)
    limits = Limits(cpu_s=2, wall_s=8, memory_mb=256, max_procs=8, max_file_mb=4)
    r = run(spread, ["assert True"], limits, mech=mech, guard=False)
    assert r.status == "memory" and "memory limit of 256 MB exceeded" in r.reason and r.duration_s < 6, r


@mechanisms
@pytest.mark.skipif(hostlimits.cgroup_parents() is None, reason="no cgroup of ours here (root with cgroup v1/v2 only)")
def test_a_cgroup_counts_the_tmpfs_and_every_process(mech):
    fill = "for i in range(60):\n    open(f'/sandbox/f{i}', 'wb').write(b'x' * (3 << 20))\n"  # 180 MB of tmpfs pages
    r = run(fill, ["assert True"], Limits(cpu_s=2, wall_s=8, memory_mb=64, max_procs=8, max_file_mb=64), mech=mech)
    assert r.status == "memory" and "+cgroup" in r.mechanism, r


@mechanisms
def test_memfd_and_shared_memory_are_refused_or_counted(mech):
    probes = dedent("""
        import ctypes, mmap, os
        libc = ctypes.CDLL(None, use_errno=True)
        out = {}
        try:
            os.memfd_create('x')
            out['memfd'] = 'made'
        except OSError as e:
            out['memfd'] = e.errno
        out['shmget'] = (libc.shmget(0, 64 << 20, 0o1600), ctypes.get_errno())  # IPC_PRIVATE, IPC_CREAT | 0600
        out['devshm'] = os.path.exists('/dev/shm')
        try:
            mmap.mmap(-1, 1 << 30, flags=mmap.MAP_SHARED)
            out['shared'] = 'mapped'
        except OSError as e:
            out['shared'] = e.errno
        out['userns'] = (libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
        out['mount'] = (libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None), ctypes.get_errno())
        try:
            for i in range(10):  # 3 MB files (the file limit is 4 MB) into a tmpfs of 16 MB
                open(f'/sandbox/fill{i}', 'wb').write(b'x' * (3 << 20))
            out['tmpfs'] = 'written'
        except OSError as e:
            out['tmpfs'] = e.errno
        """)
    tests = ["assert out['memfd'] == 1", "assert out['shmget'] == (-1, 1)", "assert out['devshm'] is False",
             "assert out['shared'] == 12", "assert out['userns'] == (-1, 1)", "assert out['mount'] == (-1, 1)",
             "assert out['tmpfs'] == 28"]  # EPERM, ENOMEM, ENOSPC
    r = run(probes, tests, Limits(cpu_s=2, wall_s=6, memory_mb=256, max_procs=8, max_file_mb=4), mech=mech, guard=False)
    assert r.status == "passed", (r.reason, [t for t in r.tests if not t.passed], r.output[-500:])
    guarded = run("import os\nos.memfd_create('x')", ["assert True"], mech=mech)
    assert guarded.status == "failed" and "PermissionError" in guarded.reason


@mechanisms
def test_fallocate_has_no_host_file_to_grow(mech):
    # Found in review: fallocate(KEEP_SIZE) on the host-side output files reserved 1 GiB past a 16 MB file limit.
    # Here every descriptor is a pipe or /dev/null (ESPIPE, ENODEV) and the only writable files are on
    # the capped tmpfs (EFBIG past the file limit, ENOSPC past its size).
    grab = dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal(25, ctypes.c_void_p(1))  # SIGXFSZ ignored: EFBIG instead of dying
        ok = []
        for fd in range(4096):
            # FALLOC_FL_KEEP_SIZE: the file's size does not change, so RLIMIT_FSIZE does not see it
            if libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(1 << 30)) == 0:
                ok.append(fd)
        fd = os.open('/sandbox/big', os.O_CREAT | os.O_WRONLY)
        sandbox_tmpfs = libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(1 << 30)), ctypes.get_errno()
        """)
    r = run(grab, ["assert ok == []", "assert sandbox_tmpfs in ((-1, 27), (-1, 28))"], mech=mech, guard=False)
    assert r.status == "passed", (r.reason, r.tests)


@mechanisms
def test_a_huge_file_hits_the_file_size_limit_and_leaves_nothing(mech):
    name = f"sao-escape-{uuid.uuid4().hex}"
    r = run(f"open('/tmp/{name}', 'wb').write(b'x' * (64 << 20))", ["assert True"], mech=mech)
    assert r.status == "crashed" and "file size limit of 4 MB exceeded" in r.reason, r
    assert not Path("/tmp", name).exists()
    many = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))"
    r = run(many, ["assert True"], mech=mech)
    assert r.status == "failed" and "No space left on device" in r.reason  # the directory is a 16 MB tmpfs
    assert "(the sandbox's 16 MB of disk are full)" in r.reason


@mechanisms
def test_output_is_capped_on_the_host(mech):
    r = run("import os\nfor _ in range(64):\n    os.write(1, b'x' * (1 << 20))", ["assert True"], mech=mech)
    assert r.status == "passed" and len(r.output) < (FAST.max_output_kb << 10) + 100 and "bytes cut" in r.output


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
    r = run(SLEEPERS, ["assert True"], mech=mech)
    assert r.status == "forbidden" and "forking" in r.reason


@mechanisms
def test_a_fork_bomb_is_capped_by_the_os_layers_and_leaves_no_process(mech):
    # Contained: a PID namespace and RLIMIT_NPROC of the run's own uid (root) or user namespace.
    r = run(SLEEPERS, ["assert True"], mech=mech, guard=False)
    assert r.status == "passed" and "forked" in r.output and 4 <= int(r.output.split()[-1]) <= 6, r
    r = run("import os\nwhile True:\n    os.fork()", ["assert True"], mech=mech, guard=False)
    assert r.status == "failed" and "BlockingIOError" in r.reason, r  # forks up to the cap, then fails
    assert "(process limit of 8 reached)" in r.reason
    spinning = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    small = Limits(cpu_s=1, wall_s=2, memory_mb=256, max_procs=4, max_file_mb=4)
    r = run(spinning, ["assert True"], small, mech=mech, guard=False)  # never ends on its own
    assert r.status in ("timeout", "memory"), r
    assert subprocess.run(["true"]).returncode == 0  # this machine can still start processes


# --- escape attempts: filesystem, network, processes ----------------------------------------------

@mechanisms
@pytest.mark.parametrize("guard", [True, False])
def test_writes_outside_the_sandbox_do_not_land(mech, guard, tmp_path):
    name = f"sao-escape-{uuid.uuid4().hex}"
    # With the interpreter under /root, /root exists inside too (made by the sandbox, read-only).
    targets = [Path("/root") / name, Path.home() / name, tmp_path / name, PROJECT / name, Path("/tmp") / name,
               Path(sys.base_prefix).parent / name, Path("/") / name]
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
    r = run(sol, ["assert True"], mech=mech, guard=guard)
    assert r.status == "passed", r
    assert not [t for t in targets if t.exists()]
    assert f"'/tmp/{name}': 'written'" in r.output  # /tmp inside is the sandbox's own directory
    assert r.output.count("'written'") == 1  # every other write failed inside


@mechanisms
def test_the_project_and_the_host_are_not_readable(mech):
    tests = [f"open({str(PROJECT / 'pyproject.toml')!r}).read()", "open('/etc/passwd').read()",
             "import os\nassert not {'work', 'home', 'proc', 'var'} & set(os.listdir('/'))",
             "import os\nassert not os.path.exists('/proc/1')"]
    r = run("", tests, mech=mech)
    assert (r.status, r.passed, r.total) == ("failed", 2, 4), r
    assert [t.error.split(":")[0] for t in r.tests[:2]] == ["FileNotFoundError"] * 2


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
def test_loopback_sockets_are_refused_by_the_kernel_not_only_the_guard(mech):
    """Found in review (as root and as a non-root user): with the guard switched off from inside (the code
    reaches its objects), three processes opened loopback TCP connections in the run's own network namespace
    and grew the kernel's TCP memory by ~1 GB at memory_mb=256; those buffers count in neither a cgroup v1
    limit nor an rlimit. Without network, seccomp now refuses socket() of every family but AF_UNIX."""
    probe = dedent("""
        import socket
        refused = []
        for family in (socket.AF_INET, socket.AF_INET6, getattr(socket, "AF_PACKET", 17), socket.AF_NETLINK):
            try:
                socket.socket(family, socket.SOCK_STREAM if family in (socket.AF_INET, socket.AF_INET6) else
                              socket.SOCK_RAW)
            except PermissionError:
                refused.append(int(family))
        """)
    r = run(probe, ["assert len(refused) == 4, refused"], mech=mech, guard=False)
    assert r.status == "passed", r
    shared = run("import socket\nsocket.socket(socket.AF_INET).close()", ["assert True"], Limits(wall_s=4, network=True),
                 mech=mech, guard=False)
    assert shared.status == "passed", shared  # network=True still opens sockets


@mechanisms
def test_sockets_are_forbidden_and_the_network_unreachable(mech, listener):
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=1)"
    guarded = run("", [connect], mech=mech)
    assert guarded.status == "forbidden" and "network socket" in guarded.reason
    bare = run("", [connect], mech=mech, guard=False)  # without the guard: the kernel refuses the socket itself
    assert bare.status == "failed" and "PermissionError" in bare.reason, bare
    assert not _accepted(listener)
    shared = run("", [connect], Limits(wall_s=4, network=True), mech=mech)
    assert shared.status == "passed" and _accepted(listener)  # network=True really opens it


@mechanisms
def test_processes_are_forbidden_and_harmless_without_the_guard(mech):
    for attempt in ("import os\nos.system('true')", "import subprocess\nsubprocess.run(['true'])",
                    "import os\nos.execv('/bin/true', ['true'])"):
        r = run("", [attempt], mech=mech)
        assert r.status == "forbidden", (attempt, r)
    name = f"sao-escape-{uuid.uuid4().hex}"
    sol = dedent(f"""
        import subprocess
        cat = subprocess.run(['cat', {str(PROJECT / 'pyproject.toml')!r}], capture_output=True)
        subprocess.run(['sh', '-c', 'sleep 60 & touch /tmp/{name}'])
        ls = subprocess.run(['ls', '/'], capture_output=True, text=True)
        """)
    r = run(sol, ["assert cat.returncode != 0", "assert 'work' not in ls.stdout.split()"], mech=mech, guard=False)
    assert r.status == "passed", r
    assert not Path("/tmp", name).exists()  # and the autouse check: the backgrounded sleep is gone


@mechanisms
def test_killing_the_parent_is_contained(mech):
    # Its parent and pid 1 are inside its own namespace: a no-op (pid 1 ignores it) or the end of its own run.
    tests = ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "import os, signal\nos.kill(1, signal.SIGKILL)",
             "assert 1 + 1 == 3"]
    r = run("", tests, mech=mech, guard=False)
    assert r.status in ("failed", "crashed") and not r.tests[2].passed, r
    os.kill(os.getpid(), 0)  # the trainer (here: pytest) is alive


@mechanisms
def test_a_nested_module_name_does_not_get_past_the_import_guard(mech):
    # Found in review: the guard checked only the first part of a dotted name; `pkg._ctypes` loaded _ctypes.
    nested = dedent("""
        import importlib, os, sys, types, _socket
        pkg = types.ModuleType('pkg')
        pkg.__path__ = [os.path.dirname(_socket.__file__)]
        sys.modules['pkg'] = pkg
        loaded = importlib.import_module('pkg._ctypes')
        """)
    r = run(nested, ["assert True"], mech=mech)
    assert r.status == "forbidden" and "importing pkg._ctypes" in r.reason, r


# --- escape attempts: faking the verdict ----------------------------------------------------------

def _forge(expr: str) -> str:
    """Code that writes result records claiming a pass, on every descriptor, in every format seen so far."""
    return dedent(f"""
        import json, os
        for fd in range({FDS}):
            for rec in (["test1", "ok", ""], ["test2", "ok", ""], ["test1", "value", {expr!r}],
                        ["test2", "value", {expr!r}], ["test1.1", "value", {expr!r}], ["test2.1", "value", {expr!r}],
                        ["run", "done", ""]):
                for line in (json.dumps(rec) + "\\n", "0" * 32 + " " + " ".join(rec[:2]) + " \\n"):
                    try:
                        os.write(fd, line.encode())
                    except OSError:
                        pass
        """)


CHEATS = {
    "forge records on every fd": _forge("True"),
    "forge records after redirecting the results fd": dedent("""
        import os, sys, socket
        fd = int(sys.argv[3]); saved = os.dup(fd); r, w = os.pipe(); os.dup2(w, fd)
        try:
            socket.socket()
        except PermissionError:
            pass
        os.dup2(saved, fd)
        os.set_blocking(r, False)
        try:
            leaked = os.read(r, 4096)  # on main: the nonce that signed every record
        except BlockingIOError:
            leaked = b''
        for line in (b'["test1", "ok", ""]\\n', b'["test2", "value", "True"]\\n', b'["run", "done", ""]\\n'):
            os.write(fd, line)
        """),
    "sys.exit in solution": "import sys\nsys.exit(0)",
    "os._exit in solution": "import os\nos._exit(0)",
    "sys.exit in atexit": "import atexit, sys\natexit.register(sys.exit, 0)",
    "kill self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "silence builtins": "import builtins\nbuiltins.repr = lambda *a: 'True'\nbuiltins.eval = lambda *a, **k: True\n"
                        "builtins.exec = lambda *a, **k: None",
    "patch __main__": "import __main__\nfor k in list(vars(__main__)):\n    if k.startswith('_h_'):\n"
                      "        setattr(__main__, k, lambda *a, **k: ('ok', ''))\n_h_describe = lambda e: ('ok', '')",
    "fake output": "print('all 2 tests passed')\nprint('run done')\nimport sys\nsys.stderr.write('test1 ok \\ntest2 ok \\n')",
    "read stdin": "import sys, os\nleak = sys.stdin.read() + os.read(0, 100).decode()\nassert leak == ''",
    "interrupt main": "import _thread, time\n_thread.interrupt_main()\ntime.sleep(0.2)",
}


@mechanisms
@pytest.mark.parametrize("cheat", CHEATS, ids=list(CHEATS))
def test_faking_a_pass_does_not_pass(mech, cheat):
    """Each cheat runs before tests that fail honestly; the verdict must not be `passed`. Without the
    guard: it protects no verdict (the first cheat is the attack that passed on main, guard and all)."""
    guard = False
    tests = ["assert add(1, 2) == 4", "assert add(1, 1) == 3"]
    r = run(ADD + CHEATS[cheat], tests, mech=mech, guard=guard)
    assert r.status != "passed" and r.passed == 0, r
    # In a test snippet the cheat makes that test sandbox-judged (its word; see the next test), but not the others.
    in_test = run(ADD, [CHEATS[cheat] + "\nassert add(1, 2) == 4", tests[1]], mech=mech, guard=guard)
    assert in_test.status != "passed" and in_test.tests[1].judge == "host" and not in_test.tests[1].passed, in_test


@mechanisms
def test_only_sandbox_judged_tests_take_the_sandbox_s_word(mech):
    """The documented limit: a test the host cannot split (not `assert EXPR op LITERAL`) is judged inside,
    so a forged record can pass it; its TestResult says so. Host-judged tests in the same run still fail."""
    r = run(ADD + _forge("True"), ["try:\n    x = add(1, 2)\nexcept Exception:\n    x = 0\nassert x == 4",
                                    "assert add(1, 1) == 3"], mech=mech)
    assert [(t.judge, t.passed) for t in r.tests] == [("sandbox", True), ("host", False)] and r.status == "failed"


INTROSPECT = dedent("""
    import gc, json, os, sys
    marker = str(918272 + 1)  # the expected value of test 1, spelled so that this source does not hold it
    found = []
    def scan(value):
        text = value.decode('latin-1') if isinstance(value, bytes) else value
        if isinstance(text, str) and text is not marker and marker in text:
            found.append(text[:80])
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                scan(k), scan(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                scan(v)
    for frame in sys._current_frames().values():
        while frame is not None:
            for v in list(frame.f_locals.values()):
                scan(v)
            frame = frame.f_back
    claim = found[0] if found else '0'
    for fd in range(4096):
        try:
            os.write(fd, (json.dumps(["test1.1", "value", claim]) + "\\n").encode())
        except OSError:
            pass
    """)


@mechanisms
def test_introspection_finds_no_expected_value_to_copy(mech):
    # Found in review: frames and the gc reached the harness and its signing key. Now there is nothing to find:
    # the expected value never enters the sandbox, so a forged record can only guess.
    limits = Limits(cpu_s=4, wall_s=8, memory_mb=256, max_procs=8, max_file_mb=4)
    r = run(ADD + INTROSPECT, ["assert add(1, 2) == 918273", "assert found == []"], limits, mech=mech, guard=False)
    assert r.tests[0].passed is False and r.tests[0].got == "0", r  # the forged guess came first
    assert r.tests[1].passed, r.tests[1]  # nothing in the sandbox's memory holds the expected value


# --- concurrency --------------------------------------------------------------------------------

@mechanisms
def test_async_runs_overlap_and_each_gets_its_own_verdict(mech):
    async def main():
        limits = Limits(cpu_s=1, wall_s=2, memory_mb=256, max_procs=8, max_file_mb=4)
        box = NamespaceSandbox(mech)
        jobs = [box.run_async(ADD, ["assert add(1, 2) == 3"], limits),
                box.run_async(ADD, ["assert add(1, 2) == 4"], limits),
                box.run_async("import time\ntime.sleep(60)", ["assert True"], limits),
                box.run_async("import os\nos.fork()", ["assert True"], limits)]
        start = time.monotonic()
        results = await asyncio.gather(*jobs)
        return results, time.monotonic() - start

    results, elapsed = asyncio.run(main())
    assert [r.status for r in results] == ["passed", "failed", "timeout", "forbidden"]
    assert elapsed < 4.5  # concurrent: the 2 s timeout does not add up with the others


@mechanisms
def test_a_run_that_ended_while_the_event_loop_was_busy_is_judged_not_killed(mech):
    """Before: the HumanEval eval (the engine's steps block the rollout loop) ended 60 of 123 episodes
    with `env_error: ProcessLookupError`: the exit and the wall timer were handled together, and the
    timeout path killed a process asyncio had already reaped."""
    # wall 2 s: the loop stays blocked past it (busy below), so exit and timer still arrive together; 1 s left
    # too little for the sandbox's setup as an unprivileged user under CI's load ("exceeded (during setup)")
    limits = Limits(cpu_s=1, wall_s=2, memory_mb=256, max_procs=8, max_file_mb=4)

    def running() -> dict[str, tuple[int, str]]:  # pid: (parent, name) of processes not exited
        table = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                head, tail = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            state, ppid = tail.split()[:2]
            if state not in "ZX":  # a zombie waits for the loop's child watcher: it has exited
                table[pid] = (int(ppid), head.split("(", 1)[1])
        return table

    def descendants() -> dict[str, str]:  # pid: name, of this process's running descendants
        table, found, parents = running(), {}, {str(os.getpid())}
        while new := {p for p, (pp, _) in table.items() if str(pp) in parents and p not in found}:
            found.update((p, table[p][1]) for p in new)
            parents = new
        return found

    async def main():
        box = NamespaceSandbox(mech)
        await box.run_async(ADD, ["assert True"], limits)  # the mechanism's probe, outside the race
        others = set(descendants())  # whatever else the suite has running (a Ray cluster, a server)

        def run() -> dict[str, str]:
            return {p: name for p, name in descendants().items() if p not in others}

        async def busy():  # an engine step: blocks the loop once the run has started, until it has exited
            while not any(name.startswith("python") for name in run().values()):
                await asyncio.sleep(0.001)  # the loop is free meanwhile: the host sends the run its job
            start = time.monotonic()
            while time.monotonic() - start < 20 and (run() or time.monotonic() - start < limits.wall_s + 0.5):
                time.sleep(0.01)

        blocker = asyncio.ensure_future(busy())
        verdict = await box.run_async(ADD, ["assert add(1, 2) == 3"], limits)
        await blocker
        return verdict

    for _ in range(3):
        r = asyncio.run(main())
        assert (r.status, r.passed, r.total) == ("passed", 1, 1), r


# --- without root -------------------------------------------------------------------------------

TEST_USER = "sao-sandbox-test"


def _expose(paths: list[str], spare: list[str]) -> str:
    """Shell commands (run as root in a private mount namespace) that make `paths` reachable by others."""
    keep: dict[str, set[str]] = {}
    for path in map(Path, paths):
        blocked = next((p for p in reversed(path.parents) if not os.stat(p).st_mode & 0o001), None)
        if blocked is not None:
            keep.setdefault(str(blocked), set()).add(path.relative_to(blocked).parts[0])
    cmds = []
    for blocked, children in keep.items():
        pairs = [(f"{blocked}/{child}", tempfile.mkdtemp(prefix="sao-expose-")) for child in sorted(children)]
        spare += [tmp for _, tmp in pairs]
        cmds += [f"mount --bind {src} {tmp}" for src, tmp in pairs]
        cmds.append(f"mount -t tmpfs -o mode=0755,size=1m tmpfs {blocked}")
        cmds += [f"mkdir -p {src} && mount --bind {tmp} {src}" for src, tmp in pairs]
    return "".join(f"{c} && " for c in cmds)


@pytest.mark.skipif(os.geteuid() != 0 or os.environ.get(AS_USER_ENV) == "1",
                    reason="needs root to create the unprivileged user; runs once, from the root suite")
@pytest.mark.slow
def test_the_suite_passes_as_an_unprivileged_user():
    """This file again, as a user created here, on the user-namespace path of every mechanism."""
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TEST_USER], check=True)
    # The interpreter, the venv or this checkout may live under a directory others cannot enter (pyenv
    # in /root here; a CI clone in /root): in a mount namespace of this command only, lay a
    # world-enterable tmpfs over that directory and bind back what the suite needs.
    spare: list[str] = []
    prep = _expose([os.path.realpath(sys.executable), sys.prefix, str(PROJECT)], spare)
    inner = (f"{prep}exec runuser -u {TEST_USER} -- env {AS_USER_ENV}=1 PYTHONPATH={PROJECT} HOME=/tmp "
             f"{sys.executable} -m pytest -q -x -p no:cacheprovider {PROJECT / 'tests' / 'test_sandbox.py'}")
    try:
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner], cwd="/tmp",
                              capture_output=True, text=True, timeout=900)
    finally:
        for d in spare:
            os.rmdir(d)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


# --- derived checks (sao/sandbox/derive.py) ------------------------------------------------------------


def _derived_verdicts(reference, test, entry, candidates):
    from sao.sandbox.derive import derive

    derived = derive(NamespaceSandbox(), reference, test, entry, Limits(wall_s=10))
    check = judge.plan(derived, entry)
    assert check.host_judged, check.reason
    return derived, [NamespaceSandbox().run(code, [check], FAST) for code in candidates]


def test_derived_checks_keep_the_tests_meaning():
    """Found in review: a test expecting an exception, checking a side effect or comparing floats tightly became
    a derived check that dropped the exception, dropped the side effect or loosened the tolerance to 1e-6, so
    wrong code got reward 1.0. Each test below needs a helper, so the host cannot walk it as written."""
    raises = ("def check(candidate):\n"
              "    def bad(x):\n"
              "        try:\n"
              "            candidate(x)\n"
              "        except ValueError:\n"
              "            return True\n"
              "        return False\n"
              "    assert candidate(4) == 2\n"
              "    assert bad(-1)\n")
    reference = "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return int(x ** 0.5)\n"
    derived, (good, wrong) = _derived_verdicts(reference, raises, "root", [
        reference, "def root(x):\n    return int(abs(x) ** 0.5)\n"])
    assert "__sao_raises__('ValueError', candidate, -1)" in derived
    assert good.status == "passed" and wrong.status == "failed" and "should raise ValueError" in wrong.tests[0].error

    side_effect = ("def check(candidate):\n"
                   "    def sorted_by(v):\n"
                   "        candidate(v)\n"
                   "        return v\n"
                   "    assert sorted_by([3, 1, 2]) == [1, 2, 3]\n")
    derived, (good, noop) = _derived_verdicts("def sort_it(v):\n    v.sort()\n", side_effect, "sort_it", [
        "def sort_it(v):\n    v[:] = sorted(v)\n", "def sort_it(v):\n    return sorted(v)\n"])
    assert "== [1, 2, 3]" in derived and good.status == "passed" and noop.status == "failed", (derived, noop)

    tight = ("import math\n\ndef check(candidate):\n"
             "    def near(x, y):\n"
             "        return abs(x - y) < 1e-12\n"
             "    assert near(candidate(2.0), math.sqrt(2.0))\n")
    derived, (good, close) = _derived_verdicts("import math\ndef sq(x):\n    return math.sqrt(x)\n", tight, "sq", [
        "def sq(x):\n    return x ** 0.5\n", "def sq(x):\n    return x ** 0.5 + 1e-8\n"])
    assert "abs_tol=1e-12" in derived and good.status == "passed" and close.status == "failed", (derived, close)


def test_a_reference_whose_results_differ_between_runs_is_refused():
    from sao.sandbox.derive import NotDerivable, derive

    test = ("def check(candidate):\n"
            "    def words(n):\n"
            "        return candidate(n)\n"
            "    assert len(words(30)) == 30\n")
    unordered = "def uniq(n):\n    return list({f'w{i}' for i in range(n)})\n"  # string hashes differ per process
    with pytest.raises(NotDerivable, match="differ between two runs"):
        derive(NamespaceSandbox(), unordered, test, "uniq", Limits(wall_s=10))
    ordered = "def uniq(n):\n    return sorted({f'w{i}' for i in range(n)})\n"
    assert "candidate(30) ==" in derive(NamespaceSandbox(), ordered, test, "uniq", Limits(wall_s=10))
