"""Imported last by the rollout workers' fork server (sao/runtime/prewarm.py PRELOAD): freezes what the
preload built.

A forked worker shares the fork server's pages until either writes to them. CPython's cycle collector
writes into the header of every object it walks, so the worker's first full collection copied the
pages of nearly every object torch, transformers and sao had created at import, and the server kept
its originals: ~80 MB held twice. `gc.freeze()` moves those objects to the permanent generation, which
the collector never walks, so they stay shared (measured in benchmarks/README.md, `vs_trl.py`). They
are module-level import state that lives as long as the process anyway; nothing collectable is lost.
"""

import gc

gc.collect()
gc.freeze()
