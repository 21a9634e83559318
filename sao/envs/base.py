"""The environment protocol and the registry of environments (docs/architecture.md §3 and §7).

An *environment* (registered by name) owns its tasks and makes one `Env` per episode:

    environment = make_environment("calc", options, seed)
    env = environment.new_episode(EpisodeContext(policy_version=3))
    messages = await env.reset(task)          # the prompt, as chat messages
    result = await env.step(action_text)      # StepResult(observation, reward, done, info)

`reset` and `step` may be plain or `async` functions; the agent loop awaits them when needed.
Users add their own with `register_environment("name", MyEnvironment)` or by naming
`"package.module:MyEnvironment"` as `env.name` in the config.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from sao.types import Task

Message = dict[str, str]  # {"role": ..., "content": ...}


@dataclass
class StepResult:
    observation: str  # text shown to the model as a tool message ("" when done)
    reward: float = 0.0  # the episode's reward, placed on the last action token: when done, and also kept
    # when the episode is truncated right after this step (partial credit; 0 for most environments)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # numeric entries become trajectory metrics


@dataclass
class EpisodeContext:
    """What an episode may know about the run when it starts."""

    policy_version: int = 0  # version of the weights the engine holds
    trainer_step: int = 0  # training steps the run has taken (critic warm-up included): the run's progress

    @property
    def trainer_version(self) -> int:
        """The name this field had before 2026-12-05 (it counts steps, not policy versions); kept for
        environments written against it."""
        return self.trainer_step


@runtime_checkable
class Env(Protocol):
    """One episode. Raise to signal a broken episode: it is recorded as `env_error`. Optional: `open()`
    (a coroutine awaited before reset and outside rollout.step_timeout_s: waiting for something episodes
    share, e.g. a server's free session; bounded by the environment) and `close()`."""

    def reset(self, task: Task) -> list[Message]: ...

    def step(self, action: str) -> StepResult: ...


class EnvOptions(BaseModel):
    """Base class of per-environment options; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Environment(Protocol):
    """A registered environment: its options model, its tasks, and an Env per episode."""

    Options: type[EnvOptions]

    def train_tasks(self) -> Iterator[Task]: ...

    def eval_tasks(self, n: int) -> list[Task]: ...

    def new_episode(self, ctx: EpisodeContext) -> Env: ...


_REGISTRY: dict[str, type] = {}


def import_path(path: str, what: str, need_callable: bool = False) -> Any:
    """`module:attr` from env.options.`what`, imported; a ValueError naming the option otherwise."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"env.options.{what}: expected module:name, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"env.options.{what}: cannot import module {module_name!r} ({exc})") from None
    value = getattr(module, attr, None)
    if value is None or need_callable and not callable(value):
        kind = "function" if need_callable else "attribute"
        raise ValueError(f"env.options.{what}: module {module_name!r} has no {kind} {attr!r}")
    return value


def register_environment(name: str, cls: type) -> type:
    _REGISTRY[name] = cls
    return cls


def portable_environment(name: str) -> bytes | None:
    """A user environment registered in this process, pickled (cloudpickle: by value when its module
    cannot be imported by name, e.g. a notebook or a script's __main__) for processes that start
    without it; None for built-in environments and `module:Class` names."""
    cls = _REGISTRY.get(name)
    if cls is None or cls.__module__.startswith("sao."):
        return None
    import cloudpickle

    return cloudpickle.dumps(cls)


def install_environment(name: str, blob: bytes) -> None:
    """Register, in this process, an environment class sent by `portable_environment`."""
    import cloudpickle

    register_environment(name, cloudpickle.loads(blob))


def resolve_environment(name: str) -> type:
    """A registered name, or `module:Class` imported on demand."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"env.name: cannot import module {module_name!r} ({exc})") from None
        if not hasattr(module, attr):
            raise ValueError(f"env.name: module {module_name!r} has no attribute {attr!r}")
        return getattr(module, attr)
    known = ", ".join(sorted(_REGISTRY))
    raise ValueError(f"env.name: unknown environment {name!r} (known: {known}; or give module:Class)")


def _keys_named(exc: ValueError) -> set[str]:
    """The option an error of make_environment names (env.options.KEY...: ...)."""
    head = str(exc).split(":", 1)[0]
    return {head.removeprefix("env.options.").split(".")[0].split("[")[0]} if head.startswith("env.options.") else set()


def make_environment(name: str, options: dict[str, Any], seed: int):
    """Instantiate an environment with validated options; errors name the bad `env.options` key."""
    from pydantic import ValidationError

    if "curriculum" in options:  # env.options over training steps: one environment per stage (sao/envs/curriculum.py)
        from sao.envs.curriculum import Curriculum, parse_stages

        base, stages = parse_stages(options)
        environments = []
        for i, (_, over) in enumerate(stages):
            try:
                environments.append(make_environment(name, {**base, **over}, seed))
            except ValueError as exc:
                where = f"env.options.curriculum[{i}]."
                raise ValueError(str(exc).replace("env.options.", where, 1) if over.keys() & _keys_named(exc)
                                 else str(exc)) from None
        return Curriculum(environments, [s for s, _ in stages])
    cls = resolve_environment(name)
    options_model = getattr(cls, "Options", EnvOptions)
    try:
        opts = options_model(**options)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(["env.options", *(str(p) for p in err["loc"])])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            from sao.config import did_you_mean

            msg = "unknown key" + did_you_mean(where, [f"env.options.{k}" for k in options_model.model_fields])
        raise ValueError(f"{where}: {msg}") from None
    return cls(opts, seed=seed)
