"""The rollout worker: `concurrency` episode slots sharing one engine, fed by the trainer.

The trainer issues `Assignment`s (pacing and staleness accounting are global, in the trainer);
the backend puts them into `inbox`. Each slot loops: await the next assignment (no polling), run
one episode, emit the finished trajectory at once. There is no group barrier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sao.engine.base import Engine
from sao.envs.base import EpisodeContext
from sao.models.chat import ChatCodec
from sao.rollout.agent_loop import EpisodeLimits, open_episode, run_episode
from sao.types import Assignment, SamplingParams, Trajectory

STOP = None  # put into the inbox once per slot to end the worker


async def run_rollout_worker(
    engine: Engine,
    environment,
    codec: ChatCodec,
    params: SamplingParams,
    limits: EpisodeLimits,
    inbox: asyncio.Queue,
    emit: Callable[[Trajectory], None],
    concurrency: int,
) -> int:
    """Run assignments from `inbox` until each slot takes a `STOP`; returns episodes run."""
    done = [0]

    async def slot() -> None:
        while True:
            item: Assignment | None = await inbox.get()
            if item is STOP:
                return
            ctx = EpisodeContext(policy_version=engine.version, trainer_step=item.trainer_step)
            traj = await run_episode(open_episode(environment, ctx, item.task), item.task, engine, codec, params, limits,
                                     traj_id=item.id)
            done[0] += 1
            emit(traj)

    slots = [asyncio.create_task(slot()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*slots)
    except BaseException:  # one slot died: end the others too, so the worker stops as a whole (the backend
        for s in slots:     # restarts it and the trainer issues its unfinished episodes again), rather than
            s.cancel()      # serving on with fewer slots and never finishing the dead slot's episode
        await asyncio.gather(*slots, return_exceptions=True)
        raise
    return done[0]
