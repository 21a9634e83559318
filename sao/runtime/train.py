"""`sao train`: the whole run, top to bottom. The one module that holds every part of a run.

    step 1  the parts: run directory, starting policy (cached SFT warm start), trainer
            (sao/trainer/build.py), queue, task stream, pacing, audit, saver; or, with --resume,
            each part's state from the latest checkpoint (sao/runtime/saver.py).
            The rollout workers start now (runtime.backend): they load while steps 2-3 run
    step 2  parity gate (sao/runtime/parity.py): engine and trainer log-probs agree on the same tokens
    step 3  held-out evaluation of the starting policy
    step 4  the loop (sao/runtime/loop.py) over a batch source (sao/runtime/source.py: the workers, or
            one engine in this process with --sync) and a step sink (sao/runtime/sink.py)
    step 5  final evaluation, checkpoint, summary

This module knows no processes (the backend owns them, sao/runtime/backend.py; the trainer its ranks).
Ctrl-C and SIGTERM write a checkpoint, then exit (sao/runtime/signals.py).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sao.algo.registry import get_algorithm
from sao.config import Config, ConfigError
from sao.models.chat import ChatCodec
from sao.models.lora import adapter_base
from sao.models.quiet import quiet_transformers
from sao.models.tokenizer import load_tokenizer
from sao.runtime import checkpoint, parity
from sao.runtime.backend import make_backend
from sao.runtime.episodes import PolicyCopy, limits_of
from sao.runtime.evaluate import Evaluator
from sao.runtime.groups import make_queue, task_stream
from sao.runtime.loop import run_async, run_sync
from sao.runtime.model_setup import prepare_base_model
from sao.runtime.pacing import Pacing, batches_ahead
from sao.runtime.preflight import preflight
from sao.runtime.progress import RunProgress
from sao.runtime.rollout_watch import RolloutWatch
from sao.runtime.run_dir import RunDir, WriteError
from sao.runtime.saver import Saver
from sao.runtime.scheduler import Audit, Scheduler, TaskStream
from sao.runtime.signals import Interrupted, StopFlag, stop_on_signals
from sao.runtime.sink import StepSink
from sao.runtime.source import AsyncSource, SyncSource
from sao.runtime.threads import ThreadPlan, adaptive_threads
from sao.trainer.batch import collate
from sao.trainer.build import build_trainer


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
    threads = ThreadPlan(cfg.runtime)
    threads.setup()  # SFT and building have every core
    t_start = time.perf_counter()
    # step 1: the parts
    ckpt = checkpoint.latest(resume) if resume is not None else None
    run, model_path, setup = start_run(cfg, progress, resume, ckpt)
    codec, limits, algo = ChatCodec(load_tokenizer(model_path)), limits_of(cfg), get_algorithm(cfg.algo.name)
    connect_ray(cfg)
    trainer = build_trainer(cfg, model_path, ckpt)
    try:
        queue, tasks = make_queue(algo, cfg), TaskStream(task_stream(environment, algo, cfg))
        pacing = Pacing(cfg.train.batch_size, batches_ahead(cfg.runtime), cfg.runtime.sync_every)
        audit = Audit(run.path / "audit.jsonl") if cfg.runtime.mode == "async" else None
        saver = Saver(run, trainer, pacing, tasks, queue, audit, codec.tokenizer, cfg.output.keep_checkpoints,
                      cfg.model.lora.save_merged)
        step = saver.load(ckpt) if ckpt is not None else 0
    except BaseException:
        trainer.close()  # trainer ranks (N > 1) and a separate critic go with a run that cannot start
        raise
    watch = RolloutWatch(progress.warn, cfg.runtime.failure_window, cfg.runtime.max_failed_frac)
    policy, stop = PolicyCopy(cfg, model_path), StopFlag()
    threads.train()
    progress.log(f"run directory: {run.path}")
    evaluate = Evaluator(cfg, environment, codec, limits, trainer, policy, run, progress, threads)
    sink = StepSink(cfg, run, progress, codec.decode, evaluate, saver, watch, step)
    pad_id = codec.tokenizer.pad_token_id

    def collated(batch, step):
        out = collate(batch, pad_id)
        out.trace_rows = sink.traced_rows(step)
        return out

    backend = None
    with stop_on_signals(stop):
        try:
            if cfg.runtime.mode == "async":  # the workers pay their start-up while steps 2-3 run
                backend = make_backend(cfg, str(model_path), limits)
                backend.start(trainer.export_weights(), trainer.version)
                scheduler = saver.start_scheduler(Scheduler(backend, tasks, audit, pacing, watch))
                scheduler.fill(step)
            diff = parity.gate(cfg, trainer, policy, codec, environment, limits)  # step 2
            run.log(step, {"parity/max_abs_diff": diff})
            before = evaluate(0) if step == 0 else _before_accuracy(run.path)  # step 3
            progress.start_training(cfg.train.steps)
            if backend is not None:  # step 4
                fast = adaptive_threads(cfg.runtime, backend, progress.log)
                if fast is not None:
                    trainer.before_pass = fast
                r = cfg.runtime
                source = AsyncSource(backend, scheduler, queue, cfg.train.batch_size, r.max_lag, r.receive_timeout_s,
                                     stop, fast)
                saver.waited = lambda: source.wait_s
                run_async(trainer, source, sink, pacing, collated, cfg.train.steps, stop, train=not r.rollout_only)
            else:
                if cfg.engine.name != "torch":
                    progress.log(f"runtime.mode=sync generates with the built-in torch engine; "
                                 f"engine.name={cfg.engine.name} serves the async rollout workers")
                source = SyncSource(policy, environment, codec, tasks, limits, queue, cfg.train.batch_size,
                                    cfg.train.seed + 1, cfg.rollout.concurrency, threads, watch)
                run_sync(trainer, source, sink, collated, cfg.train.steps, stop)
        except Interrupted:
            progress.stop_training()
            _stop(backend)
            ckpt = saver.save_at_exit(f"step_{sink.step:06d}", sink.step)
            trainer.close()
            print(f"sao: {stop.reason}: checkpoint {ckpt} written; continue with "
                  f"`sao train --resume {run.path}`", file=sys.stderr)
            raise KeyboardInterrupt from None
        except WriteError as exc:
            _stop(backend)
            trainer.close()
            ckpt = checkpoint.latest(run.path)
            raise WriteError(f"{exc}; " + (f"its latest checkpoint {ckpt.name} is intact: after freeing space, "
                                           f"`sao train --resume {run.path}`" if ckpt else
                                           "it has no checkpoint yet")) from None
        except BaseException:
            trainer.close()  # trainer ranks (N > 1) and a separate critic go with the run
            raise
        finally:
            progress.stop_training()
            _stop(backend)
    after = evaluate(sink.step)  # step 5
    ckpt = saver.save_at_exit("final", sink.step)
    trainer.close()
    result = RunResult(str(run.path), before, after, sink.step, time.perf_counter() - t_start,
                       {"checkpoint": str(ckpt), "parity_max_abs_diff": diff, **saver.totals(), **setup})
    run.write_json("summary.json", result.__dict__)
    run.close()
    return result


def start_run(cfg: Config, progress: RunProgress, resume: Path | None, ckpt: Path | None) -> tuple[RunDir, Path, dict]:
    """The run directory (new, or the one resumed) and the starting policy's folder: the SFT warm start
    (cached), or a checkpoint's actor. The dict is what the first run paid (summary.json)."""
    if ckpt is None:
        run = RunDir.create(cfg)
        t0 = time.perf_counter()
        model_path, built = prepare_base_model(cfg, on_step=progress.sft_callback(cfg.sft.steps))
        return run, model_path, {"sft_built": built, "sft_s": time.perf_counter() - t0}
    # a LoRA run saved adapters: engines and the actor start from the base model they sit on
    model_path = Path(adapter_base(ckpt / "actor") or ckpt / "actor")
    if not (model_path / "config.json").is_file():
        raise ConfigError(f"--resume: {ckpt / 'actor'} is an adapter on {model_path}, which is gone")
    return RunDir(resume, cfg), model_path, {}


def connect_ray(cfg: Config) -> None:
    """Trainer ranks and critic ranks as Ray actors (runtime.backend=ray with trainer.ranks > 1, or with
    critic.placement=separate) need Ray before they start."""
    if cfg.runtime.backend != "ray":
        return
    ranks = cfg.trainer.ranks if cfg.trainer.ranks > 1 else 0
    if cfg.critic.placement == "separate" and get_algorithm(cfg.algo.name).uses_critic:
        ranks += cfg.critic.ranks
    if ranks:
        from sao.runtime.ray_backend import connect

        connect(cfg.runtime, ranks * cfg.trainer.rank_num_cpus)


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
