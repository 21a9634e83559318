"""Calling an environment (or an agent function) from an episode without letting it block the others.

    call_env(fn, *args, timeout)   await an async method, or run a plain one in its own daemon thread,
                                   both under `timeout`; a step that never returns holds only its own
                                   thread (counted by `hung_steps()`), so later episodes keep their capacity
    close_env(env, timeout)        an env's `close()` (plain or async), once, its errors ignored
    open_episode(environment, ctx, task)  `environment.new_episode(ctx)` (of the task's own stage for a
                                   curriculum, sao/envs/curriculum.py); an exception there ends only that episode
"""

from __future__ import annotations

import asyncio
import inspect
import threading

from sao.envs.base import Env
from sao.types import Task

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


async def call_env(fn, *args, timeout: float):
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


async def close_env(env: Env, timeout: float) -> None:
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        await call_env(close, timeout=timeout)
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


def open_episode(environment, ctx, task: Task | None = None) -> Env:
    """`environment.new_episode(ctx)`; an exception there ends only that episode, as in reset and step
    (outside the episode it killed the slot that called it, and the episode was never finished). An
    environment with `environment_for(task)` (a curriculum) opens the episode on the one the task came from."""
    try:
        staged = getattr(environment, "environment_for", None)
        if staged is not None and task is not None:
            environment = staged(task)
        return environment.new_episode(ctx)
    except Exception as exc:
        return _Unopened(exc)
