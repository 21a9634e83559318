"""Start the rollout workers' fork server early (stdlib only: nothing heavy is imported here).

`local` workers are forked from a multiprocessing fork server that has imported torch, transformers
and sao already (sao/runtime/local.py). Starting it first thing in `sao train` lets those imports run
while the trainer imports, validates and builds itself, instead of after: on 2 cores a spawned
worker spent ~5 s importing before it could generate.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver

# what a worker imports before it can generate; then freeze it, so workers share it (forkserver_freeze.py)
PRELOAD = ["torch", "transformers", "sao.runtime.worker_host", "sao.models.tiny", "sao.engine.torch_engine", "sao.envs",
           "sao.runtime.forkserver_freeze"]


def forkserver_context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def prewarm() -> None:
    """Start the fork server now; returns at once (the server imports PRELOAD in the background)."""
    forkserver_context()
    forkserver.ensure_running()
