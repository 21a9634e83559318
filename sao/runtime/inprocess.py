"""The `thread` backend: rollout workers as threads of the trainer's process (`runtime.backend=thread`).

The same `WorkerHost` (engine + environment + episode slots) and the same records as the `local` and
`ray` backends, with no second process: no fork server, no worker interpreter, no second copy of torch's
and transformers' import state, so an async run's memory is close to a sync run's (measured in
docs/performance.md). What it gives up: the workers share the trainer's interpreter, so their Python
between torch ops waits for the GIL while the trainer's runs (torch kernels release it); a worker that
crashes the process takes the trainer with it. Also used by tests that drive the real async loop
(tests/test_pacing.py) and for stepping through a run in a debugger.

Per thread: each worker thread sets its own torch intra-op thread count on start (OpenMP keeps it per
thread, so the trainer's adaptive count does not change it), and a host is built under a forked global
RNG, so the trainer's random stream is the one it would have on the `local` backend.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback

import torch

from sao.runtime.weight_sync import SharedWeights
from sao.runtime.worker_host import WorkerHost, WorkerSpec, reseed
from sao.types import Assignment, Finished, Record, WorkerLost


class _Thread:
    """One worker: its host and the thread serving it. `error` is set when the host could not be built or
    its thread ended with an exception: `receive` then reports the worker lost, as a dead worker process,
    and the scheduler's crash-loop rule applies to both (sao/runtime/scheduler.py)."""

    def __init__(self, spec: WorkerSpec, weights: SharedWeights, send, finished: list[int]):
        self.spec, self.send, self.finished = spec, send, finished
        self.error: str | None = None
        self.host: WorkerHost | None = None
        self.thread: threading.Thread | None = None
        threads = torch.get_num_threads()
        try:
            with torch.random.fork_rng():  # WorkerHost seeds torch's global RNGs: keep the trainer's
                self.host = WorkerHost(spec, weights, self._send)
        except Exception as e:
            self.error = _describe(e)
            return
        finally:
            torch.set_num_threads(threads)  # WorkerHost set the calling (trainer) thread's count
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name=f"sao-rollout-{spec.index}")
        self.thread.start()
        while not self.ready.wait(0.1) and self.thread.is_alive():
            pass

    def _send(self, record: Record) -> None:
        self.finished[self.spec.index] += isinstance(record, Finished)
        self.send(record)

    def _serve(self) -> None:
        torch.set_num_threads(self.spec.threads)  # this thread's own count (OpenMP keeps it per thread)
        try:
            asyncio.run(self.host.run(ready=self.ready.set))
        except BaseException as e:  # reported by `receive` as WorkerLost, like a dead worker process
            self.error = _describe(e)

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def lost(self) -> bool:
        return self.error is not None and not self.alive()


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


class InProcessBackend:
    def __init__(self, specs: list[WorkerSpec]):
        self.specs, self.workers = specs, len(specs)
        self.outbox: queue.SimpleQueue[Record] = queue.SimpleQueue()
        self._t: list[_Thread] = []
        self._submitted, self._finished = [0] * self.workers, [0] * self.workers

    def start(self, params: list[torch.Tensor], version: int) -> None:
        self.weights = SharedWeights([tuple(p.shape) for p in params])
        self.weights.publish(params, version)
        self._t = [_Thread(spec, self.weights, self.outbox.put, self._finished) for spec in self.specs]

    def submit(self, worker: int, items: list[Assignment]) -> None:
        self._submitted[worker] += len(items)
        t = self._t[worker]
        try:
            if t.alive():
                t.host.submit(items)
        except RuntimeError:  # its event loop has stopped
            pass  # either way `receive` reports it lost and the scheduler issues these again

    def receive(self, timeout: float) -> list[Record]:
        out: list[Record] = []
        try:
            out.append(self.outbox.get(timeout=timeout) if timeout > 0 else self.outbox.get_nowait())
        except queue.Empty:
            pass
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                break
        for i, t in enumerate(self._t):
            if t.lost():
                out.append(self._restart(i))
        return out

    def in_flight(self) -> int:
        """Episodes submitted to the workers and not finished yet (sao/runtime/threads.py)."""
        return sum(s - f for s, f in zip(self._submitted, self._finished))

    def _restart(self, i: int) -> WorkerLost:
        error = self._t[i].error
        self._submitted[i] = self._finished[i] = 0  # its episodes are issued again (sao/runtime/scheduler.py)
        self.specs[i] = reseed(self.specs[i])
        self._t[i] = _Thread(self.specs[i], self.weights, self.outbox.put, self._finished)
        return WorkerLost(i, f"rollout worker {i} (a thread) stopped with {error}; restarted")

    def publish(self, params: list[torch.Tensor], version: int) -> float:
        return self.weights.publish(params, version)

    def stop(self) -> None:
        """End every worker thread now, episodes in flight included (as `local` kills its processes: the
        trainer re-issues unfinished work on resume); idempotent."""
        for t in self._t:
            if t.alive():
                try:
                    t.host.loop.call_soon_threadsafe(_cancel_all, t.host.loop)
                except RuntimeError:  # its loop has closed already
                    pass
        for t in self._t:
            if t.thread is not None:
                t.thread.join(timeout=30)
        self._t = []


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
