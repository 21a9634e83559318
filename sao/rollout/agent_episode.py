"""One `env.name=agent` episode: the user's agent (a function or a command) runs against the worker's
endpoint (sao/rollout/agent_server.py) with its own base URL and API key; its calls build the
trajectory (sao/rollout/agent_session.py); its result gives the reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import shlex

from sao.envs.agent import AgentEpisode
from sao.models.chat import ChatCodec
from sao.rollout.agent_server import ConnectionGuard, endpoint
from sao.rollout.agent_session import AgentSession
from sao.rollout.env_calls import call_env
from sao.rollout.trajectory import TrajectoryBuilder, finite_reward
from sao.types import SamplingParams, Status, Task


class AgentFailed(RuntimeError):
    pass


async def run_command(argv: list[str], env: dict, timeout: float):
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise AgentFailed(f"agent command exited with {proc.returncode}: {err.decode(errors='replace')[-300:]}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        return lines[-1]


def reward_of(result, task_row: dict, reward_fn) -> tuple[float, dict[str, float]]:
    if reward_fn is not None:
        return finite_reward(reward_fn(task_row, result)), {}
    if isinstance(result, dict) and isinstance(result.get("reward"), (int, float)):
        extra = {f"agent/{k}": float(v) for k, v in result.items() if k != "reward" and isinstance(v, (int, float))
                 and not isinstance(v, bool) and math.isfinite(v)}
        return finite_reward(result["reward"]), extra
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return finite_reward(result), {}
    raise AgentFailed(f"the agent returned {str(result)[:100]!r}, not a reward; return a number or "
                      "{'reward': x}, or set env.options.reward")


async def drive_agent(env: AgentEpisode, task: Task, build: TrajectoryBuilder, engine, codec: ChatCodec,
                      params: SamplingParams, limits) -> None:
    """Give the agent its own base URL and key, wait for its result, take the reward from it."""
    traj, o = build.traj, env.options
    session = AgentSession(build, engine, codec, params, limits, o)
    key = "sao-" + secrets.token_hex(16)
    row = {"id": task.id, "prompt": task.prompt, "answer": task.answer, "meta": task.meta}
    ep = None
    try:
        ep = await endpoint(o.host, ConnectionGuard(o.max_connections, o.max_connections_per_episode,
                                                    o.first_request_s))  # the bounds of the first episode's options
        ep.sessions[key] = session
        if env.agent is not None:
            result = await call_env(env.agent, row, ep.base_url, key, timeout=o.timeout_s)
        else:
            extra = {"OPENAI_BASE_URL": ep.base_url, "OPENAI_API_KEY": key, "SAO_TASK": json.dumps(row, default=str)}
            result = await run_command(shlex.split(o.command), {**os.environ, **extra}, o.timeout_s)
        traj.reward, metrics = reward_of(result, row, env.reward_fn)
        traj.metrics.update(metrics)
        build.end(*((Status.TRUNCATED, session.truncated) if session.truncated else (Status.OK, "")))
    except BaseException as exc:
        build.fail(exc, f"agent ran over {o.timeout_s}s")
        if traj.status == Status.ENV_ERROR and session.truncated:  # it failed on a call refused for a
            build.end(Status.TRUNCATED, session.truncated, 0.0)  # rollout limit: a truncated episode, reward 0
    finally:
        session.closed = True
        if ep is not None:
            ep.sessions.pop(key, None)
    if session.engine_error:
        build.end(Status.ENGINE_ERROR, session.engine_error)
    elif session.calls == 0 and traj.status in (Status.OK, Status.TRUNCATED):
        build.end(Status.ENV_ERROR, "the agent made no model call")
    traj.metrics.update({"agent/calls": float(session.calls), "agent/rewrites": float(session.rewrites),
                         "agent/segments": float(len(traj.segment_starts) + 1),
                         "agent/tool_calls": float(session.tool_calls),
                         "agent/overhead_ms_per_call": 1000 * session.overhead_s / max(session.calls, 1)})
