"""Ctrl-C and SIGTERM ask the loop to stop at the next step boundary (sao/runtime/loop.py
`check_stop`), so the checkpoint written then is consistent; a second one interrupts at once."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def stop_on_signals(ctx):
    """Within the block, SIGINT/SIGTERM set `ctx.stop_requested` to the signal's name."""
    def handle(signum, frame):
        if ctx.stop_requested:
            raise KeyboardInterrupt
        ctx.stop_requested = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
