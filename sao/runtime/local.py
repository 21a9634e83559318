"""The `local` backend: one rollout process and the trainer (this process), joined by small seams.

    rollout process: TorchEngine (1 thread) + `concurrency` episode slots, paced by `Pacer`
        └── finished Trajectory ──► mp.Queue ──► TrajectoryQueue (drop at dequeue) ──► Learner
    trainer: publishes weights into SharedWeights every `sync_every` actor steps; the engine swaps
             them in between decode steps while sequences are in flight.

Rollout and training really overlap on two cores: each process pins its own intra-op threads.
`sync` mode (for comparison) generates a batch, then trains, in this process alone.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue as queue_mod
import time
from dataclasses import dataclass

import torch

from sao.types import SamplingParams, Trajectory


@dataclass
class WorkerSpec:
    model_path: str
    env_name: str
    env_options: dict
    seed: int
    limits: object  # EpisodeLimits
    concurrency: int
    threads: int
    batch_size: int
    max_lag: int


def quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def rollout_process_main(spec: WorkerSpec, weights, counters, trainer_step, out_q, stop) -> None:
    """Entry point of the rollout process (spawned once; heavy imports happen here, once)."""
    torch.set_num_threads(spec.threads)
    quiet_transformers()
    from sao.engine.torch_engine import TorchEngine
    from sao.envs import make_environment
    from sao.models.chat import ChatCodec
    from sao.models.tiny import load_model
    from sao.models.tokenizer import load_tokenizer
    from sao.rollout.worker import run_rollout_worker
    from sao.runtime.queue import Pacer

    torch.manual_seed(spec.seed + 1)
    codec = ChatCodec(load_tokenizer(spec.model_path))
    model = load_model(spec.model_path)
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=spec.concurrency, seed=spec.seed + 1,
                         version=-1, weight_source=weights)
    engine.update_weights()  # version 0 from the trainer
    environment = make_environment(spec.env_name, spec.env_options, spec.seed)
    started, consumed, refunded = counters
    pacer = Pacer(spec.batch_size, spec.max_lag, started, consumed, refunded)
    t_start = time.perf_counter()
    last_stats = [0.0]

    def emit(traj: Trajectory) -> None:
        out_q.put(("traj", traj))
        now = time.perf_counter()
        if now - last_stats[0] > 1.0:
            last_stats[0] = now
            out_q.put(("stats", {**engine.stats, "wall_s": now - t_start, "version": engine.version}))

    params = SamplingParams(temperature=1.0)
    parent = mp.parent_process()

    def should_stop() -> bool:  # also when the trainer was killed: never outlive it
        return stop.is_set() or (parent is not None and not parent.is_alive())

    asyncio.run(run_rollout_worker(
        engine, environment, codec, params, spec.limits, environment.train_tasks(), pacer.admit, emit,
        spec.concurrency, should_stop, trainer_version=lambda: trainer_step.value,
    ))
    out_q.put(("stats", {**engine.stats, "wall_s": time.perf_counter() - t_start, "version": engine.version}))
    out_q.put(("done", None))


class RolloutProcess:
    """Trainer-side handle of the rollout process: start, receive, stop."""

    def __init__(self, spec: WorkerSpec, weights, ctx):
        self.ctx = ctx
        self.counters = tuple(ctx.Value("q", 0, lock=False) for _ in range(3))  # pacing: started, consumed, refunded
        self.trainer_step = ctx.Value("q", 0, lock=False)  # optimizer steps done; episodes see it in their context
        self.queue = ctx.Queue()
        self.stop_event = ctx.Event()
        self.stats: dict = {}
        self.proc = ctx.Process(target=rollout_process_main, daemon=True,
                                args=(spec, weights, self.counters, self.trainer_step, self.queue, self.stop_event))

    def start(self) -> None:
        self.proc.start()

    def receive(self, timeout: float) -> list[Trajectory]:
        """Trajectories that arrived within `timeout` seconds (all waiting ones, at least one if any)."""
        out = []
        try:
            block = True
            while True:
                kind, payload = self.queue.get(block=block, timeout=timeout if block else None)
                block = False
                if kind == "traj":
                    out.append(payload)
                elif kind == "stats":
                    self.stats = payload
        except queue_mod.Empty:
            pass
        if not out and not self.proc.is_alive():
            raise RuntimeError(f"the rollout process died (exit code {self.proc.exitcode})")
        return out

    def stop(self) -> None:
        self.stop_event.set()
        deadline = time.time() + 10
        while self.proc.is_alive() and time.time() < deadline:
            try:
                self.queue.get(timeout=0.1)  # drain so the child can flush and exit
            except queue_mod.Empty:
                pass
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=5)
