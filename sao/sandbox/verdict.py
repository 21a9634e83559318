"""From what a run left (result records, exit status, the host's own events) to its Verdict.

Every input here but the host's events (`wall`, `memory`, `results`) and the exit status comes from
the sandboxed process and is treated as its claim: a record can only say what value a test
expression had (judged on the host against a value it never saw) or report a failure against itself.
"""

from __future__ import annotations

import json
import signal

from sao.sandbox import judge
from sao.sandbox.protocol import TestResult, Verdict, one_line

RESULTS_CAP = 4 << 20  # bytes of result records read from one run; more kills it (sao/sandbox/namespace.py)

MAX_RECORD_CHARS = judge.MAX_VALUE_CHARS + 4096  # a longer line is not a record: ignored unread


def clean(text) -> str:
    """Valid Unicode (lone surrogates become '?'), whatever the sandbox sent: every string of a Verdict
    passes here, so no tokenizer or log downstream meets one it cannot encode."""
    try:
        return str(text).encode("utf-8", "replace").decode("utf-8")
    except Exception:  # noqa: BLE001 - a str subclass that lies about itself
        return "<unreadable>"


def parse_records(text: str) -> tuple[dict[str, tuple[str, str]], list[str], bool]:
    """Per-step (kind, text) (the first record of a step counts), forbidden actions, and whether the run ended.

    Total: a line that is too long, too deep, not JSON or not a [str, str, str] record is ignored,
    whatever exception reading it raises; a test whose record is ignored fails as "not run"."""
    steps, forbidden, done = {}, [], False
    for line in text.split("\n"):
        if len(line) > MAX_RECORD_CHARS or not line.startswith('["'):
            continue
        try:
            record = json.loads(line)
        except Exception:  # noqa: BLE001 - ValueError, RecursionError (a depth bomb), MemoryError, ...
            continue
        if not (type(record) is list and len(record) == 3 and all(type(x) is str for x in record)):
            continue
        step, kind, body = (clean(x) for x in record)
        if kind == "forbidden":
            forbidden.append(body)
        elif step == "run":
            done = done or kind == "done"
        else:
            steps.setdefault(step, (kind, body))
    return steps, forbidden, done


def test_results(checks: list[judge.Check], steps: dict) -> tuple[TestResult, ...]:
    out = []
    for i, check in enumerate(checks):
        if check.host_judged:
            results = [steps.get(f"test{i + 1}.{j + 1}", ("missing", "was not run")) for j in range(len(check.calls))]
            ok, error, got = judge.judge(check, results)
            out.append(TestResult(i + 1, ok, "host", None if got is None else clean(got), clean(one_line(error))))
            continue
        kind, body = steps.get(f"test{i + 1}", ("missing", "not run"))
        if kind == "ok":
            out.append(TestResult(i + 1, True, "sandbox"))
        else:
            error = body if kind in ("fail", "memory", "missing") else "no result"
            out.append(TestResult(i + 1, False, "sandbox", None, one_line(error)))
    return tuple(out)


def build_verdict(run, records: str, output: str, returncode: int | None, events: set, duration: float) -> Verdict:
    """The run's Verdict; always one, whatever the sandbox wrote (sao/sandbox/__init__.py, threat model)."""
    output = clean(output)
    try:
        steps, forbidden, done = parse_records(records)
        tests = test_results(run.checks, steps)
        status, reason = _classify(run, tests, steps, forbidden, done, returncode, events, output)
        loaded = next((f"{name}: {one_line(steps[name][1])}" for name in ("setup", "solution")
                       if steps.get(name, ("ok",))[0] != "ok"), "")
    except Exception as e:  # noqa: BLE001 - a host bug on odd records still gives a verdict, not an env error
        tests = tuple(TestResult(i + 1, False, "host" if c.host_judged else "sandbox", None, "not judged")
                      for i, c in enumerate(run.checks))
        status, reason, loaded = "crashed", clean(one_line(f"the run's records could not be read: {type(e).__name__}")), ""
    return Verdict(status, clean(reason), tests, output, run.layers, round(duration, 3), clean(loaded), vars(run.limits))


def _classify(run, tests, steps, forbidden, done, returncode, events, output) -> tuple[str, str]:
    lim, total = run.limits, len(run.checks)
    sig = -returncode if returncode is not None and returncode < 0 else (
        returncode - 128 if returncode is not None and returncode > 128 else 0)
    expected = run.step_names
    missing = next((s for s in expected if s not in steps), None)
    if forbidden:
        return "forbidden", f"forbidden: {forbidden[0]}"
    if "wall" in events:
        return "timeout", f"wall-clock limit of {lim.wall_s:g} s exceeded" + _during(missing)
    if sig == signal.SIGXCPU:
        return "timeout", f"CPU time limit of {lim.cpu_s:g} s exceeded" + _during(missing)
    memory_step = next((s for s in expected if steps.get(s, ("",))[0] == "memory"), None)
    if "memory" in events or memory_step or (missing and "MemoryError" in output):
        return "memory", f"memory limit of {lim.memory_mb} MB exceeded" + _during(memory_step or missing)
    if "results" in events:
        return "crashed", f"the program wrote more than {run_cap_mb()} MB of result records"
    if sig == signal.SIGXFSZ:
        return "crashed", f"file size limit of {lim.max_file_mb} MB exceeded (SIGXFSZ)" + _during(missing)
    if steps.get("setup", ("ok",))[0] != "ok":
        return "crashed", f"the setup code failed: {one_line(steps['setup'][1])}"
    if missing or not done:
        how = f"was killed by {signal.Signals(sig).name}" if sig in set(signal.Signals) else (
            f"exited with code {returncode}")
        hint = "" if missing is None or returncode else " (sys.exit/os._exit do not pass tests)"
        first = output.strip().splitlines()[:1] if steps.get("setup") is None else []
        return "crashed", f"the program {how} before reporting {_title(missing or 'its end')}{hint}" + (
            f": {one_line(first[0])}" if first else "")
    if steps["solution"][0] != "ok":
        return "failed", f"the solution failed: {one_line(steps['solution'][1])}" + _limit_hint(steps["solution"][1], lim)
    bad = [t for t in tests if not t.passed]
    if not bad:
        return "passed", f"all {total} tests passed"
    return "failed", f"{len(bad)} of {total} tests failed; first: test {bad[0].index}: {bad[0].error}" + _limit_hint(
        bad[0].error, lim)


def _limit_hint(error: str, lim) -> str:
    """Limits that surface as an exception inside rather than a kill: say which."""
    if error.startswith("BlockingIOError: [Errno 11]"):
        return f" (process limit of {lim.max_procs} reached)"
    if "No space left on device" in error:
        return f" (the sandbox's {4 * lim.max_file_mb} MB of disk are full)"
    return ""


def run_cap_mb() -> int:
    return RESULTS_CAP >> 20


def _title(step: str) -> str:
    return f"test {step[4:].split('.')[0]}" if step.startswith("test") else step


def _during(step: str | None) -> str:
    return f" (during {_title(step)})" if step else ""
