"""The host-side judge: which part of a test the sandbox may see, and the comparison it may not.

A test `assert EXPR <op> LITERAL` (also `LITERAL == EXPR`, `assert EXPR`, `assert not EXPR`,
`assert EXPR is None`) is split: only EXPR goes into the sandbox, which returns `repr(value)`; the
host parses that with `ast.literal_eval` (data only, nothing runs) and applies `<op>` against the
LITERAL it kept. Code in the sandbox can make EXPR return anything, but it never sees the expected
value, so it passes only by returning it, which is what the test asks for. A value that is not a
Python literal (an object with a custom `__eq__`, a generator) fails: the host compares data, not
objects. Anything else (several statements, `assert f(x) == g(y)`) is a *sandbox-judged* test: it
runs whole inside and its outcome is the sandbox's word (`TestResult.judge == "sandbox"`).
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any

MAX_VALUE_CHARS = 65536  # a longer repr is not parsed: the test fails ("value too large")
_OPS = {ast.Eq: ("==", operator.eq), ast.NotEq: ("!=", operator.ne), ast.Lt: ("<", operator.lt),
        ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt), ast.GtE: (">=", operator.ge),
        ast.In: ("in", lambda a, b: a in b), ast.NotIn: ("not in", lambda a, b: a not in b),
        ast.Is: ("is", operator.is_), ast.IsNot: ("is not", operator.is_not)}
_SYMMETRIC = (ast.Eq, ast.NotEq)
_NO_VALUE = object()
_FLOAT_WORDS = ("inf", "-inf", "nan")  # float reprs that are not literals


@dataclass(frozen=True)
class Check:
    """How one test is judged. `expr` (host-judged) or `source` (sandbox-judged) enters the sandbox."""

    source: str
    expr: str | None = None  # None: sandbox-judged
    op: str = ""  # "==", ..., "truthy", "falsy"
    expected: Any = _NO_VALUE  # stays on the host

    @property
    def host_judged(self) -> bool:
        return self.expr is not None


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_VALUE


def plan(test: str) -> Check:
    """The Check for one test snippet."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return Check(test)  # the sandbox reports the syntax error
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return Check(test)
    cond = tree.body[0].test
    if isinstance(cond, ast.Compare) and len(cond.ops) == 1 and type(cond.ops[0]) in _OPS:
        op, left, right = type(cond.ops[0]), cond.left, cond.comparators[0]
        expected = _literal(right)
        if expected is _NO_VALUE and op in _SYMMETRIC:
            left, right, expected = right, left, _literal(left)
        if expected is _NO_VALUE or (op in (ast.Is, ast.IsNot) and expected not in (None, True, False)):
            return Check(test)
        return Check(test, ast.unparse(left), _OPS[op][0], expected)
    if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not):
        return Check(test, ast.unparse(cond.operand), "falsy")
    return Check(test, ast.unparse(cond), "truthy")


def judge(check: Check, got_repr: str) -> tuple[bool, str]:
    """(passed, error) for the repr the sandbox returned for `check.expr`."""
    if len(got_repr) > MAX_VALUE_CHARS:
        return False, f"value too large ({len(got_repr)} characters)"
    try:
        got = float(got_repr) if got_repr in _FLOAT_WORDS else ast.literal_eval(got_repr)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, f"got {_short(got_repr)}, which is not a plain value (a literal)"
    try:
        if check.op == "truthy":
            ok = bool(got)
        elif check.op == "falsy":
            ok = not got
        else:
            ok = bool(dict(_OPS.values())[check.op](got, check.expected))
    except (TypeError, ValueError, RecursionError):
        ok = False
    return ok, "" if ok else f"got {_short(got_repr)}"


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
