"""Ctrl-C and SIGTERM ask the loop to stop at the next step boundary (`StopFlag.check`, called by
sao/runtime/loop.py and the batch sources), so the checkpoint written then is consistent; a second
one interrupts at once."""

from __future__ import annotations

import contextlib
import signal


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived; raised at a step boundary so the checkpoint is consistent."""


class StopFlag:
    """The signal's name once Ctrl-C or SIGTERM arrived ("" until then)."""

    def __init__(self) -> None:
        self.reason = ""

    def __bool__(self) -> bool:
        return bool(self.reason)

    def check(self) -> None:
        if self.reason:
            raise Interrupted(self.reason)


@contextlib.contextmanager
def stop_on_signals(stop: StopFlag):
    """Within the block, SIGINT/SIGTERM set `stop.reason` to the signal's name."""
    def handle(signum, frame):
        if stop.reason:
            raise KeyboardInterrupt
        stop.reason = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
