"""An in-process backend: rollout workers as threads of the trainer's process.

The same `WorkerHost` (engine + environment + episode slots) and the same records as the `local` and
`ray` backends, with no processes: for tests that drive the real async loop (tests/test_pacing.py)
and for stepping through a run in a debugger. Not for training speed: the workers share the
trainer's interpreter, its torch thread setting and its global RNG (a host seeds torch on start).
"""

from __future__ import annotations

import asyncio
import queue
import threading

import torch

from sao.runtime.weight_sync import SharedWeights
from sao.runtime.worker_host import WorkerHost, WorkerSpec
from sao.types import Assignment, Record


class InProcessBackend:
    def __init__(self, specs: list[WorkerSpec]):
        self.specs, self.workers = specs, len(specs)
        self.outbox: queue.SimpleQueue[Record] = queue.SimpleQueue()
        self.hosts: list[WorkerHost] = []
        self.threads: list[threading.Thread] = []

    def start(self, params: list[torch.Tensor], version: int) -> None:
        self.weights = SharedWeights([tuple(p.shape) for p in params])
        self.weights.publish(params, version)
        for spec in self.specs:
            host, ready = WorkerHost(spec, self.weights, self.outbox.put), threading.Event()
            thread = threading.Thread(target=lambda h=host, r=ready: asyncio.run(h.run(ready=r.set)), daemon=True,
                                      name=f"sao-rollout-{spec.index}")
            thread.start()
            ready.wait()
            self.hosts.append(host)
            self.threads.append(thread)

    def submit(self, worker: int, items: list[Assignment]) -> None:
        self.hosts[worker].submit(items)

    def receive(self, timeout: float) -> list[Record]:
        try:
            out = [self.outbox.get(timeout=timeout) if timeout > 0 else self.outbox.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                return out

    def publish(self, params: list[torch.Tensor], version: int) -> float:
        return self.weights.publish(params, version)

    def stop(self) -> None:
        for host, spec in zip(self.hosts, self.specs):
            host.submit([None] * spec.concurrency)  # one STOP per slot
        for thread in self.threads:
            thread.join(timeout=30)
        self.hosts, self.threads = [], []
