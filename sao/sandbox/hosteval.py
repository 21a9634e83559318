"""The host's half of a test: a small interpreter that runs a test's asserts over plain values.

A test program (one `assert`, a few statements, or HumanEval's `def check(candidate): ...`) is run
here, in the trainer's process, with the host's own objects and functions: every comparison,
`and`/`or`/`not`, `all`/`any`, `abs(a - b) < eps` and `math.isclose` is the host's. The only things
the sandbox supplies are the values of *sandbox calls*: the entry point (or another name the host
does not know) called with arguments the host computed itself. Such a call is sent in as source
text with literal arguments (`f(3, [1, 2])`); the sandbox returns `repr(value)`; the host parses it
as data (`parse_value`: literals only, nothing runs) and goes on. A value that is not plain data
fails its test, so a returned object's `__eq__`, `__sub__` or `__bool__` never runs anywhere.

Two passes over the same program:
- `collect(program)` (at plan time) runs it with every sandbox value unknown (`PENDING`, which
  every operation propagates; a branch, `and`/`or` or comparison chain whose deciding value is the
  host's own is taken exactly as the run will take it; only one decided by a sandbox value visits
  both sides; a loop over an unknown value runs its body once) and lists the calls the sandbox must
  evaluate, every occurrence its own evaluation, in order (a function whose result changes between
  calls, a generator, a counter, is judged call by call). A call whose arguments depend on a sandbox
  value (`f(f(1))`, `g(f(1))`) cannot be planned: the test is not host-judged.
- `run(program, values)` (after the sandbox run) executes it for real with those values, matching
  each call it reaches to the next planned evaluation of the same call.

What a call does to its arguments is seen: for every argument that is a list, dict or set, the
sandbox returns it as it is after the call, and the host updates its own object in place, so
`x = [3, 1, 2]; f(x); assert x == [1, 2, 3]` judges what `f` did to `x`.
  Without an entry point (generated tasks), the first name the host does not know is the function
  under test; a second one (`assert f(1) == g(1)`, `assert f(1) == EXPECTED`) would let the code under
  test define what the test compares against, so such a test is not host-judged.
  A call first reached in `run` (not possible for the forms above: their arguments are the host's
  own values, found in both passes) fails its test as "not evaluated in the sandbox". What remains
  of the two passes' difference is refused, not guessed: a sandbox call or a `random` draw in code that
  a sandbox value decides whether (or how often) the run reaches (a branch, the operands after an
  `and`/`or` or a comparison chain, a loop over a sandbox value) makes the test not host-judged, since
  its evaluations could not be planned in the run's order; no HumanEval test does this.

What the host runs is bounded: node count, CPU time (`MAX_HOST_CPU_S` per test, of the judging
thread), sizes of sequences, ranges, powers and shifts, so a value from the sandbox (a 65,536-character
string, a huge int, many small nodes) cannot make the host do unbounded work; the judging runs off the
event loop (sao/sandbox/namespace.py), so it never stalls the rollout worker's other episodes. Every
exception here fails the test; none escapes `run`.
"""

from __future__ import annotations

import ast
import contextlib
import copy as _copy
import functools
import math
import operator
import random as _random
import string as _string
import time
from dataclasses import dataclass
from typing import Any

MAX_VALUE_CHARS = 65536  # a longer repr is not parsed: the test fails ("value too large")
MAX_NODES = 200_000  # expression nodes one test may evaluate on the host
MAX_HOST_CPU_S = 1.0  # CPU seconds (of the judging thread) one test may take on the host
MAX_LEN = 1_000_000  # items of a sequence, range or string the host builds
MAX_BITS = 1_000_000  # bits of an int the host computes by ** or <<
RANDOM_SEED = 0  # `import random` in a test gives a host Random with this seed, in both passes
RAISES = "__sao_raises__"  # the host's check of an expected exception (derived checks)


class NotHostJudged(Exception):
    """The test has a form the host cannot judge (the reason is one line, for the user)."""


class TestFailed(Exception):
    """An assert failed, or the host could not evaluate it; the message is for the policy."""


class _Pending:
    __slots__ = ()

    def __repr__(self) -> str:
        return "PENDING"


PENDING = _Pending()


@dataclass(frozen=True)
class CallError:
    """A sandbox call that gave no plain value: it raised, or returned something that is not data."""

    message: str


@dataclass(frozen=True)
class SandboxRef:
    """A name the host does not know: it lives in the sandbox (the entry point, `candidate`)."""

    name: str


@dataclass(frozen=True)
class Program:
    statements: tuple[ast.stmt, ...]
    bindings: tuple[tuple[str, str], ...]  # (name, sandbox name): `candidate` -> the entry point
    callables: frozenset[str] | None  # sandbox names allowed; None: any name the host does not know


# ---------------------------------------------------------------- what the host knows

_BUILTINS = {f.__name__: f for f in (abs, all, any, bool, chr, dict, divmod, enumerate, float, frozenset, int,
                                     isinstance, len, list, max, min, ord, range, reversed, round, set, sorted, str, sum,
                                     tuple, type, zip)}
_MODULES = {
    "math": {name: getattr(math, name) for name in ("isclose", "fabs", "floor", "ceil", "sqrt", "trunc", "isnan",
                                                    "isinf", "isfinite", "gcd", "pi", "e", "inf", "nan", "log",
                                                    "exp", "prod", "comb")},
    "string": {name: getattr(_string, name) for name in ("ascii_lowercase", "ascii_uppercase", "ascii_letters",
                                                         "digits", "punctuation", "hexdigits", "whitespace")},
    "copy": {"copy": _copy.copy, "deepcopy": _copy.deepcopy},
    "random": None,  # a seeded instance per pass (`_random_module`)
}
_RANDOM_NAMES = ("randint", "choice", "random", "uniform", "randrange", "shuffle", "sample", "seed", "Random")
_PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range)
_METHODS = {  # side-effect-free methods of plain values (no `replace`/`join`: their size is not checked first)
    str: {"lower", "upper", "strip", "lstrip", "rstrip", "split", "count", "startswith", "endswith", "isdigit",
          "isalpha", "isupper", "islower", "find", "index", "title", "capitalize", "swapcase"},
    list: {"count", "index", "copy"}, tuple: {"count", "index"},
    dict: {"keys", "values", "items", "get", "copy"}, set: {"issubset", "issuperset", "union", "intersection"},
    _random.Random: {"randint", "choice", "random", "uniform", "randrange", "shuffle", "sample"},
}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert, ast.Not: operator.not_}


class _Module(dict):
    """A module as the host offers it to a test: a few names, nothing else."""


def _random_module() -> _Module:
    rng = _random.Random(RANDOM_SEED)
    names = _Module({name: getattr(rng, name) for name in _RANDOM_NAMES if name not in ("Random", "seed")})
    names["Random"] = _random.Random
    return names


# ---------------------------------------------------------------- plain values: host <-> sandbox


def parse_value(text: str) -> Any:
    """The plain value a repr stands for (literals, `set()`, `inf`/`nan`), or CallError. Total."""
    if len(text) > MAX_VALUE_CHARS:
        return CallError(f"returned a value too large to judge ({len(text)} characters)")
    try:
        return _data(ast.parse(text.strip(), mode="eval").body)
    except Exception:  # noqa: BLE001 - any failure to read a value is a failed test, never an error
        return CallError(f"returned {_short(text)}, which is not plain data (a literal)")


def _data(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in _PLAIN:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_data(e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_data(k): _data(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _data(node.operand)
        if type(value) in (int, float, complex):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):  # complex: 1+2j
        left, right = _data(node.left), _data(node.right)
        if type(left) in (int, float) and type(right) is complex:
            return left + right if isinstance(node.op, ast.Add) else left - right
    if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
        return float(node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords and len(node.args) <= 1:
        maker = {"set": set, "frozenset": frozenset, "float": float}.get(node.func.id)
        arg = _data(node.args[0]) if node.args else ()
        if maker is float and arg in ("inf", "-inf", "nan"):
            return float(arg)
        if maker in (set, frozenset) and type(arg) in (list, tuple, set):
            return maker(arg)
    raise ValueError("not plain data")


def to_source(value: Any, depth: int = 0) -> str:
    """Source text that rebuilds a plain value in the sandbox (the arguments of a sandbox call)."""
    if depth > 50:
        raise NotHostJudged("an argument is nested too deeply")
    kind = type(value)
    if kind is float and not math.isfinite(value):
        return f"float({str(value)!r})"
    if kind in (type(None), bool, int, float, complex, str, bytes):
        return repr(value)
    if kind in (list, tuple):
        inner = ", ".join(to_source(v, depth + 1) for v in value)
        return f"[{inner}]" if kind is list else f"({inner}{',' if len(value) == 1 else ''})"
    if kind is dict:
        return "{" + ", ".join(f"{to_source(k, depth + 1)}: {to_source(v, depth + 1)}" for k, v in value.items()) + "}"
    if kind in (set, frozenset):
        return f"{kind.__name__}([{', '.join(to_source(v, depth + 1) for v in value)}])"
    raise NotHostJudged(f"an argument is a {kind.__name__}, not plain data")


def _short(text: str, limit: int = 120) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- planning


def program_of(test: str, entry: str | None = None) -> Program:
    """The host program of one test snippet; NotHostJudged with the reason when it has another form."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise NotHostJudged(f"the test does not parse ({type(e).__name__})") from None
    callables = frozenset([entry]) if entry else None
    checks = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if checks:  # HumanEval style: module constants, then `def check(candidate)`, which the host walks
        check = checks[0]
        params = [a.arg for a in check.args.args]
        if entry is None or len(params) != 1 or check.args.vararg or check.args.kwonlyargs or check.decorator_list:
            raise NotHostJudged("check(candidate) needs the task's entry point and exactly one parameter")
        top = [s for s in tree.body if s is not check]
        if any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for s in top):
            raise NotHostJudged("the test defines functions besides check")
        return Program(tuple(top) + tuple(check.body), ((params[0], entry),), callables)
    return Program(tuple(tree.body), (), callables)


def collect(program: Program) -> list[str]:
    """The sandbox evaluations the program needs, one per call it makes, in order: source text with
    literal arguments (a call with list, dict or set arguments also returns them as they are after it)."""
    interp = _Interpreter(program, None)
    interp.execute()
    if not any(isinstance(s, ast.Assert) for s in program.statements) and not interp.asserted:
        raise NotHostJudged("the test has no assert")
    return list(interp.calls)


def run(program: Program, calls: list[str], values: list[Any]) -> tuple[bool, str, str | None]:
    """(passed, error, got): the program run for real over the sandbox's values (`values[k]` of the
    evaluation `calls[k]`, as `collect` listed them). Never raises."""
    interp = _Interpreter(program, values)
    interp.planned = list(calls)
    try:
        interp.execute()
        return True, "", interp.last_got
    except TestFailed as e:
        return False, str(e), interp.last_got
    except Exception as e:  # noqa: BLE001 - a host limit, an unexpected form: the test fails
        return False, _short(f"the host could not evaluate the test: {type(e).__name__}: {e}", 200), interp.last_got


class _Interpreter:
    """Runs a Program: collect mode (`values is None`) or judge mode."""

    def __init__(self, program: Program, values: list[Any] | None):
        self.program, self.values, self.collecting = program, values, values is None
        self.fails_short: ast.AST | None = None
        self.undecided = 0  # collect: inside code whose walk a sandbox value decides (a branch, a loop's length)
        self.env: dict[str, Any] = {name: SandboxRef(target) for name, target in program.bindings}
        self.calls: list[str] = []  # collect: every evaluation, in order
        self.planned: list[str] = []  # run: the collected evaluations (Program-derived, the same texts)
        self.next_call = 0  # run: the first planned evaluation not used yet
        self.unknown: list[str] = []  # names the host does not know (callables None: the first is the function)
        self.nodes, self.asserted = 0, False
        self.cpu_from = time.thread_time()
        self.used: list[tuple[str, Any]] = []  # sandbox calls of the current assert, for the message
        self.last_got: str | None = None

    # statements ---------------------------------------------------------------------------------
    def execute(self) -> None:
        self.block(self.program.statements)

    def block(self, statements) -> None:
        for statement in statements:
            self.statement(statement)

    def statement(self, s: ast.stmt) -> None:
        if isinstance(s, ast.Assert):
            self.asserted = True
            self.fails_short = s.test  # `assert a and b`, `assert a < b < c`: stopping early fails the assert
            value = self.expr(s.test)
            if value is PENDING or self.collecting:
                return
            if not _truth(value):
                raise TestFailed(self.explain())
            self.used = []  # the calls since the last passing assert explain the next failure
        elif isinstance(s, ast.Assign):
            value = self.expr(s.value)
            for target in s.targets:
                self.bind(target, value)
        elif isinstance(s, ast.For) and not s.orelse:
            items = self.expr(s.iter)
            with self.deciding(items is PENDING):  # a loop over a sandbox value: how often its body runs
                for item in self.iterate(items):
                    self.bind(s.target, item)
                    self.block(s.body)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            self.imports(s)
        elif isinstance(s, ast.Expr) and isinstance(s.value, (ast.Constant, ast.Name)):
            return  # a docstring, or a bare `print`
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
            self.expr(s.value)  # a call for what it does (to its arguments, to the function's state)
        elif not isinstance(s, ast.Pass):
            raise NotHostJudged(f"line {s.lineno}: {type(s).__name__} statements are not judged on the host")

    def imports(self, s) -> None:
        if isinstance(s, ast.Import):
            for alias in s.names:
                self.env[alias.asname or alias.name] = self.module(alias.name)
            return
        module = self.module(s.module or "")
        for alias in s.names:
            if alias.name not in module:
                raise NotHostJudged(f"the host has no {s.module}.{alias.name}")
            self.env[alias.asname or alias.name] = module[alias.name]

    def module(self, name: str) -> dict:
        if name not in _MODULES:
            raise NotHostJudged(f"the test imports {name}, which the host does not evaluate")
        return _random_module() if name == "random" else _Module(_MODULES[name])

    def bind(self, target: ast.AST, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)) and not any(isinstance(e, ast.Starred) for e in target.elts):
            items = [PENDING] * len(target.elts) if value is PENDING else list(self.iterate(value))
            if len(items) != len(target.elts):
                raise TestFailed(f"cannot unpack {len(items)} values into {len(target.elts)}")
            for t, v in zip(target.elts, items):
                self.bind(t, v)
        else:
            raise NotHostJudged(f"assignment to {type(target).__name__} is not judged on the host")

    def iterate(self, items):
        if items is PENDING:
            return [PENDING]  # collect mode: the body once, with what it binds unknown
        if not isinstance(items, (list, tuple, str, set, frozenset, range, bytes, dict)) or isinstance(items, _Module):
            raise TestFailed(f"cannot iterate over {type(items).__name__}")
        if len(items) > MAX_LEN:
            raise TestFailed("a loop of the test is too long for the host")
        return list(items)

    # expressions --------------------------------------------------------------------------------
    def expr(self, node: ast.AST) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise TestFailed("the test's evaluation on the host exceeded its budget")
        if not self.nodes & 255 and time.thread_time() - self.cpu_from > MAX_HOST_CPU_S:
            raise TestFailed(f"the test's evaluation on the host took over {MAX_HOST_CPU_S:g} s of CPU")
        method = getattr(self, f"e_{type(node).__name__}", None)
        if method is None:
            raise NotHostJudged(f"{type(node).__name__} expressions are not judged on the host")
        try:
            return method(node)
        except (NotHostJudged, TestFailed):
            raise
        except Exception as e:  # noqa: BLE001 - the host's own operation failed on these values
            if self.collecting:
                return PENDING
            raise TestFailed(self.explain(f"{type(e).__name__}: {_short(e, 80)}")) from None

    def e_Constant(self, node):
        return node.value

    def e_Name(self, node):
        if node.id in self.env:
            value = self.env[node.id]
        elif node.id in _BUILTINS:
            value = _BUILTINS[node.id]
        elif node.id in _MODULES:  # `math.isclose` in a test whose solution imported math
            value = self.env[node.id] = self.module(node.id)
        elif self.program.callables is None or node.id in self.program.callables:
            if self.program.callables is None and node.id not in self.unknown:
                self.unknown.append(node.id)
                if len(self.unknown) > 1:  # a second unknown name would let the code define the expected value
                    raise NotHostJudged(f"the test uses {self.unknown[0]} and {node.id}, names the host does not "
                                        "know: only the function under test may come from the sandbox")
            value = SandboxRef(node.id)
        else:
            raise NotHostJudged(f"the test uses {node.id}, which is neither the entry point nor known to the host")
        if isinstance(value, SandboxRef) and not isinstance(getattr(node, "_sao_parent", None), ast.Call):
            return self.sandbox_call(value.name, value.name)  # a bare name: its value, from the sandbox
        return value

    def e_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == RAISES:
            return self.raises(node)
        if isinstance(node.func, ast.Name):
            node.func._sao_parent = node  # a name that is called, not read
        func = self.expr(node.func)
        args = self.items(node.args)
        kwargs = {}
        for k in node.keywords:
            if k.arg is None:
                raise NotHostJudged("**kwargs in a call are not judged on the host")
            kwargs[k.arg] = self.expr(k.value)
        if isinstance(func, SandboxRef):
            if any(_has_pending(v) for v in args + list(kwargs.values())):
                raise NotHostJudged(f"the arguments of {func.name}(...) depend on a value from the sandbox")
            parts = [to_source(a) for a in args] + [f"{k}={to_source(v)}" for k, v in kwargs.items()]
            source = f"{func.name}({', '.join(parts)})"
            mutable = [i for i, a in enumerate(args) if type(a) in (list, dict, set)]
            mutable_kw = [k for k, v in kwargs.items() if type(v) in (list, dict, set)]
            if not mutable and not mutable_kw:
                return self.sandbox_call(source, source)
            # the call, then its list/dict/set arguments as they are after it: (result, {position: value})
            positional = "(" + "".join(to_source(a) + ", " for a in args) + ")"
            named = "{" + ", ".join(f"{k!r}: {to_source(v)}" for k, v in kwargs.items()) + "}"
            keep = ", ".join([f"{i}: __a[{i}]" for i in mutable] + [f"{k!r}: __k[{k!r}]" for k in mutable_kw])
            evaluation = (f"(lambda __a, __k: (lambda __r: (__r, {{{keep}}}))({func.name}(*__a, **__k)))"
                          f"({positional}, {named})")
            got = self.sandbox_call(source, evaluation)
            if got is PENDING:
                return PENDING
            if not (type(got) is tuple and len(got) == 2 and type(got[1]) is dict):
                raise TestFailed(f"{_short(source, 80)} did not come back as a call with its arguments")
            result, after = got
            for where, host in [(i, args[i]) for i in mutable] + [(k, kwargs[k]) for k in mutable_kw]:
                new = after.get(where)
                if type(new) is not type(host):
                    raise TestFailed(f"{_short(source, 80)} left an argument that is not a {type(host).__name__}")
                if type(host) is list:
                    host[:] = new
                else:
                    host.clear()
                    host.update(new)
            return result
        if func is PENDING or any(_has_pending(v) for v in args + list(kwargs.values())):
            return PENDING
        if not callable(func):
            raise TestFailed(f"{type(func).__name__} is not callable")
        if func is range and (len(range(*args)) > MAX_LEN):
            raise TestFailed("a range of the test is too long for the host")
        if self.undecided and isinstance(getattr(func, "__self__", None), _random.Random):
            raise NotHostJudged("random is drawn where a value from the sandbox decides whether the run draws it")
        return func(*args, **kwargs)

    def raises(self, node):
        """`__sao_raises__('ValueError', f, *args)`: True when the sandbox call f(*args) raised an exception of
        that name (derived checks, sao/sandbox/derive.py: an exception the reference raised stays expected)."""
        if len(node.args) < 2 or node.keywords or not isinstance(node.args[0], ast.Constant) or \
                type(node.args[0].value) is not str or not isinstance(node.args[1], ast.Name):
            raise NotHostJudged(f"{RAISES}(name, function, *args) only")
        node.args[1]._sao_parent = node
        func, args = self.expr(node.args[1]), self.items(node.args[2:])
        if not isinstance(func, SandboxRef):
            raise NotHostJudged(f"{RAISES} checks a sandbox call only")
        if any(_has_pending(v) for v in args):
            raise NotHostJudged(f"the arguments of {func.name}(...) depend on a value from the sandbox")
        source = f"{func.name}({', '.join(to_source(a) for a in args)})"
        value = self.sandbox_call(source, source, raw=True)
        if value is PENDING:
            return PENDING
        name = node.args[0].value
        if isinstance(value, CallError) and (value.message == f"raised {name}" or value.message.startswith(f"raised {name}:")):
            return True
        got = value.message if isinstance(value, CallError) else f"returned {_short(repr(value), 60)}"
        raise TestFailed(f"{_short(source, 80)} should raise {name}; it {got}")

    def sandbox_call(self, source: str, evaluation: str, raw: bool = False):
        """One evaluation in the sandbox: planned (collect), or the next planned one of the same text (run).
        `raw`: a call that raised gives its CallError instead of failing the test."""
        if self.collecting:
            if self.undecided:
                raise NotHostJudged(f"{_short(source, 60)} is reached or not (or how often) by a value from the "
                                    "sandbox: its evaluations could not be planned in order")
            if len(evaluation) > MAX_VALUE_CHARS:
                raise NotHostJudged("the arguments of a call are too large")
            self.calls.append(evaluation)
            return PENDING
        try:
            k = self.planned.index(evaluation, self.next_call)
            self.next_call, value = k + 1, self.values[k]
        except ValueError:
            value = CallError("was not evaluated in the sandbox")
        self.used.append((source, value[0] if type(value) is tuple and evaluation != source else value))
        if raw:
            return value
        if isinstance(value, CallError):
            self.last_got = None
            raise TestFailed(f"{_short(source, 80)} {value.message}")
        self.last_got = _short(repr(value), 200)
        return _copy.deepcopy(value)  # a test that mutates a value must not change the next use

    def e_Attribute(self, node):
        value = self.expr(node.value)
        if value is PENDING:  # a sandbox value: only a method some plain type has may be asked of it
            if node.attr != "join" and not any(node.attr in names for names in _METHODS.values()):
                raise NotHostJudged(f".{node.attr} of a value from the sandbox is not judged on the host")
            return PENDING
        if isinstance(value, _Module):
            if node.attr not in value:
                raise NotHostJudged(f"the host has no {node.attr} in that module")
            return value[node.attr]
        if type(value) is str and node.attr == "join":
            return functools.partial(_join, value)
        allowed = next((names for kind, names in _METHODS.items() if type(value) is kind), set())
        if node.attr not in allowed and not self.collecting:
            raise TestFailed(f"a {type(value).__name__} has no method .{node.attr} here")
        if node.attr not in allowed:
            raise NotHostJudged(f".{node.attr} of a {type(value).__name__} is not judged on the host")
        return getattr(value, node.attr)

    def e_BinOp(self, node):
        left, right = self.expr(node.left), self.expr(node.right)
        if left is PENDING or right is PENDING:
            return PENDING
        _check_size(type(node.op), left, right)
        return _BINOPS[type(node.op)](left, right)

    def e_UnaryOp(self, node):
        value = self.expr(node.operand)
        if value is PENDING:
            return PENDING
        return (not _truth(value)) if isinstance(node.op, ast.Not) else _UNARY[type(node.op)](value)

    def e_BoolOp(self, node):
        if self.collecting:  # short-circuit as the run will, until a sandbox value decides: then every side
            values = []
            for v in node.values:
                if PENDING in values:  # reached or not by a sandbox value (unless not reaching it fails the assert)
                    with self.deciding(not (node is self.fails_short and isinstance(node.op, ast.And))):
                        values.append(self.expr(v))
                    continue
                values.append(self.expr(v))
                if values[-1] is not PENDING and PENDING not in values and \
                        _truth(values[-1]) == isinstance(node.op, ast.Or):
                    return values[-1]
            return PENDING if any(v is PENDING for v in values) else _boolop(node.op, values)
        value = None
        for v in node.values:
            value = self.expr(v)
            if _truth(value) == isinstance(node.op, ast.Or):
                return value
        return value

    def e_Compare(self, node):
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Is, ast.IsNot)) and not _singleton(right) and not _singleton(node.left):
                raise NotHostJudged("`is` is judged on the host only against None, True or False")
        left = self.expr(node.left)
        rights = []
        for op, comparator in zip(node.ops, node.comparators):
            if rights and rights[-1] is not PENDING and not rights[-1]:
                break
            if PENDING in rights:  # reached or not by a sandbox value (unless not reaching it fails the assert)
                with self.deciding(node is not self.fails_short):
                    right = self.expr(comparator)
            else:
                right = self.expr(comparator)
            if left is PENDING or right is PENDING:
                rights.append(PENDING)
            else:
                rights.append(bool(_CMPOPS[type(op)](left, right)))
            left = right
        if any(r is PENDING for r in rights):
            return PENDING
        return all(rights)

    def e_IfExp(self, node):
        test = self.expr(node.test)
        if test is PENDING:  # decided by a sandbox value: both sides are walked, neither may call or draw
            with self.deciding():
                self.expr(node.body), self.expr(node.orelse)
            return PENDING
        return self.expr(node.body) if _truth(test) else self.expr(node.orelse)

    def e_List(self, node):
        return self.sequence(node, list)

    def e_Tuple(self, node):
        return self.sequence(node, tuple)

    def e_Set(self, node):
        return self.sequence(node, set)

    def sequence(self, node, kind):
        items = self.items(node.elts)
        return PENDING if any(i is PENDING for i in items) else kind(items)

    def items(self, nodes) -> list:
        """The values of call arguments or display elements, `*iterable` expanded."""
        out = []
        for e in nodes:
            if isinstance(e, ast.Starred):
                value = self.expr(e.value)
                out.extend([PENDING] if value is PENDING else self.iterate(value))
            else:
                out.append(self.expr(e))
        return out

    def e_Dict(self, node):
        if None in node.keys:
            raise NotHostJudged("** in a dict display is not judged on the host")
        pairs = [(self.expr(k), self.expr(v)) for k, v in zip(node.keys, node.values)]
        return PENDING if any(k is PENDING or v is PENDING for k, v in pairs) else dict(pairs)

    def e_Subscript(self, node):
        value, index = self.expr(node.value), self.expr(node.slice)
        if value is PENDING or index is PENDING:
            return PENDING
        return value[index]

    def e_Slice(self, node):
        parts = [self.expr(p) if p is not None else None for p in (node.lower, node.upper, node.step)]
        return PENDING if PENDING in parts else slice(*parts)

    def e_ListComp(self, node):
        return self.comprehension(node, list)

    def e_GeneratorExp(self, node):
        return self.comprehension(node, list)  # evaluated eagerly: all()/any() then see a list

    def e_SetComp(self, node):
        return self.comprehension(node, set)

    def e_DictComp(self, node):
        return self.comprehension(node, dict)

    def comprehension(self, node, kind):
        saved = dict(self.env)
        out: list = []
        try:
            self.generate(node, node.generators, out)
        finally:
            self.env = saved
        if any(_has_pending(x) for x in out):
            return PENDING
        if len(out) > MAX_LEN:
            raise TestFailed("a comprehension of the test is too long for the host")
        return kind(out)

    def generate(self, node, generators, out) -> None:
        if not generators:
            out.append((self.expr(node.key), self.expr(node.value)) if isinstance(node, ast.DictComp)
                       else self.expr(node.elt))
            return
        first = generators[0]
        if first.is_async:
            raise NotHostJudged("async comprehensions are not judged on the host")
        items = self.expr(first.iter)
        with self.deciding(items is PENDING):
            for item in self.iterate(items):
                self.bind(first.target, item)
                keep, pending = True, False
                for c in first.ifs:  # in order, stopping at the first the host knows is false (as the run does)
                    with self.deciding(pending):
                        value = self.expr(c)
                    if value is PENDING:
                        pending = True
                    elif not _truth(value):
                        keep = False
                        break
                if keep:
                    with self.deciding(pending):
                        self.generate(node, generators[1:], out)

    @contextlib.contextmanager
    def deciding(self, undecided: bool = True):
        """Collect mode: the code inside is walked although a sandbox value decides whether (or how often)
        the run reaches it. A sandbox call or a random draw there could not be planned in the run's order
        (the sandbox would evaluate calls the run skips; `random` would be drawn where the run does not),
        so either makes the test not host-judged: correct code never fails for how the judge walks it."""
        self.undecided += bool(undecided and self.collecting)
        try:
            yield
        finally:
            self.undecided -= bool(undecided and self.collecting)

    def explain(self, what: str = "") -> str:
        """Why an assert failed: its sandbox calls with the values they returned (never the expected one)."""
        shown = [f"{_short(src, 60)} returned {_short(repr(v), 60)}" for src, v in self.used[:2]]
        text = "; ".join(shown) if shown else "the assert failed"
        return f"{text} ({what})" if what else text


def _join(sep: str, items) -> str:
    items = list(items)
    if sum(len(i) if type(i) is str else MAX_LEN for i in items) + len(sep) * len(items) > MAX_LEN:
        raise TestFailed("a joined string of the test is too large for the host")
    return sep.join(items)


def _singleton(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in (None, True, False) and type(node.value) is not int


def _truth(value) -> bool:
    if value is PENDING:
        return True
    if type(value) not in _PLAIN:
        raise TestFailed(f"the truth of a {type(value).__name__} is not judged on the host")
    return bool(value)


def _boolop(op, values):
    for v in values:
        if _truth(v) == isinstance(op, ast.Or):
            return v
    return values[-1]


def _has_pending(value, depth: int = 0) -> bool:
    if value is PENDING:
        return True
    if depth < 20 and isinstance(value, (list, tuple, set, frozenset)):
        return any(_has_pending(v, depth + 1) for v in value)
    if depth < 20 and isinstance(value, dict):
        return any(_has_pending(v, depth + 1) for v in value.values())
    return False


def _check_size(op, left, right) -> None:
    """Refuse host operations whose result would be huge, before computing them."""
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_LEN:
                raise TestFailed("a repeated sequence of the test is too large for the host")
    if op is ast.Pow and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and left.bit_length() * right > MAX_BITS:
            raise TestFailed("a power of the test is too large for the host")
    if op is ast.LShift and isinstance(right, int) and right > MAX_BITS:
        raise TestFailed("a shift of the test is too large for the host")
