"""The backend interface: how the trainer reaches its rollout workers, whatever carries the bytes.

    backend.start(params, version)      start `runtime.rollout_workers` workers holding these weights
    backend.submit(worker, items)       hand Assignments to one worker (the trainer decides who and when)
    backend.receive(timeout)            records that arrived: Finished, WorkerStats, WorkerLost
    backend.publish(params, version)    make new weights available to every engine; returns ms taken
    backend.stop()                      end every worker (also on error paths; idempotent)

A backend owns processes/actors and their health: a worker that dies is restarted by the backend
and reported as `WorkerLost` from `receive`; the trainer side (sao/runtime/scheduler.py) then
issues that worker's unfinished assignments again. Pacing, staleness and the task stream live in
the trainer, so they are global across workers and identical on every backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from sao.config import Config
from sao.envs.base import portable_environment
from sao.runtime.worker_host import WorkerSpec
from sao.types import Assignment, Record


class Backend(Protocol):
    workers: int

    def start(self, params: list[torch.Tensor], version: int) -> None: ...

    def submit(self, worker: int, items: list[Assignment]) -> None: ...

    def receive(self, timeout: float) -> list[Record]: ...

    def publish(self, params: list[torch.Tensor], version: int) -> float: ...

    def stop(self) -> None: ...


def worker_specs(cfg: Config, model_path: str, limits) -> list[WorkerSpec]:
    """One spec per worker; each has its own sampling seed (a restart bumps it, see `reseed`)."""
    r = cfg.runtime
    model_path = str(Path(model_path).resolve())  # a Ray worker does not share the trainer's working directory
    env_class = portable_environment(cfg.env.name)  # a class passed to sao.train(env=...) travels by value
    return [WorkerSpec(i, model_path, cfg.env.name, cfg.env.options, cfg.train.seed + 1 + 1000 * i, limits,
                       cfg.rollout.concurrency, r.rollout_threads, cfg.engine, env_class)
            for i in range(r.rollout_workers)]


def make_backend(cfg: Config, model_path: str, limits) -> Backend:
    specs = worker_specs(cfg, model_path, limits)
    if cfg.runtime.backend == "ray":
        from sao.runtime.ray_backend import RayBackend

        return RayBackend(specs, cfg.runtime)
    if cfg.runtime.backend == "thread":
        from sao.runtime.inprocess import InProcessBackend

        return InProcessBackend(specs)
    from sao.runtime.local import LocalBackend

    return LocalBackend(specs)
