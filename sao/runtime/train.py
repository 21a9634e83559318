"""`sao train`: the whole run, top to bottom.

    step 1  run context (sao/runtime/context.py): run directory, starting policy (cached SFT warm
            start), trainer, queue, pacing; or, with --resume, everything a checkpoint holds.
            The rollout workers start now (runtime.backend): they load while steps 2-3 run
    step 2  parity gate (sao/runtime/parity.py): engine and trainer log-probs agree on the same tokens
    step 3  held-out evaluation of the starting policy
    step 4  the loop (sao/runtime/loop.py): async over the backend, or sync (generate, then train)
    step 5  final evaluation, checkpoint, summary

This module knows no processes (the backend owns them, sao/runtime/backend.py) and holds no run
state (the context does). Ctrl-C and SIGTERM write a checkpoint, then exit (sao/runtime/signals.py).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sao.config import Config
from sao.models.quiet import quiet_transformers
from sao.runtime import checkpoint, context, parity
from sao.runtime.backend import make_backend
from sao.runtime.evaluate import Evaluator
from sao.runtime.loop import Interrupted, run_async, run_sync
from sao.runtime.preflight import preflight
from sao.runtime.progress import RunProgress
from sao.runtime.run_dir import WriteError
from sao.runtime.signals import stop_on_signals
from sao.runtime.threads import ThreadPlan


@dataclass
class RunResult:
    run_dir: str
    accuracy_before: float
    accuracy_after: float
    steps: int
    wall_s: float
    extra: dict = field(default_factory=dict)


def train(cfg: Config, progress: RunProgress, resume: str | Path | None = None, environment=None) -> RunResult:
    """`environment`: what the caller's preflight returned (the CLI and the API run it before anything
    starts); without it, preflight runs here."""
    quiet_transformers()
    resume = Path(resume) if resume else None
    environment = environment if environment is not None else preflight(cfg, resume=resume)
    if cfg.runtime.mode == "async" and cfg.runtime.backend == "local":
        from sao.runtime.prewarm import prewarm

        prewarm()  # the workers' fork server; a no-op when the CLI started it already
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    ThreadPlan(cfg.runtime).setup()  # SFT and building have every core
    t_start = time.perf_counter()
    ctx = context.build(cfg, environment, progress, resume)  # step 1
    ctx.threads.train()
    progress.log(f"run directory: {ctx.run.path}")
    evaluate, backend = Evaluator(ctx), None
    with stop_on_signals(ctx):
        try:
            if cfg.runtime.mode == "async":  # the workers pay their start-up while steps 2-3 run
                backend = make_backend(cfg, str(ctx.model_path), ctx.limits)
                backend.start(ctx.trainer.export_weights(), ctx.trainer.version)
                ctx.start_scheduler(backend).fill(ctx.step)
            diff = parity.gate(cfg, ctx.trainer, ctx.policy_copy(), ctx.codec, environment, ctx.limits)  # step 2
            ctx.run.log(ctx.step, {"parity/max_abs_diff": diff})
            before = evaluate(0) if ctx.step == 0 else _before_accuracy(ctx.run.path)  # step 3
            if backend is None and cfg.engine.name != "torch":
                progress.log(f"runtime.mode=sync generates with the built-in torch engine; "
                             f"engine.name={cfg.engine.name} serves the async rollout workers")
            progress.start_training(cfg.train.steps)
            run_async(ctx, backend, evaluate) if backend is not None else run_sync(ctx, evaluate)  # step 4
        except Interrupted:
            progress.stop_training()
            _stop(backend)
            ckpt = ctx.save_at_exit(f"step_{ctx.step:06d}")
            ctx.close()
            print(f"sao: {ctx.stop_requested}: checkpoint {ckpt} written; continue with "
                  f"`sao train --resume {ctx.run.path}`", file=sys.stderr)
            raise KeyboardInterrupt from None
        except WriteError as exc:
            _stop(backend)
            ctx.close()
            ckpt = checkpoint.latest(ctx.run.path)
            raise WriteError(f"{exc}; " + (f"its latest checkpoint {ckpt.name} is intact: after freeing space, "
                                           f"`sao train --resume {ctx.run.path}`" if ckpt else
                                           "it has no checkpoint yet")) from None
        except BaseException:
            ctx.close()  # trainer ranks (N > 1) go with the run
            raise
        finally:
            progress.stop_training()
            _stop(backend)
    after = evaluate(ctx.step)  # step 5
    ckpt = ctx.save_at_exit("final")
    ctx.close()
    result = RunResult(str(ctx.run.path), before, after, ctx.step, time.perf_counter() - t_start,
                       {"checkpoint": str(ckpt), "parity_max_abs_diff": diff, **ctx.totals, **ctx.setup})
    ctx.run.write_json("summary.json", result.__dict__)
    ctx.run.close()
    return result


def _before_accuracy(run_path: Path) -> float:
    """On resume, the step-0 evaluation is already in metrics.jsonl."""
    for line in open(run_path / "metrics.jsonl"):
        row = json.loads(line)
        if row["step"] == 0 and "eval/accuracy" in row:
            return row["eval/accuracy"]
    return float("nan")


def _stop(backend) -> None:
    """Stop the workers (idempotent); what they had in flight is in the checkpoint's scheduler state."""
    if backend is not None:
        backend.stop()
