"""The `local` backend: `runtime.rollout_workers` processes on this machine, joined by pipes.

    trainer ──Assignment lists──► pipe ──► worker i (WorkerHost: engine + slots)
    trainer ◄──Finished/WorkerStats── pipe ◄── worker i   (a sender thread: the event loop never blocks)
    weights: one SharedWeights buffer (shared memory) that every engine polls between decode steps
    in flight: the trainer counts what it submitted to each worker; each worker counts, in shared
               memory, the episodes it finished (`in_flight()` reads both and receives nothing)

Each worker has its own pair of pipes, so a worker killed mid-message only breaks its own pipe.
A worker never outlives the trainer: workers are forked from a fork server (started early by
`prewarm`, with torch and sao imported) that exits with the trainer; the kernel then sends each worker
SIGKILL (PR_SET_PDEATHSIG), and a watchdog thread also exits it when the trainer is gone, even while
another thread is blocked writing to a full pipe. Ctrl-C reaches the whole process group; workers
ignore it and let the trainer checkpoint and stop them.
"""

from __future__ import annotations

import ctypes
import os
import queue as queue_mod
import signal
import threading
import time
from multiprocessing.connection import wait

import torch

from sao.runtime.prewarm import forkserver_context
from sao.runtime.weight_sync import SharedWeights
from sao.runtime.worker_host import WorkerSpec, reseed
from sao.types import Assignment, Finished, Record, WorkerLost

PR_SET_PDEATHSIG = 1


def mp_context():
    """Workers are forked from a fork server that has imported torch, transformers and sao already
    (sao/runtime/prewarm.py starts it while the trainer builds itself), so a worker, or a restarted one,
    starts in a fraction of a second. The fork server is a fresh process (no threads, no trainer
    state), so forking it is safe."""
    forkserver_context()
    return torch.multiprocessing.get_context("forkserver")  # torch's tensor-sharing reducers registered


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _never_outlive(trainer_pid: int) -> None:
    """The worker's parent is the fork server, which exits when the trainer does (its pipe from the
    trainer closes): the kernel then SIGKILLs the worker (PR_SET_PDEATHSIG). The watchdog also exits it
    when the fork server or the trainer is gone, even while another thread blocks on a full pipe."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the watchdog below still works
        pass
    parent = os.getppid()

    def watchdog() -> None:
        while os.getppid() == parent and _alive(trainer_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watchdog, daemon=True, name="sao-watchdog").start()
    if not _alive(trainer_pid):
        os._exit(1)


def worker_main(spec: WorkerSpec, weights: SharedWeights, inbox, outbox, parent_pid: int, finished) -> None:
    """Entry point of a worker process (forked from the fork server, heavy modules already imported)."""
    _never_outlive(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import asyncio

    from sao.runtime.worker_host import WorkerHost

    pending: queue_mod.SimpleQueue = queue_mod.SimpleQueue()

    def sender() -> None:  # the only writer of `outbox` and of finished[i]; may block on a full pipe
        while True:
            record = pending.get()
            try:
                outbox.send(record)
            except OSError:  # the trainer is gone (BrokenPipeError): the watchdog ends this process, quietly
                return
            finished[spec.index] += isinstance(record, Finished)

    threading.Thread(target=sender, daemon=True, name="sao-sender").start()
    host = WorkerHost(spec, weights, pending.put)

    def reader() -> None:  # trainer -> slots; None items are STOPs
        while True:
            try:
                items = inbox.recv()
            except (EOFError, OSError):
                items = [None] * spec.concurrency
            host.submit(items)
            if None in items:
                return

    asyncio.run(host.run(ready=lambda: threading.Thread(target=reader, daemon=True).start()))
    time.sleep(0.5)  # let the sender flush the final stats


class _Worker:
    def __init__(self, ctx, spec: WorkerSpec, weights: SharedWeights, finished):
        self.spec = spec
        self.inbox_r, self.inbox_w = ctx.Pipe(duplex=False)
        self.out_r, self.out_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=worker_main, daemon=True, name=f"sao-rollout-{spec.index}",
                                args=(spec, weights, self.inbox_r, self.out_w, os.getpid(), finished))
        self.proc.start()
        self.inbox_r.close()  # the child's ends: ours are closed so EOF reaches the other side
        self.out_w.close()

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        for conn in (self.inbox_w, self.out_r):
            conn.close()


class LocalBackend:
    def __init__(self, specs: list[WorkerSpec]):
        self.specs = specs
        self.workers = len(specs)
        self.ctx = mp_context()
        self.weights: SharedWeights | None = None
        self._w: list[_Worker] = []
        self._finished = self.ctx.Array("q", self.workers, lock=False)  # written by each worker's sender thread
        self._submitted = [0] * self.workers

    def start(self, params: list[torch.Tensor], version: int) -> None:
        self.weights = SharedWeights([tuple(p.shape) for p in params], self.ctx)
        self.weights.publish(params, version)
        self._w = [_Worker(self.ctx, spec, self.weights, self._finished) for spec in self.specs]

    def submit(self, worker: int, items: list[Assignment]) -> None:
        self._submitted[worker] += len(items)
        try:
            self._w[worker].inbox_w.send(items)
        except OSError:  # dead: `receive` reports it, and the scheduler issues these again
            pass

    def receive(self, timeout: float) -> list[Record]:
        out: list[Record] = []
        by_conn = {w.out_r: w for w in self._w}
        for conn in wait(list(by_conn), timeout):
            w = by_conn[conn]
            try:
                while conn.poll():
                    out.append(conn.recv())
            except (EOFError, OSError):
                pass  # the process is gone; found below
        for i, w in enumerate(self._w):
            if not w.proc.is_alive():
                out.append(self._restart(i))
        return out

    def in_flight(self) -> int:
        """Episodes submitted to the workers and not finished yet (sao/runtime/threads.py)."""
        return sum(s - f for s, f in zip(self._submitted, self._finished))

    def _restart(self, i: int) -> WorkerLost:
        old = self._w[i]
        old.close()
        self._submitted[i] = self._finished[i] = 0  # its episodes are issued again (sao/runtime/scheduler.py)
        self.specs[i] = reseed(self.specs[i])
        self._w[i] = _Worker(self.ctx, self.specs[i], self.weights, self._finished)
        return WorkerLost(i, f"rollout worker {i} exited with code {old.proc.exitcode}; restarted")

    def publish(self, params: list[torch.Tensor], version: int) -> float:
        return self.weights.publish(params, version)

    def stop(self) -> None:
        """Workers hold nothing worth saving (the trainer re-issues unfinished work on resume): kill them."""
        for w in self._w:
            w.close()
        self._w = []
