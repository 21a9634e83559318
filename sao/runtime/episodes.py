"""Episodes run in the trainer's own process on one engine: sync mode, evaluation, the parity gate,
critic pretraining.

These engines serve a `PolicyCopy`: a model of their own on engine.device that is given the trainer's
weights (`Trainer.export_weights()`, merged for LoRA) as the one flat buffer every backend publishes.
So the runtime never reaches into the trainer's models, the trainer and the engines can sit on
different devices, and what is evaluated is exactly what the rollout engines serve.
"""

from __future__ import annotations

import asyncio

import torch

from sao.config import Config
from sao.rollout.agent_loop import EpisodeLimits, run_episodes
from sao.runtime.queue import TrajectoryQueue
from sao.types import SamplingParams, Trajectory


class PolicyCopy:
    """The one engine-side copy of the policy the trainer's process keeps (parity gate, evaluation, sync
    generation). Its model loads on first use, so holding one costs nothing until then."""

    def __init__(self, cfg: Config, model_path):
        self.cfg, self.model_path, self._model = cfg, model_path, None

    @property
    def model(self):
        if self._model is None:
            from sao.device import resolve_device
            from sao.models.tiny import load_model

            with torch.random.fork_rng(devices=[]):  # loading draws no numbers from the run's seeded stream
                self._model = load_model(self.model_path).to(resolve_device(self.cfg.engine.device))
        return self._model

    def load(self, weights: list[torch.Tensor]) -> None:
        from sao.runtime.weight_sync import flatten

        flat, offset = flatten(weights), 0
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def engine(self, pad_id: int, max_batch: int, seed: int, version: int = 0):
        """A fresh built-in engine (its own seeded sampler) on this copy, with engine.* settings."""
        from sao.engine import make_engine

        torch_engine = self.cfg.engine.model_copy(update={"name": "torch"})  # vLLM serves the async workers only
        return make_engine(torch_engine, self.model_path, pad_id=pad_id, max_batch=max_batch, seed=seed,
                           version=version, model=self.model)


def limits_of(cfg: Config) -> EpisodeLimits:
    r = cfg.rollout
    return EpisodeLimits(r.max_turns, r.max_action_tokens, r.max_episode_tokens, r.step_timeout_s)


def generate_batch(engine, environment, codec, tasks, limits, n: int, params: SamplingParams,
                   trainer_step: int = 0) -> list[Trajectory]:
    """Run n episodes concurrently on one engine."""
    from sao.envs.base import EpisodeContext

    picked = [next(tasks) for _ in range(n)]
    return asyncio.run(run_episodes(engine, environment, codec, picked, params, limits,
                                    lambda: EpisodeContext(engine.version, trainer_step)))


def usable_batch(engine, environment, codec, tasks, limits, n: int, trainer_step: int = 0, queue=None,
                 watch=None) -> tuple[list[Trajectory], int]:
    """n trainable episodes (generating more while some fail or are empty) and the number that failed.
    `queue` (sao/runtime/groups.py make_queue) decides what is usable: whole groups for group algorithms;
    `watch` (sao/runtime/rollout_watch.py) counts every finished one and stops a run whose episodes fail."""
    queue = queue if queue is not None else TrajectoryQueue()
    failed_before = sum(queue.failed.values())
    while True:
        if len(queue) < n:
            for traj in generate_batch(engine, environment, codec, tasks, limits, n - len(queue), SamplingParams(),
                                       trainer_step):
                queue.put(traj)
                if watch is not None:
                    watch.finished(traj)
        batch, _ = queue.get_batch(n, engine.version, max_lag=1 << 30)  # one version: nothing is stale
        if batch:
            return batch, sum(queue.failed.values()) - failed_before
