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

import ast
from typing import Any

from sao.sandbox import hosteval, judge
from sao.sandbox.protocol import DEFAULT_LIMITS, Limits

CHUNK = 60_000  # characters of the recorded trace per sandbox value (values are capped at 65,536)
MAX_CHUNKS = 16
MAX_CALLS = 2_000

_RECORDER = '''

def __sao_trace__(_test, _entry, _chunk, _size):
    _g = globals()
    if "__sao_text__" not in _g:
        import random
        random.seed(0)
        _fn, _calls = _g[_entry], []

        def candidate(*args, **kwargs):
            _before = repr((args, kwargs))
            try:
                _result = _fn(*args, **kwargs)
            except Exception as _e:
                _calls.append((_before, None, type(_e).__name__, repr((args, kwargs))))
                raise
            _calls.append((_before, repr(_result), None, repr((args, kwargs))))
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


def tolerances(test: str) -> tuple[float, float]:
    """(rel_tol, abs_tol) the test itself uses for floats: the smallest of its `isclose(...)` tolerances
    (rel_tol 1e-09 when it gives none) and of its `abs(a - b) < eps` bounds; (0, 0): it compares exactly."""
    rel, absolute = [], []
    for node in ast.walk(ast.parse(test)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "isclose":
            given = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
            rel.append(float(given.get("rel_tol", 1e-9)))
            if "abs_tol" in given:
                absolute.append(float(given["abs_tol"]))
        bounded = isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Lt, ast.LtE))
        if bounded and isinstance(node.left, ast.Call) and \
                (getattr(node.left.func, "id", None) or getattr(node.left.func, "attr", None)) in ("abs", "fabs"):
            bound = node.comparators[0]
            if isinstance(bound, ast.Constant) and type(bound.value) in (int, float):
                absolute.append(float(bound.value))
    return (min(rel) if rel else 0.0), (min(absolute) if absolute else 0.0)


def _trace(sandbox: Any, reference: str, test: str, entry: str, limits: Limits) -> list:
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
    return trace


def derive(sandbox: Any, reference: str, test: str, entry: str, limits: Limits = DEFAULT_LIMITS) -> str:
    """A host-judged check with the calls the reference made while passing `test`: their results, the
    exceptions they raised, what they did to their arguments; float results compared with the test's own
    tolerance. The reference runs twice (two processes, two hash seeds): results that differ between the
    runs (set or dict order, time) are refused, since correct code would then fail at random."""
    trace = _trace(sandbox, reference, test, entry, limits)
    if _trace(sandbox, reference, test, entry, limits) != trace:
        raise NotDerivable("the reference's calls or results differ between two runs (set or hash order, time, "
                           "unseeded randomness): a derived check would fail correct code at random")
    rel, absolute = tolerances(test)
    lines: list[str] = []
    for n, (before_text, result_text, raised, after_text) in enumerate(trace[:MAX_CALLS]):
        before, after = hosteval.parse_value(before_text), hosteval.parse_value(after_text)
        result = None if raised else hosteval.parse_value(result_text)
        if any(isinstance(v, hosteval.CallError) for v in (before, after, result)):
            raise NotDerivable("an argument or result of the reference is not plain data")
        (args, kwargs), (args_after, kwargs_after) = before, after
        changed = [i for i, (a, b) in enumerate(zip(args, args_after)) if a != b]
        if kwargs != kwargs_after or (changed and raised):
            raise NotDerivable("the reference changes a keyword argument, or an argument of a call that raises: "
                               "the host cannot check that side effect")
        names = {i: f"__arg{n}_{i}" for i in changed}
        lines += [f"    {names[i]} = {hosteval.to_source(args[i])}" for i in changed]
        parts = [names.get(i) or hosteval.to_source(a) for i, a in enumerate(args)]
        parts += [f"{k}={hosteval.to_source(v)}" for k, v in kwargs.items()]
        call = f"candidate({', '.join(parts)})"
        if raised:
            lines.append(f"    assert {hosteval.RAISES}({raised!r}, candidate{''.join(', ' + p for p in parts)})")
            continue
        expected = hosteval.to_source(result)
        if type(result) is float and (rel or absolute):
            lines.append(f"    assert math.isclose({call}, {expected}, rel_tol={rel!r}, abs_tol={absolute!r})")
        else:
            lines.append(f"    assert {call} == {expected}")
        lines += [f"    assert {names[i]} == {hosteval.to_source(args_after[i])}" for i in changed]
    derived = "import math\n\n\ndef check(candidate):\n" + "\n".join(lines) + "\n"
    check = judge.plan(derived, entry)
    if not check.host_judged:
        raise NotDerivable(f"the derived check is not host-judged: {check.reason}")
    return derived
