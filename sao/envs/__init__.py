"""Environments: the `Env` protocol, the registry and the built-in environments."""

from sao.envs import calc  # noqa: F401  (registers "calc")
from sao.envs.base import (  # noqa: F401
    Env,
    EnvOptions,
    EpisodeContext,
    StepResult,
    make_environment,
    register_environment,
    resolve_environment,
)
