"""Experiment trackers behind `output.report_to`: tensorboard, wandb, trackio. Offline by default.

Every tracker receives the rows that go to `metrics.jsonl`, with the same namespaced names
(`reward/mean`, `dis/masked_low_frac`, ...; docs/algorithm.md §9) and the optimizer step as the
x-axis, so a curve has one name wherever it is read. Nothing here needs a network:
- tensorboard: event files in `RUN/tb/` (`tensorboard --logdir runs`).
- wandb: `mode=output.wandb_mode`, offline unless asked; files in `RUN/wandb/` (`wandb sync` uploads
  them later). Its project is `output.project`, its run name the run directory's name.
- trackio: the local SQLite store (`TRACKIO_DIR`, default `~/.cache/huggingface/trackio`; `trackio
  show` opens the dashboard), project `output.project`, run name the run directory's name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import threading
from pathlib import Path
from typing import Protocol

from sao.config import Config, ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_trackers(cfg: Config) -> None:
    """Fail before anything is written when a requested tracker is not installed."""
    for name in cfg.output.report_to:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(f"output.report_to: {name} is not installed (pip install -e \".[trackers]\")")


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}


def _quiet_tensorboard_thread(args) -> None:
    """tensorboard's writer thread stores its write error and re-raises it at the next add_scalar (then
    sao/runtime/run_dir.py reports it in one line); it need not also print a traceback from the thread."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
        return
    _default_excepthook(args)


_default_excepthook = threading.excepthook


class TensorBoardTracker:
    def __init__(self, path: Path):
        from torch.utils.tensorboard import SummaryWriter

        threading.excepthook = _quiet_tensorboard_thread
        self.writer = SummaryWriter(str(path / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in _finite(metrics).items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbTracker:
    def __init__(self, path: Path, cfg: Config):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run = wandb.init(project=cfg.output.project, name=path.name, dir=str(path), mode=cfg.output.wandb_mode,
                              config=cfg.model_dump(mode="json"), reinit="create_new",
                              settings=wandb.Settings(x_disable_stats=True, console="off"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, path: Path, cfg: Config):
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):  # its banner would break the progress bar
            self.run = trackio.init(project=cfg.output.project, name=path.name, config=cfg.model_dump(mode="json"),
                                    auto_log_gpu=False, auto_log_cpu=False, embed=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()


def make_trackers(path: Path, cfg: Config | None) -> list[Tracker]:
    names = cfg.output.report_to if cfg is not None else ["tensorboard"]
    makers = {"tensorboard": lambda: TensorBoardTracker(path), "wandb": lambda: WandbTracker(path, cfg),
              "trackio": lambda: TrackioTracker(path, cfg)}
    return [makers[name]() for name in dict.fromkeys(names)]
