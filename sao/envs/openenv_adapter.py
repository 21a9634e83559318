"""`openenv`: any OpenEnv environment (the `openenv-core` package), in process or behind its server.

OpenEnv's shape is sao's episode shape: `reset() -> Observation`, `step(Action) -> Observation` with
`reward` and `done`. Only two things are environment-specific, and both have defaults:

    action text -> Action        the JSON object inside `<action>...</action>` (options.action_tag), or the
                                 tag's text as one string field (options.action_field), or `parse_action`
    Observation -> text          its text fields (options.observation_fields), or `render_observation`

Both paths see an Observation the same way: the dict OpenEnv's server sends (its fields without
`reward`, `done` and `metadata`), plus reward and done. In process (`env_class`) one Environment
instance serves one episode; by URL (`url`) each episode opens its own WebSocket session through
OpenEnv's own client: a server at its session limit (OpenEnv allows one session unless the server
sets `max_concurrent_envs`) answers "full" with its limit, and the episode waits for a free session
(`SessionGate`, up to options.session_wait_s) instead of failing. A task is a reset seed. A server
that dies gives the episode `env_error`; one that stops answering gives `timeout` (the agent loop's
`rollout.step_timeout_s`); the episode's client is closed either way. An action the Action model
rejects is the policy's fault: it is shown as an observation (or ends the episode with reward 0,
options.invalid_action), never `env_error`.

`openenv-core` is an optional extra (`pip install 'sao[openenv]'`), imported on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import threading
import time
import typing
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from sao.envs.base import EnvOptions, EpisodeContext, Message, StepResult, import_path, register_environment
from sao.types import Task

NOT_OBSERVED = ("reward", "done", "metadata")  # what OpenEnv's serialize_observation leaves out of the dict
MISSING = "the openenv-core package is not installed (pip install 'sao[openenv]')"


class InvalidAction(ValueError):
    """The policy's text is not an Action this environment accepts (its fault, not the environment's)."""


class OpenEnvOptions(EnvOptions):
    env_class: str | None = Field(None, description=(
        "`module:Class` of an OpenEnv Environment, run in this process (one instance per episode)"))
    url: str | None = Field(None, description="base URL of a running OpenEnv server (one WebSocket session per episode)")
    action_class: str | None = Field(None, description=(
        "`module:Class` of the Action (env_class only); default: the Environment's first type parameter"))
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of env_class()")
    reset_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments of every reset()")
    action_tag: str | None = Field("action", pattern=r"^[A-Za-z_][\w-]*$|^$", description=(
        "the action is the text inside <tag>...</tag> (the last one); empty or null: the whole reply"))
    action_field: str | None = Field(None, description=(
        "put the action text into this one Action field (a text-action environment) instead of parsing JSON"))
    parse_action: str | None = Field(None, description="`module:func` (text) -> dict of Action fields; overrides the two above")
    observation_fields: list[str] | None = Field(None, description=(
        "Observation fields shown to the model (empty ones left out; one alone without its name); default: "
        "every field whose value is text"))
    render_observation: str | None = Field(None, description=(
        "`module:func` (dict of Observation fields) -> text; overrides observation_fields"))
    system_prompt: str = Field("", description="a system message before the first observation (empty: none)")
    reward: Literal["sum", "last"] = Field("sum", description=(
        "episode reward: the sum of every step's reward, or the last step's (None counts as 0)"))
    invalid_action: Literal["observe", "end"] = Field("observe", description=(
        "an action the environment rejects: shown to the model as an error observation, or ends the episode (reward 0)"))
    connect_timeout_s: float = Field(10.0, gt=0, description="url: seconds to wait for the server at start and per session")
    session_wait_s: float = Field(600.0, gt=0, description=(
        "url: how long an episode waits for a free session when the server is at its session limit "
        "(then it fails as env_error)"))
    demo: str | None = Field(None, description=(
        "`module:func` (observation text, random.Random) -> reply text: a scripted policy whose in-process "
        "episodes SFT-warm-start the built-in tiny model (env_class only; with model.path it is not needed)"))
    eval_seed_offset: int = Field(1, description="held-out tasks use odd reset seeds (train: even) drawn with data_seed + this")

    @model_validator(mode="after")
    def _one_source(self) -> OpenEnvOptions:
        if (self.env_class is None) == (self.url is None):
            raise ValueError("give exactly one of env_class (module:Class, in process) and url (a running server)")
        if self.action_class and not self.env_class:
            raise ValueError("action_class is for env_class; a server validates actions itself")
        if self.demo and not self.env_class:
            raise ValueError("demo episodes run in process: give env_class")
        return self


def _openenv():
    try:
        from openenv.core.env_server import interfaces, serialization, types
    except ImportError as exc:
        raise ValueError(f"env.name=openenv: {MISSING} ({exc})") from None
    return interfaces, serialization, types


def action_class_of(env_cls: type) -> type | None:
    """The Action type parameter of `class MyEnv(Environment[MyAction, MyObservation, MyState])`."""
    _, _, types = _openenv()
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, types.Action):
                    return arg
    return None


# -- text <-> OpenEnv -------------------------------------------------------------------------------


def default_parser(tag: str | None, field: str | None) -> Callable[[str], dict]:
    pattern = re.compile(rf"<{tag}>(.*?)</{tag}>", re.S) if tag else None

    def parse(text: str) -> dict:
        if pattern is None:
            body = text.strip()
        else:
            found = pattern.findall(text)
            if not found:
                raise InvalidAction(f"no <{tag}>...</{tag}> in the reply")
            body = found[-1].strip()
        if field is not None:
            return {field: body}
        try:
            value = json.loads(body)
        except ValueError as exc:
            raise InvalidAction(f"the action is not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise InvalidAction("the action must be a JSON object of the Action's fields")
        return value

    return parse


def default_renderer(fields: list[str] | None) -> Callable[[dict], str]:
    def render(obs: dict) -> str:
        picked = {k: obs.get(k) for k in fields} if fields else {k: v for k, v in obs.items() if isinstance(v, str)}
        shown = {k: v for k, v in picked.items() if v not in (None, "")}
        if not shown:
            return "" if picked else json.dumps(obs, default=str)
        if len(shown) == 1:
            return str(next(iter(shown.values())))
        return "\n".join(f"{k}: {v}" for k, v in shown.items())

    return render


def validation_summary(errors: list[dict]) -> str:
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or "action"
    return f"{where}: {first.get('msg', 'invalid')}"


# -- episodes ---------------------------------------------------------------------------------------


class _Episode:
    """What both paths share: turning text into an action dict and an observation dict into a StepResult."""

    def __init__(self, codec: OpenEnvCodec) -> None:
        self.codec, self.total = codec, 0.0

    def first_messages(self, obs: dict) -> list[Message]:
        system = [{"role": "system", "content": self.codec.options.system_prompt}] if self.codec.options.system_prompt else []
        return system + [{"role": "user", "content": self.codec.render(obs["observation"])}]

    def result(self, obs: dict) -> StepResult:
        reward = float(obs.get("reward") or 0.0)
        self.total += reward
        if obs.get("done"):
            final = self.total if self.codec.options.reward == "sum" else reward
            return StepResult("", final, True, {"openenv/last_reward": reward})
        return StepResult(self.codec.render(obs["observation"]))

    def rejected(self, reason: str) -> StepResult:
        if self.codec.options.invalid_action == "end":
            return StepResult("", 0.0, True, {"openenv/invalid_action": 1.0})
        return StepResult(f"invalid action: {reason}"[:1000])


class LocalEpisode(_Episode):
    """One in-process Environment instance. Plain methods (the agent loop runs each in its own thread,
    under rollout.step_timeout_s); an environment that asks for one thread gets its own executor."""

    def __init__(self, codec: OpenEnvCodec) -> None:
        super().__init__(codec)
        self.env = None  # made in reset, where a failing constructor ends only this episode
        self._one_thread = ThreadPoolExecutor(1) if getattr(codec.env_cls, "REQUIRES_SINGLE_THREAD_EXECUTOR", False) else None
        if self._one_thread is not None:  # the agent loop awaits coroutines under the same timeout
            self.reset, self.step = self._threaded(self._reset), self._threaded(self._step)
        else:
            self.reset, self.step = self._reset, self._step

    def _threaded(self, fn):
        async def run(arg):
            return await asyncio.get_running_loop().run_in_executor(self._one_thread, fn, arg)

        return run

    def _reset(self, task: Task) -> list[Message]:
        self.env = self.codec.env_cls(**self.codec.options.env_kwargs)
        obs = self.env.reset(seed=task.meta["seed"], **self.codec.options.reset_kwargs)
        return self.first_messages(self.codec.serialize(obs))

    def _step(self, text: str) -> StepResult:
        _, serialization, _ = _openenv()
        try:
            action = serialization.deserialize_action(self.codec.parse(text), self.codec.action_cls)
        except InvalidAction as exc:
            return self.rejected(str(exc))
        except ValidationError as exc:  # the Action model refused the fields
            return self.rejected(validation_summary(exc.errors()))
        return self.result(self.codec.serialize(self.env.step(action)))

    def close(self) -> None:
        try:
            if self.env is not None:
                self.env.close()
        finally:
            if self._one_thread is not None:
                self._one_thread.shutdown(wait=False)


class SessionsFull(RuntimeError):
    """The server refused a session: it holds `max_sessions` already (OpenEnv's CAPACITY_REACHED)."""

    def __init__(self, max_sessions: int | None, message: str) -> None:
        super().__init__(message)
        self.max_sessions = max_sessions


class SessionGate:
    """This process's view of one server's sessions. The limit is unknown until the server first answers
    "full" (its CAPACITY_REACHED reply names max_sessions); from then on episodes wait here, without
    touching the network, until one of this process's sessions closes. Sessions held by other processes
    (other rollout workers) show up as more "full" answers, retried with backoff."""

    def __init__(self) -> None:
        self.limit: int | None = None
        self.held = 0
        self._lock = threading.Lock()  # the thread backend runs an event loop per thread on one environment

    def take(self) -> bool:
        with self._lock:
            if self.limit is not None and self.held >= self.limit:
                return False
            self.held += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.held -= 1

    def full(self, max_sessions: int | None) -> None:
        with self._lock:
            self.held -= 1
            if max_sessions:
                self.limit = max_sessions


class ServerEpisode(_Episode):
    """One WebSocket session on a running server, through OpenEnv's own client (async: the session's
    socket lives on the rollout worker's event loop). `open` (before reset, outside rollout.step_timeout_s)
    waits for a free session."""

    def __init__(self, codec: OpenEnvCodec) -> None:
        super().__init__(codec)
        self.client = codec.new_client()
        self.holding = False

    async def open(self) -> None:
        """Connect and ask for the session's state: a session was granted, or the server is full and the
        episode waits for a free one (up to options.session_wait_s, then `env_error` saying so)."""
        o, gate = self.codec.options, self.codec.gate
        t0, delay, limit = time.monotonic(), 0.05, None
        while True:
            if gate.take():
                self.holding = True
                try:
                    await asyncio.wait_for(self.client.probe(), o.connect_timeout_s)
                    return
                except SessionsFull as exc:
                    self.holding = False
                    gate.full(exc.max_sessions)
                    await self.client.close()
                    self.client = self.codec.new_client()
                    limit = exc.max_sessions
                except BaseException:
                    self.holding = False
                    gate.give_back()
                    raise
            if time.monotonic() - t0 > o.session_wait_s:
                raise RuntimeError(f"no free session on the OpenEnv server for {o.session_wait_s:g}s (it allows "
                                   f"{limit if gate.limit is None else gate.limit}; env.options.session_wait_s)")
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def reset(self, task: Task) -> list[Message]:
        return self.first_messages(await self.client.call("reset", {"seed": task.meta["seed"],
                                                                    **self.codec.options.reset_kwargs}))

    async def step(self, text: str) -> StepResult:
        try:
            payload = self.codec.parse(text)
        except InvalidAction as exc:
            return self.rejected(str(exc))
        try:
            return self.result(await self.client.call("step", payload))
        except InvalidAction as exc:
            return self.rejected(str(exc))

    async def close(self) -> None:
        try:
            await self.client.close()
        finally:
            if self.holding:
                self.holding = False
                self.codec.gate.give_back()


def session_client(base_url: str, timeout_s: float):
    """OpenEnv's generic WebSocket client; a server's VALIDATION_ERROR reply becomes InvalidAction."""
    from openenv.core.generic_client import GenericEnvClient

    class SessionClient(GenericEnvClient):
        async def call(self, kind: str, data: dict | None) -> dict:
            await self._send({"type": kind} if data is None else {"type": kind, "data": data})
            reply = await self._receive()
            if reply.get("type") == "error":
                err = reply.get("data", {})
                if err.get("code") == "VALIDATION_ERROR":
                    raise InvalidAction(validation_summary(err.get("errors") or []))
                if err.get("code") == "CAPACITY_REACHED":
                    raise SessionsFull(err.get("max_sessions"), f"OpenEnv server full: {err.get('message')}"[:500])
                raise RuntimeError(f"OpenEnv server error {err.get('code')}: {err.get('message')}"[:500])
            return reply.get("data", {})

        async def probe(self) -> None:
            """Open the session: the server creates it on connect and answers the first message, with
            CAPACITY_REACHED when full (SessionsFull). A state request costs the environment nothing; an
            environment with no state before reset answers an error, and the session is still open."""
            from websockets.exceptions import ConnectionClosed

            try:
                await self.call("state", None)
            except SessionsFull:
                raise
            except ConnectionClosed as exc:  # closed before our message: a full server's reply may be queued
                queued = await self._queued_error()
                if queued.get("code") == "CAPACITY_REACHED":
                    raise SessionsFull(queued.get("max_sessions"), f"OpenEnv server full: {queued.get('message')}"[:500]) \
                        from None
                raise SessionsFull(None, f"OpenEnv server closed the session at once ({exc})") from None
            except (RuntimeError, InvalidAction):  # an execution error: the session exists
                pass

        async def _queued_error(self) -> dict:
            """The error a server sent before it closed the socket (a full server answers CAPACITY_REACHED and
            closes at once, which can fail our send before its reply is read): received messages are still
            delivered after the close. {} when there is none."""
            try:
                reply = json.loads(await asyncio.wait_for(self._ws.recv(), 0.5)) if self._ws is not None else {}
            except Exception:  # noqa: BLE001 - nothing was queued, or the socket is gone: the caller says so
                return {}
            return reply.get("data", {}) if isinstance(reply, dict) and reply.get("type") == "error" else {}

        async def disconnect(self) -> None:
            """Say close, then let the server close the socket first (closing at once makes openenv-core
            0.3's server log a traceback per session under starlette 1.x)."""
            try:
                if self._ws is not None:
                    with contextlib.suppress(Exception):
                        await self._send({"type": "close"})
                        await asyncio.wait_for(self._ws.wait_closed(), 0.25)  # a busy (hung) server: close anyway
            finally:
                await super().disconnect()

    # message_timeout_s is only a backstop: rollout.step_timeout_s normally ends a silent step first
    return SessionClient(base_url=base_url, connect_timeout_s=timeout_s, message_timeout_s=3600.0)


class OpenEnvCodec:
    """The options, resolved once: classes and functions imported, the server checked."""

    def __init__(self, options: OpenEnvOptions) -> None:
        self.options = options
        interfaces, serialization, _ = _openenv()
        self.serialize = serialization.serialize_observation
        o = options
        self.parse = (import_path(o.parse_action, "parse_action") if o.parse_action
                      else default_parser(o.action_tag, o.action_field))
        self.render = (import_path(o.render_observation, "render_observation") if o.render_observation
                       else default_renderer(o.observation_fields))
        if o.env_class:
            self.env_cls = import_path(o.env_class, "env_class")
            if not (isinstance(self.env_cls, type) and issubclass(self.env_cls, interfaces.Environment)):
                raise ValueError(f"env.options.env_class: {o.env_class!r} is not an OpenEnv Environment subclass")
            self.action_cls = import_path(o.action_class, "action_class") if o.action_class else action_class_of(self.env_cls)
            if self.action_cls is None:
                raise ValueError(f"env.options.action_class: cannot tell the Action class of {o.env_class!r}; "
                                 "give action_class (module:Class)")
        else:
            self.base_url = o.url.rstrip("/")
            check_server(self.base_url, o.connect_timeout_s)
            self.gate = SessionGate()

    def new_client(self):
        return session_client(self.base_url, self.options.connect_timeout_s)


def check_server(base_url: str, timeout_s: float) -> None:
    """An OpenEnv server answers GET /health; anything else is one line at start, not N failed episodes."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as reply:
            reply.read()
    except Exception as exc:
        raise ValueError(f"env.options.url: no OpenEnv server answers at {base_url}/health ({exc})") from None


class OpenEnvEnvironment:
    """A task is a reset seed (train: even, held-out: odd, so the splits never meet)."""

    Options = OpenEnvOptions

    def __init__(self, options: OpenEnvOptions, seed: int = 0):
        self.options, self.seed = options, seed
        self.codec = OpenEnvCodec(options)
        if options.demo:  # only then: without demo() the built-in model cannot be warm-started (model_setup)
            self.policy = import_path(options.demo, "demo")
            self.demo = self._demo

    @staticmethod
    def _task(seed: int) -> Task:
        return Task(id=f"openenv-{seed}", prompt="", meta={"seed": seed})

    def train_tasks(self) -> Iterator[Task]:
        rng = random.Random(self.seed)
        while True:
            yield self._task(2 * rng.randrange(2**30))

    def eval_tasks(self, n: int) -> list[Task]:
        rng = random.Random(self.seed + self.options.eval_seed_offset)
        return [self._task(2 * rng.randrange(2**30) + 1) for _ in range(n)]

    def _demo(self, task: Task, rng: random.Random, max_turns: int = 16) -> list[Message]:
        """One episode of the scripted policy, as chat messages (user, assistant, tool, assistant, ...)."""
        episode = LocalEpisode(self.codec)
        try:
            messages = episode._reset(task)
            for _ in range(max_turns):
                reply = self.policy(messages[-1]["content"], rng)
                messages.append({"role": "assistant", "content": reply})
                result = episode._step(reply)
                if result.done:
                    break
                messages.append({"role": "tool", "content": result.observation})
        finally:
            episode.close()
        return messages

    def new_episode(self, ctx: EpisodeContext) -> LocalEpisode | ServerEpisode:
        return LocalEpisode(self.codec) if self.options.env_class else ServerEpisode(self.codec)


register_environment("openenv", OpenEnvEnvironment)
