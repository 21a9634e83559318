"""One episode: env <-> engine <-> chat codec -> `Trajectory`. Tokens in, tokens out.

`run_episode` is the one entry for every episode; it picks the episode's driver by its type (an
`AgentEpisode` is driven by the user's agent through the endpoint, sao/rollout/agent_episode.py;
every other environment by the turn loop below), and both build the trajectory with one
`TrajectoryBuilder` (sao/rollout/trajectory.py). The turn loop:

    ids = prompt tokens (chat template of env.reset(task))
    repeat up to max_turns:
        gen  = engine.generate(ids)               sampled tokens + behavior log-probs + versions
        ids += gen.token_ids                      action_mask = 1 on exactly these tokens
        step = env.step(text of gen)              text is decoded for the env, never re-encoded
        done -> reward on the last action token (truncated: the last step's reward, 0 unless the env
                gives partial credit, e.g. textworld's dense points)
        else -> ids += observation tokens         action_mask = 0 (rendered via the chat template)

An exception raised by the environment ends only this episode (the builder's status ladder) (status `env_error`, message kept);
a step past `step_timeout_s` ends it with status `timeout`; an engine failure (`EngineError`) ends it
with status `engine_error` (the rollout worker re-runs its task). Every `generate` names the episode
(`session`), so the engine may keep its KV cache across turns; it is released when the episode ends.
An env with a `close()` (plain or async; e.g. a client session to an environment server) has it
called once when the episode ends, whatever its status, under the same timeout; its errors are ignored.
A plain (synchronous) env step runs in its own daemon thread (sao/rollout/env_calls.py).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace

from sao.engine.base import Engine
from sao.engine.sampling import episode_seed
from sao.envs.agent import AgentEpisode
from sao.envs.base import Env
from sao.models.chat import ChatCodec
from sao.rollout.agent_episode import drive_agent
from sao.rollout.env_calls import call_env, close_env, hung_steps, open_episode
from sao.rollout.trajectory import CHARS_PER_TOKEN_BOUND, TrajectoryBuilder, finite_reward
from sao.types import SamplingParams, Status, Task, Trajectory

__all__ = ["EpisodeLimits", "hung_steps", "open_episode", "run_episode", "run_episodes"]


@dataclass
class EpisodeLimits:
    max_turns: int = 4
    max_action_tokens: int = 24
    max_episode_tokens: int = 256
    step_timeout_s: float = 30.0


def bounded_observation(codec: ChatCodec, text, room: int) -> list[int] | None:
    """The observation's tokens if they fit in `room` tokens, else None. An untrusted observation may be
    huge: it is cut to what could possibly fit before it is tokenized, so this takes bounded time."""
    text = str(text)
    limit = max(room, 0) * CHARS_PER_TOKEN_BOUND + 256
    if len(text) > limit:
        return None
    ids = codec.observation_ids(text)
    return ids if len(ids) <= room else None


async def drive_turns(env: Env, task: Task, build: TrajectoryBuilder, engine: Engine, codec: ChatCodec,
                      params: SamplingParams, limits: EpisodeLimits) -> None:
    """reset, then generate and step until done or a limit; the environment is closed at the end."""
    traj = build.traj
    params = replace(params, stop_token_ids=(codec.eos_id,))
    try:
        if hasattr(env, "open"):  # waits for a resource the environment shares (a server's free session)
            await env.open()
        messages = await call_env(env.reset, task, timeout=limits.step_timeout_s)
        size = sum(len(str(m.get("content", ""))) for m in messages) if isinstance(messages, list) else 0
        if size > limits.max_episode_tokens * CHARS_PER_TOKEN_BOUND + 256:  # refused before tokenizing it
            raise ValueError(f"the reset prompt has {size} characters, more than rollout.max_episode_tokens="
                             f"{limits.max_episode_tokens} tokens can hold")
        build.context(codec.prompt_ids(messages))
        build.end(Status.TRUNCATED, "turn limit")
        for _ in range(limits.max_turns):
            budget = min(limits.max_action_tokens, limits.max_episode_tokens - len(build.token_ids))
            if budget <= 0:
                traj.status_reason = "token limit"
                break
            gen = await engine.generate(build.token_ids, replace(params, max_new_tokens=budget), session=build.id)
            build.sampled(gen)
            if gen.finish_reason != "stop":
                traj.status_reason = "action token limit"
                break
            result = await call_env(env.step, codec.action_text(gen.token_ids), timeout=limits.step_timeout_s)
            traj.metrics.update({k: float(v) for k, v in result.info.items()  # finite numbers only
                                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})
            traj.reward = finite_reward(result.reward)  # kept if truncated next (partial credit, else 0)
            if result.done:
                build.end(Status.OK, "", result.reward)
                break
            room = limits.max_episode_tokens - len(build.token_ids)
            observation = bounded_observation(codec, result.observation, room)
            if observation is None:  # it would not fit: the episode ends here, truncated (nothing appended)
                traj.status_reason = "observation over the token budget"
                break
            build.context(observation)
    except BaseException as exc:
        build.fail(exc, f"environment step over {limits.step_timeout_s}s")
    finally:
        await close_env(env, limits.step_timeout_s)


async def run_episode(env: Env, task: Task, engine: Engine, codec: ChatCodec, params: SamplingParams,
                      limits: EpisodeLimits, traj_id: str | None = None) -> Trajectory:
    build = TrajectoryBuilder(task.id, traj_id)
    driver = drive_agent if isinstance(env, AgentEpisode) else drive_turns  # agent: the user's agent owns the loop
    try:
        await driver(env, task, build, engine, codec, params, limits)
    finally:
        engine.release(build.id)
    return build.done(limits)


async def run_episodes(engine: Engine, environment, codec: ChatCodec, tasks: list[Task], params: SamplingParams,
                       limits: EpisodeLimits, context) -> list[Trajectory]:
    """Every task once, concurrently, on one engine in this process (sync mode, evaluation, the parity
    gate); `context()` is each episode's `EpisodeContext`. The engine is closed at the end. With a
    `params.seed`, episode i samples with `episode_seed(seed, i, task.id)`: the same tokens whatever the
    batching (sao/engine/sampling.py), so policies evaluated with one seed share their random numbers."""
    def own(i: int, task: Task) -> SamplingParams:
        return params if params.seed is None else replace(params, seed=episode_seed(params.seed, i, task.id))

    try:
        return await asyncio.gather(*(run_episode(open_episode(environment, context(), task), task, engine, codec,
                                                  own(i, task), limits) for i, task in enumerate(tasks)))
    finally:
        await engine.close()
