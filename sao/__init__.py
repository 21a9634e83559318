"""sao: asynchronous RL of LLM agents with Single-rollout Asynchronous Optimization.

The Python API (sao/api.py), imported lazily so that `import sao.types` stays light:

    from sao import Config, load_config, train, evaluate
"""

import os

# OpenMP threads that finished their share of a parallel region sleep instead of spinning (GNU OpenMP
# spins ~300k iterations first by default). On a few cores the trainer's spinning threads take CPU from
# the rollout worker (measured in docs/performance.md §3). Read when torch first
# loads its OpenMP runtime, so it applies to processes that import sao before torch (the CLI, the rollout
# workers); export OMP_WAIT_POLICY yourself to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["Config", "ConfigError", "load_config", "train", "evaluate", "use_environment"]


def __getattr__(name: str):
    if name in __all__:
        from sao import api

        return getattr(api, name)
    raise AttributeError(f"module 'sao' has no attribute {name!r}")
