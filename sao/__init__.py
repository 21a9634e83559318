"""sao: asynchronous RL of LLM agents with Single-rollout Asynchronous Optimization.

The Python API (sao/api.py), imported lazily so that `import sao.types` stays light:

    from sao import Config, load_config, train, evaluate
"""

__all__ = ["Config", "ConfigError", "load_config", "train", "evaluate", "use_environment"]


def __getattr__(name: str):
    if name in __all__:
        from sao import api

        return getattr(api, name)
    raise AttributeError(f"module 'sao' has no attribute {name!r}")
