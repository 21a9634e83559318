"""Start N trainer ranks on this machine as child processes joined by torch.distributed.

`spawn_ranks(fn, world, *args)` runs `fn(rank, world, port, *args)` in `world` spawned processes
(rank 0 listens on 127.0.0.1:port; `sao.trainer.distributed.init_ranks` joins it). If one rank
raises or dies, the others are terminated and the error names the rank. `never_outlive_parent()` is
what every spawned trainer process (a follower rank, the critic's process) calls first.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from sao.errors import RunStopped


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankFailed(RunStopped):
    """A trainer rank raised or died; the others were stopped."""


def spawn_ranks(fn: Callable, world: int, *args) -> None:
    """Run fn(rank, world, port, *args) on `world` spawned processes; returns when all have finished."""
    import torch.multiprocessing as mp

    port = free_port()
    try:
        mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise RankFailed(f"trainer rank {e.error_index} failed:\n{e}") from None
    except mp.ProcessExitedException as e:
        raise RankFailed(f"trainer rank {e.error_index} exited with code {e.exit_code} "
                         f"(signal {e.signal_name})" if e.signal_name else
                         f"trainer rank {e.error_index} exited with code {e.exit_code}") from None


def never_outlive_parent() -> None:
    """A spawned trainer process (a follower rank, the critic's process) ignores Ctrl-C (its parent
    checkpoints, then closes it) and dies with its parent: the kernel SIGKILLs it when the parent exits,
    even by SIGKILL (PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: it still ends at end of file on its command pipe
        pass
