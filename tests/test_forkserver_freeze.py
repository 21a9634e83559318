"""The rollout workers' fork server freezes its preloaded objects, so forked workers keep sharing their pages."""

import gc

from sao.runtime.prewarm import PRELOAD, forkserver_context


def _frozen(q) -> None:
    gc.collect()  # a full collection walks only unfrozen objects: the preload's pages stay shared
    q.put(gc.get_freeze_count())


def test_worker_forked_from_the_server_inherits_frozen_imports():
    assert PRELOAD[-1] == "sao.runtime.forkserver_freeze"  # after everything it must freeze
    ctx = forkserver_context()
    q = ctx.Queue()
    p = ctx.Process(target=_frozen, args=(q,))
    p.start()
    frozen = q.get(timeout=120)
    p.join(timeout=30)
    # torch + transformers + sao at import are hundreds of thousands of objects; unfrozen this is 0
    assert frozen > 100_000
