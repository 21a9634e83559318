"""Held-out evaluation of a pinned policy version with the built-in engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sao.engine.torch_engine import TorchEngine
from sao.envs.base import EpisodeContext
from sao.models.chat import ChatCodec
from sao.rollout.agent_loop import EpisodeLimits, run_episode
from sao.types import SamplingParams, Status, Task, Trajectory


@dataclass
class EvalResult:
    accuracy: float  # mean reward over held-out tasks (reward 1 = solved)
    n: int
    statuses: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    trajectories: list[Trajectory] = field(default_factory=list)


async def _evaluate(engine, environment, codec, tasks, limits, params, version, step) -> list[Trajectory]:
    async def one(task: Task) -> Trajectory:
        env = environment.new_episode(EpisodeContext(policy_version=version, trainer_version=step))
        return await run_episode(env, task, engine, codec, params, limits)

    try:
        return await asyncio.gather(*(one(t) for t in tasks))
    finally:
        await engine.close()


def evaluate(model, codec: ChatCodec, environment, tasks: list[Task], limits: EpisodeLimits,
             greedy: bool = True, seed: int = 0, version: int = 0, max_batch: int = 128,
             trainer_step: int = 0) -> EvalResult:
    """Run every task once with a pinned policy version; `trainer_step` is what episodes see as the
    run's progress (environments whose reward changes over time use it)."""
    params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=seed)
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=max_batch, seed=seed, version=version)
    was_training = model.training
    trajs = asyncio.run(_evaluate(engine, environment, codec, tasks, limits, params, version, trainer_step))
    model.train(was_training)
    statuses: dict[str, int] = {}
    for t in trajs:
        statuses[t.status.value] = statuses.get(t.status.value, 0) + 1
    keys = sorted({k for t in trajs for k in t.metrics})
    metrics = {k: sum(t.metrics.get(k, 0.0) for t in trajs) / len(trajs) for k in keys}
    metrics["turns"] = sum(t.turns for t in trajs) / len(trajs)
    metrics["distinct_tasks"] = float(len({t.prompt for t in tasks}))  # fewer than n when held-out problems repeat
    solved = [t.reward if t.status == Status.OK else 0.0 for t in trajs]
    return EvalResult(sum(solved) / len(trajs), len(trajs), statuses, metrics, trajs)
