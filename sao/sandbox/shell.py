"""Shell commands in the sandbox on a workspace that persists between runs (a Harbor task's /app).

Each `run_shell` is one sandboxed run (sao/sandbox/namespace.py: namespaces, seccomp, rlimits, the host's
watch; the audit-hook guard is off, since a shell must start processes): the workspace (a tar.gz the host
keeps as bytes and never unpacks) is unpacked into /app, the given files are placed, `bash -c script` runs
in /app (a command's own files may sit at /agent), then /app is packed again and the files named in
`collect` are read. /app, /tests, /logs and /agent are symlinks into the run's tmpfs, so a task's scripts
find the absolute paths they were written for. What comes
back is data only (base64 text the host decodes); an archive over `max_workspace_kb` is an error, not cut.
"""

from __future__ import annotations

import ast
import base64
import json
import textwrap
from dataclasses import dataclass, field

from sao.sandbox.namespace import NamespaceSandbox
from sao.sandbox.protocol import Limits

LINKS = (("/app", "/sandbox/app"), ("/tests", "/sandbox/tests"), ("/logs", "/sandbox/logs"), ("/agent", "/sandbox/agent"))
_CHUNK = 60_000  # characters per value record (the harness keeps 65,537 of a repr)

_PROGRAM = textwrap.dedent('''
    import base64 as _b, io as _io, json as _j, os as _os, subprocess as _sp, tarfile as _tf
    for _d in ("/sandbox/app", "/sandbox/tests", "/sandbox/logs/verifier", "/sandbox/logs/agent", "/sandbox/agent"):
        _os.makedirs(_d, exist_ok=True)
    _ws = _b.b64decode(__WS__)
    if _ws:
        with _tf.open(fileobj=_io.BytesIO(_ws), mode="r:gz") as _t:
            _t.extractall("/sandbox/app", filter="data")
    for _p, _c in __FILES__.items():
        _os.makedirs(_os.path.dirname(_p), exist_ok=True)
        with open(_p, "wb") as _f:
            _f.write(_b.b64decode(_c))
        _os.chmod(_p, 0o755)
    _env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8",
            **__ENV__}
    try:
        _r = _sp.run(["bash", "-c", __SCRIPT__], cwd="/app", env=_env, stdin=_sp.DEVNULL, stdout=_sp.PIPE,
                     stderr=_sp.STDOUT, timeout=__TIMEOUT__)
        _code, _out = _r.returncode, _r.stdout
    except _sp.TimeoutExpired as _e:
        _code, _out = None, _e.stdout or b""
    _buf = _io.BytesIO()
    with _tf.open(fileobj=_buf, mode="w:gz") as _t:
        _t.add("/sandbox/app", arcname=".")
    _got = {}
    for _p in __COLLECT__:
        if _os.path.isfile(_p):
            with open(_p, "rb") as _f:
                _got[_p] = _b.b64encode(_f.read(1 << 20)).decode()
    __sao_out = _j.dumps({"code": _code, "out": _b.b64encode(_out[-__OUTCAP__:]).decode(),
                          "ws": _b.b64encode(_buf.getvalue()).decode(), "files": _got})
''')


@dataclass
class ShellResult:
    exit_code: int | None  # None: the script ran past its timeout
    output: str  # stdout and stderr together, the last `output_kb`
    workspace: bytes  # /app afterwards, tar.gz
    files: dict[str, bytes] = field(default_factory=dict)  # what of `collect` existed
    error: str = ""  # the run itself failed (a limit, an archive too large): the other fields are empty


async def run_shell(script: str, *, workspace: bytes = b"", files: dict[str, bytes] | None = None,
                    collect: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 30.0,
                    limits: Limits | None = None, output_kb: int = 16, max_workspace_kb: int = 512) -> ShellResult:
    limits = limits or Limits(cpu_s=timeout_s + 5, wall_s=timeout_s + 15, memory_mb=1024, max_procs=64)
    program = _PROGRAM
    for name, value in (("__WS__", repr(base64.b64encode(workspace).decode())),
                        ("__FILES__", repr({p: base64.b64encode(c).decode() for p, c in (files or {}).items()})),
                        ("__ENV__", repr(dict(env or {}))), ("__SCRIPT__", repr(script)),
                        ("__TIMEOUT__", repr(float(timeout_s))), ("__COLLECT__", repr(tuple(collect))),
                        ("__OUTCAP__", str(output_kb << 10))):
        program = program.replace(name, value)
    chunks = (max_workspace_kb * 4 // 3 + (output_kb + 1024) * 2) * 1024 // _CHUNK + 2
    exprs = [f"__sao_out[{i * _CHUNK}:{(i + 1) * _CHUNK}]" for i in range(chunks)] + ["len(__sao_out)"]
    verdict, values = await NamespaceSandbox(guard=False).evaluate_async(program, exprs, limits, links=LINKS)
    if any(kind != "value" for kind, _ in values):
        why = verdict.reason or next(text for kind, text in values if kind != "value")
        return ShellResult(None, "", b"", error=f"the sandboxed run failed: {why}"[:300])
    try:
        text = "".join(ast.literal_eval(v) for _, v in values[:-1])
        if len(text) != ast.literal_eval(values[-1][1]):
            return ShellResult(None, "", b"", error=f"the workspace is over {max_workspace_kb} KiB")
        out = json.loads(text)
        return ShellResult(out["code"], base64.b64decode(out["out"]).decode("utf-8", "replace"),
                           base64.b64decode(out["ws"]), {p: base64.b64decode(c) for p, c in out["files"].items()})
    except (ValueError, SyntaxError, KeyError, TypeError) as exc:
        return ShellResult(None, "", b"", error=f"unreadable result from the sandbox: {exc}"[:300])
