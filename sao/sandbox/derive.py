"""Host-judged tests from a reference solution, for tests the host cannot walk itself.

Some tests compute their inputs or check their results with helpers of the task (HumanEval/38
`assert candidate(encode_cyclic(s)) == s`, HumanEval/32 `assert fabs(poly(coeffs, candidate(c))) < 1e-4`).
Run in the sandbox as they are, their outcome would be the code's own word: the code under test can
redefine `encode_cyclic` or `poly`. Instead the *reference* solution runs the test once in the
sandbox, with the entry point wrapped to record every call (its arguments, before the call, and its
result); `random` is seeded, so the inputs are fixed. The recorded calls become a host-judged check,

    def check(candidate):
        assert candidate('abc') == 'bca'
        assert math.isclose(candidate([1, 2]), -0.5, rel_tol=1e-06, abs_tol=1e-06)

that the host walks like any other (sao/sandbox/judge.py). It is stricter than the original where
that accepted several answers (HumanEval/32 accepts any root: the derived check wants the
reference's, to 1e-6): a correct solution that finds another root fails. Only trusted reference
code runs here; the code under test never sees the recorded values.
"""

from __future__ import annotations

from typing import Any

from sao.sandbox import hosteval, judge
from sao.sandbox.protocol import DEFAULT_LIMITS, Limits

CHUNK = 60_000  # characters of the recorded trace per sandbox value (values are capped at 65,536)
MAX_CHUNKS = 16
MAX_CALLS = 2_000
FLOAT_TOL = 1e-6  # rel_tol and abs_tol of a derived float comparison

_RECORDER = '''

def __sao_trace__(_test, _entry, _chunk, _size):
    _g = globals()
    if "__sao_text__" not in _g:
        import random
        random.seed(0)
        _fn, _calls = _g[_entry], []

        def candidate(*args, **kwargs):
            _args = repr((args, kwargs))
            _result = _fn(*args, **kwargs)
            _calls.append((_args, repr(_result)))
            return _result

        _ns = dict(_g)
        _ns[_entry] = candidate
        exec(compile(_test, "<test>", "exec", optimize=0), _ns)
        if callable(_ns.get("check")):
            _ns["check"](candidate)
        _g["__sao_text__"] = repr(_calls)
    return _g["__sao_text__"][_chunk * _size:(_chunk + 1) * _size]
'''


class NotDerivable(ValueError):
    """The reference cannot turn this test into a host-judged one (the reason is one line)."""


def derive(sandbox: Any, reference: str, test: str, entry: str, limits: Limits = DEFAULT_LIMITS) -> str:
    """A host-judged check with the calls the reference made while passing `test`, and its results."""
    exprs = [f"__sao_trace__({test!r}, {entry!r}, {k}, {CHUNK})" for k in range(MAX_CHUNKS)]
    verdict, results = sandbox.evaluate(reference + _RECORDER, exprs, limits)
    if verdict.solution_error:
        raise NotDerivable(f"the reference solution does not load: {verdict.solution_error}")
    kind, text = results[0]
    if kind != "value":
        raise NotDerivable(f"the reference solution fails the test: {text}")
    chunks = [hosteval.parse_value(t) if k == "value" else "" for k, t in results]
    trace = hosteval.parse_value("".join(c for c in chunks if isinstance(c, str)))
    if not isinstance(trace, list) or not trace:
        raise NotDerivable("the test made no call of the entry point (or its trace is too long)")
    lines, seen = [], set()
    for args_text, result_text in trace[:MAX_CALLS]:
        call, result = hosteval.parse_value(args_text), hosteval.parse_value(result_text)
        if isinstance(call, hosteval.CallError) or isinstance(result, hosteval.CallError):
            raise NotDerivable("an argument or result of the reference is not plain data")
        args, kwargs = call
        source = ", ".join([hosteval.to_source(a) for a in args] + [f"{k}={hosteval.to_source(v)}"
                                                                     for k, v in kwargs.items()])
        if source in seen:
            continue
        seen.add(source)
        expected = hosteval.to_source(result)
        if type(result) is float:
            lines.append(f"    assert math.isclose(candidate({source}), {expected}, rel_tol={FLOAT_TOL}, "
                         f"abs_tol={FLOAT_TOL})")
        else:
            lines.append(f"    assert candidate({source}) == {expected}")
    derived = "import math\n\n\ndef check(candidate):\n" + "\n".join(lines) + "\n"
    check = judge.plan(derived, entry)
    if not check.host_judged:
        raise NotDerivable(f"the derived check is not host-judged: {check.reason}")
    return derived
