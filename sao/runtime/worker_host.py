"""One rollout worker's insides, the same under every backend: engine + environment + episode slots.

A backend wraps a `WorkerHost` in a process (local) or an actor (ray): it feeds `submit` with the
trainer's assignments and forwards the records the host `send`s (Finished, WorkerStats).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from sao.models.quiet import quiet_transformers
from sao.types import Assignment, Finished, Record, SamplingParams, Status, WorkerStats


@dataclass
class WorkerSpec:
    index: int  # worker number, 0..rollout_workers-1 (kept across restarts)
    model_path: str
    env_name: str
    env_options: dict
    seed: int  # engine sampling seed of this worker incarnation
    limits: object  # EpisodeLimits
    concurrency: int  # episode slots
    threads: int  # torch intra-op threads
    engine: object = None  # EngineConfig (None: the built-in torch engine's defaults)
    env_class: bytes | None = None  # a user environment class passed as an object (sao.envs.base.portable_environment)


def reseed(spec: WorkerSpec) -> WorkerSpec:
    """A restarted worker samples differently from the one that died (same index)."""
    from dataclasses import replace

    return replace(spec, seed=spec.seed + 100_003)


class WorkerHost:
    def __init__(self, spec: WorkerSpec, weight_source, send: Callable[[Record], None]):
        import torch

        torch.set_num_threads(spec.threads)
        quiet_transformers()
        from sao.envs import make_environment
        from sao.models.chat import ChatCodec
        from sao.models.tokenizer import load_tokenizer

        torch.manual_seed(spec.seed)
        self.spec, self.send = spec, send
        self.codec = ChatCodec(load_tokenizer(spec.model_path))
        from sao.config import EngineConfig
        from sao.engine import make_engine

        self.engine = make_engine(spec.engine or EngineConfig(), spec.model_path, pad_id=self.codec.tokenizer.pad_token_id,
                                  max_batch=spec.concurrency, seed=spec.seed, version=-1, weight_source=weight_source)
        if spec.env_class is not None:
            from sao.envs.base import install_environment

            install_environment(spec.env_name, spec.env_class)
        self.environment = make_environment(spec.env_name, spec.env_options, spec.seed)
        self.inbox: asyncio.Queue | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_errors = 0
        self.t_start = time.perf_counter()

    def submit(self, items: list[Assignment | None]) -> None:
        """Thread-safe: hand assignments (or STOP = None, one per slot) to the slots."""
        for item in items:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)

    def stats(self) -> WorkerStats:
        from sao.rollout.agent_loop import hung_steps

        s = getattr(self.engine, "stats", {})
        return WorkerStats(self.spec.index, self.engine.version, int(s.get("tokens", 0)), float(s.get("busy_s", 0.0)),
                           time.perf_counter() - self.t_start, hung_steps(), self.engine_errors,
                           int(s.get("restarts", 0)))

    async def run(self, ready: Callable[[], None] = lambda: None) -> None:
        """Serve until STOP; `ready` is called once the inbox exists (submit may be used after it)."""
        from sao.rollout.worker import run_rollout_worker

        self.loop, self.inbox = asyncio.get_running_loop(), asyncio.Queue()
        self.engine.update_weights()  # the trainer's current version
        ready()

        def emit(traj) -> None:
            self.engine_errors += traj.status == Status.ENGINE_ERROR
            self.send(Finished(self.spec.index, traj))

        async def report() -> None:
            while True:
                await asyncio.sleep(1.0)
                self.send(self.stats())

        reporter = asyncio.create_task(report())
        try:
            await run_rollout_worker(self.engine, self.environment, self.codec, SamplingParams(temperature=1.0),
                                     self.spec.limits, self.inbox, emit, self.spec.concurrency)
        finally:
            reporter.cancel()
            await self.engine.close()
        self.send(self.stats())
