"""The rollout worker: `concurrency` episode slots sharing one engine, paced by the trainer.

Each slot loops: wait for admission (the staleness pacing), take the next task, run one episode,
emit the finished trajectory at once. There is no group barrier: a trajectory is emitted the
moment it finishes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from sao.engine.base import Engine
from sao.envs.base import EpisodeContext
from sao.models.chat import ChatCodec
from sao.rollout.agent_loop import EpisodeLimits, run_episode
from sao.types import SamplingParams, Task, Trajectory


async def run_rollout_worker(
    engine: Engine,
    environment,
    codec: ChatCodec,
    params: SamplingParams,
    limits: EpisodeLimits,
    tasks: Iterator[Task],
    admit: Callable[[], bool],
    emit: Callable[[Trajectory], None],
    concurrency: int,
    should_stop: Callable[[], bool],
    trainer_version: Callable[[], int] = lambda: 0,
) -> dict[str, float]:
    """Run until `should_stop()`; returns time the slots spent waiting on pacing."""
    waited = {"pacing_wait_s": 0.0, "episodes": 0}

    async def slot() -> None:
        while not should_stop():
            if not admit():
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                waited["pacing_wait_s"] += time.perf_counter() - t0
                continue
            task = next(tasks)
            ctx = EpisodeContext(policy_version=engine.version, trainer_version=trainer_version())
            env = environment.new_episode(ctx)
            traj = await run_episode(env, task, engine, codec, params, limits)
            waited["episodes"] += 1
            emit(traj)

    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return waited
