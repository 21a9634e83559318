"""Environments: the `Env` protocol, the registry and the built-in environments."""

from sao.envs import (  # noqa: F401  (register the built-in environments)
    agent,
    calc,
    code_env,
    harbor_env,
    math_env,
    openenv_adapter,
    style_shift,
    textworld_env,
    textworld_express_env,
    verifiers_env,
)
from sao.envs.base import (  # noqa: F401
    Env,
    EnvOptions,
    EpisodeContext,
    StepResult,
    make_environment,
    register_environment,
    resolve_environment,
)
