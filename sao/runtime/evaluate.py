"""Held-out evaluation of a pinned policy version with the built-in engine; `Evaluator` does it during
a run (a copy of the trainer's weights, logged as eval/* rows and eval_step_* trajectories)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from sao.config import Config
from sao.engine.torch_engine import TorchEngine
from sao.envs.base import EpisodeContext
from sao.models.chat import ChatCodec
from sao.rollout.agent_loop import EpisodeLimits, run_episodes
from sao.runtime.episodes import PolicyCopy
from sao.runtime.progress import RunProgress
from sao.runtime.rollout_watch import failure_label
from sao.runtime.run_dir import RunDir
from sao.runtime.threads import ThreadPlan
from sao.types import TRAINABLE, SamplingParams, Task, Trajectory


@dataclass
class EvalResult:
    accuracy: float  # mean reward over the held-out episodes that did not fail (reward 1 = solved)
    n: int
    failed: int = 0  # episodes that failed (env_error, timeout, ...): counted here, not as 0 in `accuracy`
    statuses: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    trajectories: list[Trajectory] = field(default_factory=list)


def evaluate(model, codec: ChatCodec, environment, tasks: list[Task], limits: EpisodeLimits,
             greedy: bool = True, seed: int = 0, version: int = 0, max_batch: int = 128,
             trainer_step: int = 0, engine=None) -> EvalResult:
    """Run every task once with a pinned policy version; `trainer_step` is what episodes see as the
    run's progress (environments whose reward changes over time use it). `engine`: one already built
    on `model` (engine.* settings), else the built-in engine's defaults."""
    params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=seed)
    if engine is None:
        engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=max_batch, seed=seed, version=version)
    was_training = model.training
    trajs = asyncio.run(run_episodes(engine, environment, codec, tasks, params, limits,
                                     lambda: EpisodeContext(policy_version=version, trainer_step=trainer_step)))
    model.train(was_training)
    statuses: dict[str, int] = {}
    for t in trajs:
        statuses[t.status.value] = statuses.get(t.status.value, 0) + 1
    keys = sorted({k for t in trajs for k in t.metrics})
    metrics = {k: sum(t.metrics.get(k, 0.0) for t in trajs) / len(trajs) for k in keys}
    metrics["turns"] = sum(t.turns for t in trajs) / len(trajs)
    metrics["distinct_tasks"] = float(len({t.prompt for t in tasks}))  # fewer than n when held-out problems repeat
    solved = [t.eval_score for t in trajs if t.eval_score is not None]  # failed episodes are counted apart
    return EvalResult(sum(solved) / max(len(solved), 1), len(trajs), len(trajs) - len(solved), statuses, metrics, trajs)


def failed_summary(trajs: list[Trajectory]) -> str:
    """The top failure reasons, e.g. 'env_error: session limit reached x3'."""
    labels = Counter(failure_label(t) for t in trajs if t.status not in TRAINABLE)
    return ", ".join(f"{k} x{v}" for k, v in labels.most_common(3))


class Evaluator:
    """Evaluations during a run: the same held-out tasks each time, on the policy copy given the trainer's
    current weights; each is a row of eval/* metrics, evals/step_N.json and eval_step_* trajectories."""

    def __init__(self, cfg: Config, environment, codec: ChatCodec, limits: EpisodeLimits, trainer, policy: PolicyCopy,
                 run: RunDir, progress: RunProgress, threads: ThreadPlan):
        self.cfg, self.environment, self.codec, self.limits = cfg, environment, codec, limits
        self.trainer, self.policy, self.run, self.progress, self.threads = trainer, policy, run, progress, threads
        self.tasks = environment.eval_tasks(cfg.eval.num_tasks)

    def __call__(self, step: int) -> float:
        cfg = self.cfg
        self.threads.evaluate()
        t0 = time.perf_counter()
        self.policy.load(self.trainer.export_weights())
        version = self.trainer.version
        engine = self.policy.engine(self.codec.tokenizer.pad_token_id, max_batch=128, seed=cfg.train.seed,
                                    version=version)
        res = evaluate(self.policy.model, self.codec, self.environment, self.tasks, self.limits, greedy=cfg.eval.greedy,
                       seed=cfg.train.seed, version=version, trainer_step=step, engine=engine)
        self.threads.train()
        row = {"eval/accuracy": res.accuracy, "eval/failed": float(res.failed),
               **{f"eval/{k}": v for k, v in res.metrics.items()},
               "eval/wall_s": time.perf_counter() - t0}  # lets `sao bench` take evaluations out of wall-clock
        if res.failed:
            self.progress.warn(f"sao: warning: {res.failed} of {res.n} held-out episodes failed at step {step} "
                               f"({failed_summary(res.trajectories)}); eval/accuracy is over the other "
                               f"{res.n - res.failed}, eval/failed counts them")
        self.run.log(step, row)
        self.run.write_eval_games(step, res.trajectories)  # per game, for intervals over games (sao bench)
        self.run.write_trajectories(step, res.trajectories[: cfg.output.trajectories_per_dump], self.codec.decode,
                                    prefix="eval_step")
        self.progress.set_eval(res.accuracy, step=step)
        return res.accuracy
