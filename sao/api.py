"""The Python API: `from sao import Config, train, evaluate`, with the CLI's validation.

    import sao
    cfg = sao.load_config("examples/configs/code.yaml", ["train.steps=50"])   # or sao.Config(...) / a dict
    result = sao.train(cfg, env=MyEnvironment)        # a class object, defined anywhere (a notebook too)
    print(result.accuracy_before, result.accuracy_after, result.run_dir)
    print(sao.evaluate(result.run_dir, env=MyEnvironment)["accuracy"])

Bad input raises `sao.ConfigError` with the one-line message the CLI prints, before anything is written.

A user environment class passed as `env=` is registered under its class name and travels to the
rollout processes by value (cloudpickle; docs/architecture.md §4), so it may live in a notebook
or in a script's `__main__`. Those processes are forked from a multiprocessing fork server
(sao/runtime/local.py), which, like `spawn`, re-imports the caller's main module in every child (as
`__mp_main__`): a script that calls `train()` at top level would then run again in each child. While
`train()` runs, the main module is hidden from multiprocessing (as in a notebook, which has no file),
so no `if __name__ == "__main__":` guard is needed (tests/test_api.py runs a script
without one).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from sao.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config", "train", "evaluate", "use_environment"]


def as_config(config: Config | dict | str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A validated Config from a Config, a dict of sections, a YAML path or None (defaults), plus dotted
    overrides; raises ConfigError with a one-line message naming the field."""
    if isinstance(config, Config):
        if not overrides:
            return config
        merged = load_config(config.model_dump(mode="json", exclude_unset=True), list(overrides))
        merged._sources = {**merged._sources, **config._sources,
                           **{k: v for k, v in merged._sources.items() if v == "override"}}
        return merged
    return load_config(config, list(overrides))


def use_environment(env: type | str) -> str:
    """The `env.name` for `env`: a name as given, or a class registered under its class name."""
    if isinstance(env, str):
        return env
    if not isinstance(env, type):
        raise ConfigError(f"env: expected an environment class or a name, got {type(env).__name__}")
    from sao.envs import register_environment

    register_environment(env.__name__, env)
    return env.__name__


@contextlib.contextmanager
def _main_module_hidden():
    """Let the fork server start children without re-importing the caller's main module (see the module doc)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if main is None or "__file__" not in saved:
        yield  # interactive sessions and notebooks: nothing to hide
        return
    del main.__file__
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def train(config: Config | dict | str | Path | None = None, *overrides: str, env: type | str | None = None,
          progress: bool | None = None, resume: str | Path | None = None):
    """Run `sao train` in this process and return its RunResult (run_dir, accuracy_before/after, ...)."""
    cfg = as_config(config, overrides)
    if env is not None:
        cfg.env.name = use_environment(env)
    from sao.runtime.threads import set_wait_policy

    set_wait_policy(cfg.runtime.mode)  # takes effect only if torch is not imported yet (sao/runtime/threads.py)
    environment = _preflight(cfg, Path(resume) if resume is not None else None)
    from sao.runtime.progress import RunProgress
    from sao.runtime.train import train as run_training

    enabled = cfg.output.progress if progress is None else progress
    with _main_module_hidden():
        return run_training(cfg, RunProgress(enabled=enabled and sys.stderr.isatty()), resume=resume,
                            environment=environment)


def _preflight(cfg: Config, resume: Path | None):
    """The CLI's checks before anything is written (returns the environment); a component's field
    error becomes a ConfigError."""
    from sao.runtime.preflight import preflight

    try:
        return preflight(cfg, resume=resume)
    except ConfigError:
        raise
    except ValueError as exc:  # e.g. "env.options.max_ops: ..." from an environment's Options
        raise ConfigError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def resolve_model(target: str | Path) -> tuple[Path, Path | None]:
    """A run directory (its final actor) or a model folder -> (model path, the run's config or None)."""
    p = Path(target)
    actor = p / "checkpoints" / "final" / "actor"
    if (actor / "config.json").is_file() or (actor / "adapter_config.json").is_file():  # a model or a LoRA adapter
        return actor, p / "config.yaml"
    if (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
        return p, None
    raise ConfigError(f"{str(target)!r}: neither a run directory with a final checkpoint nor a model folder")


def evaluate(target: str | Path, *overrides: str, config: Config | dict | str | Path | None = None,
             env: type | str | None = None, threads: int = 2) -> dict[str, Any]:
    """Held-out accuracy of a run's final policy or of a model folder (what `sao eval` prints)."""
    import torch

    from sao.envs import make_environment
    from sao.models.chat import ChatCodec
    from sao.models.quiet import quiet_transformers
    from sao.models.tiny import load_model
    from sao.models.tokenizer import load_tokenizer
    from sao.runtime.episodes import limits_of
    from sao.runtime.evaluate import evaluate as run_eval

    model_path, run_cfg = resolve_model(target)
    cfg = as_config(config if config is not None else run_cfg, overrides)
    if env is not None:
        cfg.env.name = use_environment(env)
    quiet_transformers()
    torch.set_num_threads(threads)
    environment = make_environment(cfg.env.name, cfg.env.options, cfg.train.seed)
    codec = ChatCodec(load_tokenizer(model_path))
    res = run_eval(load_model(model_path), codec, environment, environment.eval_tasks(cfg.eval.num_tasks),
                   limits_of(cfg), greedy=cfg.eval.greedy, seed=cfg.train.seed)
    return {"model": str(model_path), "env": cfg.env.name, "n": res.n, "accuracy": res.accuracy, "failed": res.failed,
            "greedy": cfg.eval.greedy, "statuses": res.statuses, **res.metrics}
