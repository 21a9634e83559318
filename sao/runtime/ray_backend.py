"""The `ray` backend: rollout workers and the trajectory queue are Ray actors (same records as local).

    trainer ──submit(Assignment list)──► RolloutActor i (async actor around a WorkerHost)
    RolloutActor i ──put(Finished / WorkerStats)──► RecordQueue actor ◄──take(timeout)── trainer
    publish: one flat float32 numpy array, `ray.put` once, its reference handed to every worker

By default the run starts a local Ray (`ray.init` with `runtime.ray_num_cpus` CPUs, no dashboard, a
`runtime.ray_object_store_mb` object store); with `runtime.ray_address` it joins that cluster.
A worker actor that dies (its `run` call fails) is replaced and reported as `WorkerLost`, as the
local backend does; the trainer side re-issues its episodes. CPUs/GPUs per worker actor:
`runtime.worker_num_cpus` / `runtime.worker_num_gpus`.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import warnings

import numpy as np
import ray
import torch

from sao.config import ConfigError, RuntimeConfig
from sao.runtime.weight_sync import flatten
from sao.runtime.worker_host import WorkerSpec, reseed
from sao.types import Assignment, Record, WorkerLost


def connect(cfg: RuntimeConfig, trainer_cpus: float = 0.0) -> bool:
    """Join runtime.ray_address, or start a local Ray; True when this call started it. A local Ray has
    at least the CPUs its actors reserve (rollout workers, and `trainer_cpus` for trainer rank actors),
    so none of them waits for a CPU the machine lacks: Ray's CPUs are reservations, not cores."""
    if ray.is_initialized():
        return False
    if cfg.ray_address:  # preflight checked that something answers there (check_ray_address)
        try:
            ray.init(address=cfg.ray_address, log_to_driver=False, logging_level="ERROR")
        except ConnectionError as exc:
            raise ConfigError(f"runtime.ray_address: cannot join the Ray cluster at {cfg.ray_address} "
                              f"({str(exc).splitlines()[0][:200]})") from None
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    wanted = math.ceil(cfg.rollout_workers * cfg.worker_num_cpus + trainer_cpus)
    ray.init(num_cpus=cfg.ray_num_cpus or max(os.cpu_count() or 1, wanted), include_dashboard=False,
             log_to_driver=False, object_store_memory=cfg.ray_object_store_mb * 2**20, logging_level="ERROR")
    return True


def _weights_ref(params) -> ray.ObjectRef:
    """The flat buffer in the object store: as it is when the trainer's ranks put it there already (Ray trainer
    ranks' `RemoteWeights`, sao/trainer/ray_ranks.py: the driver never holds the bytes), else put from here."""
    ref = getattr(params, "object_ref", None)
    return ref if ref is not None else ray.put(flatten(params).numpy())


class FlatWeights:
    """Weight source of a worker's engine: the newest flat buffer the trainer published."""

    def __init__(self) -> None:
        self.version, self.flat = -1, None

    def poll(self, current_version: int) -> int | None:
        return self.version if self.version > current_version else None

    def load_into(self, params: list[torch.Tensor]) -> int:
        offset = 0
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the object store's array is read-only; it is only read
            flat = torch.from_numpy(self.flat)
            for p in params:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
        return self.version


@ray.remote(num_cpus=0)
class RecordQueue:
    """Records from every worker, in arrival order; `take` waits (bounded) for the first one."""

    def __init__(self) -> None:
        self.items: list = []
        self.event = asyncio.Event()

    async def put(self, record) -> None:
        self.items.append(record)
        self.event.set()

    async def take(self, timeout: float) -> list:
        if not self.items:
            try:
                await asyncio.wait_for(self.event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        out, self.items = self.items, []
        self.event.clear()
        return out


@ray.remote
class RolloutActor:
    def __init__(self, spec: WorkerSpec, queue) -> None:
        from sao.runtime.worker_host import WorkerHost

        self.weights = FlatWeights()
        self.early: list = []  # assignments that arrived before `run` made the inbox
        self.host = WorkerHost(spec, self.weights, lambda record: queue.put.remote(record))

    def pid(self) -> int:
        return os.getpid()

    def set_weights(self, version: int, flat: np.ndarray) -> None:
        self.weights.version, self.weights.flat = version, flat

    async def submit(self, items: list) -> None:
        if self.host.inbox is None:
            self.early += items
        else:
            self.host.submit(items)

    async def run(self) -> None:
        def ready() -> None:
            self.host.submit(self.early)
            self.early = []

        while self.weights.flat is None:  # the trainer's weights come right after creation
            await asyncio.sleep(0.01)
        await self.host.run(ready=ready)


class RayBackend:
    def __init__(self, specs: list[WorkerSpec], cfg: RuntimeConfig):
        self.specs, self.cfg = specs, cfg
        self.workers = len(specs)
        self.started_ray = False
        self.actors: list = []
        self.runs: list = []  # the `run` call of each actor: ready means the actor ended or died
        self.weights_ref = None
        self.version = -1
        self.start_s = 0.0  # ray.init + actors created (measured, reported by benchmarks/scale_out.py)

    def _init(self) -> None:
        self.started_ray = connect(self.cfg)

    def _actor(self, spec: WorkerSpec):
        actor = RolloutActor.options(num_cpus=self.cfg.worker_num_cpus, num_gpus=self.cfg.worker_num_gpus,
                                     max_restarts=0).remote(spec, self.queue)
        if self.weights_ref is not None:
            actor.set_weights.remote(self.version, self.weights_ref)
        return actor, actor.run.remote()

    def start(self, params: list[torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        self._init()
        self.queue = RecordQueue.remote()
        self.weights_ref, self.version = _weights_ref(params), version
        pairs = [self._actor(spec) for spec in self.specs]
        self.actors, self.runs = [a for a, _ in pairs], [r for _, r in pairs]
        self.start_s = time.perf_counter() - t0

    def submit(self, worker: int, items: list[Assignment]) -> None:
        self.actors[worker].submit.remote(items)

    def receive(self, timeout: float) -> list[Record]:
        out: list[Record] = ray.get(self.queue.take.remote(timeout))
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            out.append(self._restart(self.runs.index(ref)))
        return out

    def _restart(self, i: int) -> WorkerLost:
        try:
            ray.get(self.runs[i])
            reason = "returned"
        except Exception as exc:  # RayActorError: the process died, or its constructor raised
            lines = [x for x in str(exc).splitlines() if x.strip()]
            reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]
        ray.kill(self.actors[i])
        self.specs[i] = reseed(self.specs[i])
        self.actors[i], self.runs[i] = self._actor(self.specs[i])
        return WorkerLost(i, f"rollout worker {i} ended ({reason}); restarted")

    def publish(self, params: list[torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        self.weights_ref, self.version = _weights_ref(params), version
        for actor in self.actors:
            actor.set_weights.remote(version, self.weights_ref)
        return (time.perf_counter() - t0) * 1000

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.actors:
            ray.kill(self.queue)
        self.actors, self.runs = [], []
        if self.started_ray and not self.cfg.ray_address:
            ray.shutdown()
