"""One episode: env <-> engine <-> chat codec -> `Trajectory`. Tokens in, tokens out.

    ids = prompt tokens (chat template of env.reset(task))
    repeat up to max_turns:
        gen  = engine.generate(ids)               sampled tokens + behavior log-probs + versions
        ids += gen.token_ids                      action_mask = 1 on exactly these tokens
        step = env.step(text of gen)              text is decoded for the env, never re-encoded
        done -> reward on the last action token (truncated: the last step's reward, 0 unless the env
                gives partial credit, e.g. textworld's dense points)
        else -> ids += observation tokens         action_mask = 0 (rendered via the chat template)

An exception raised by the environment ends only this episode (status `env_error`, message kept);
a step past `step_timeout_s` ends it with status `timeout`; an engine failure (`EngineError`) ends it
with status `engine_error` (the rollout worker re-runs its task). Every `generate` names the episode
(`session`), so the engine may keep its KV cache across turns; it is released when the episode ends.
An env with a `close()` (plain or async; e.g. a client session to an environment server) has it
called once when the episode ends, whatever its status, under the same timeout; its errors are ignored.
A plain (synchronous) env step runs in its own daemon thread, not the shared default thread pool:
a step that never returns holds only its own thread (counted by `hung_steps()`), so later
episodes keep their capacity.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from dataclasses import dataclass, replace

from sao.engine.base import Engine, EngineError
from sao.envs.base import Env
from sao.models.chat import ChatCodec
from sao.types import SamplingParams, Status, Task, Trajectory


@dataclass
class EpisodeLimits:
    max_turns: int = 4
    max_action_tokens: int = 24
    max_episode_tokens: int = 256
    step_timeout_s: float = 30.0


_threads: list[threading.Thread] = []  # step threads that timed out; alive ones are hung


def hung_steps() -> int:
    """Environment steps of this process that timed out and have still not returned."""
    _threads[:] = [t for t in _threads if t.is_alive()]
    return len(_threads)


def _in_thread(fn, *args) -> asyncio.Future:
    """Run fn(*args) in a fresh daemon thread; the future resolves on the event loop."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            res = (True, fn(*args))
        except BaseException as exc:  # delivered to the episode, which records it
            res = (False, exc)
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, *res)

    thread = threading.Thread(target=target, daemon=True, name="sao-env-step")
    thread.start()
    fut.thread = thread
    return fut


async def _call(fn, *args, timeout: float):
    """Await an async env method, or run a plain one in its own thread, both under `timeout`, so a
    hanging environment ends its own episode instead of blocking every episode of the event loop."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args), timeout)
    fut = _in_thread(fn, *args)
    try:
        result = await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        _threads.append(fut.thread)
        raise
    if inspect.isawaitable(result):  # e.g. a plain function returning a coroutine
        result = await asyncio.wait_for(result, timeout)
    return result


async def _close(env: Env, timeout: float) -> None:
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        await _call(close, timeout=timeout)
    except Exception:  # the episode's status is already decided; a failing close must not change it
        pass


class _Unopened:
    """An episode whose environment raised in `new_episode`: `reset` raises that error again, so
    `run_episode` ends it as any other environment error (status `env_error`, message kept)."""

    def __init__(self, error: Exception):
        self.error = error

    def reset(self, task: Task):
        raise self.error

    def step(self, action: str):  # never reached: reset raises
        raise self.error


def open_episode(environment, ctx) -> Env:
    """`environment.new_episode(ctx)`; an exception there ends only that episode, as in reset and step
    (outside the episode it killed the slot that called it, and the episode was never finished)."""
    try:
        return environment.new_episode(ctx)
    except Exception as exc:
        return _Unopened(exc)


async def run_episode(env: Env, task: Task, engine: Engine, codec: ChatCodec, params: SamplingParams,
                      limits: EpisodeLimits, traj_id: str | None = None) -> Trajectory:
    if getattr(env, "drives_itself", False):  # env.name=agent: the user's agent owns the loop
        from sao.rollout.agent_endpoint import run_agent_episode

        return await run_agent_episode(env, task, engine, codec, params, limits, traj_id)
    started = time.time()
    params = replace(params, stop_token_ids=(codec.eos_id,))
    traj = Trajectory(id=traj_id or uuid.uuid4().hex[:12], task_id=task.id, token_ids=[], action_mask=[],
                      behavior_logprobs=[], token_versions=[], prompt_len=0, started_at=started)

    def append(ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None):
        traj.token_ids += ids
        traj.action_mask += [1 if logprobs is not None else 0] * len(ids)
        traj.behavior_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        traj.token_versions += versions if versions is not None else [-1] * len(ids)

    try:
        if hasattr(env, "open"):  # waits for a resource the environment shares (a server's free session)
            await env.open()
        messages = await _call(env.reset, task, timeout=limits.step_timeout_s)
        append(codec.prompt_ids(messages))
        traj.prompt_len = len(traj.token_ids)
        traj.status, traj.status_reason = Status.TRUNCATED, "turn limit"
        for turn in range(limits.max_turns):
            budget = min(limits.max_action_tokens, limits.max_episode_tokens - len(traj.token_ids))
            if budget <= 0:
                traj.status_reason = "token limit"
                break
            gen = await engine.generate(traj.token_ids, replace(params, max_new_tokens=budget), session=traj.id)
            append(gen.token_ids, gen.logprobs, gen.versions)
            traj.turns = turn + 1
            if gen.finish_reason != "stop":
                traj.status_reason = "action token limit"
                break
            result = await _call(env.step, codec.action_text(gen.token_ids), timeout=limits.step_timeout_s)
            traj.metrics.update({k: float(v) for k, v in result.info.items() if isinstance(v, (int, float))})
            traj.reward = float(result.reward)  # kept if the episode is truncated next (partial credit, else 0)
            if result.done:
                traj.reward, traj.status, traj.status_reason = float(result.reward), Status.OK, ""
                break
            append(codec.observation_ids(result.observation))
    except asyncio.TimeoutError:
        traj.status, traj.status_reason = Status.TIMEOUT, f"environment step over {limits.step_timeout_s}s"
    except asyncio.CancelledError:
        traj.status, traj.status_reason = Status.ABORTED, "cancelled"
        raise
    except EngineError as exc:
        traj.status, traj.status_reason = Status.ENGINE_ERROR, str(exc)[:500]
    except Exception as exc:  # a user environment's bug ends this episode only
        traj.status, traj.status_reason = Status.ENV_ERROR, f"{type(exc).__name__}: {exc}"[:500]
    finally:
        engine.release(traj.id)
        await _close(env, limits.step_timeout_s)
    traj.finished_at = time.time()
    return traj
