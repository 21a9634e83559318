"""Where each trained step goes (sao/runtime/loop.py hands every step to one `StepSink`): its metrics row
(the run directory, trackers, the progress bar), sample trajectories and per-token traces, the critic
and rollout watches, and evaluations and checkpoints on schedule. The sink owns the step count.
"""

from __future__ import annotations

from collections.abc import Callable

from sao.config import Config
from sao.runtime.critic_watch import CriticWatch
from sao.runtime.parity import LiveParity
from sao.runtime.progress import RunProgress
from sao.runtime.queue import queue_age_s
from sao.runtime.rollout_watch import RolloutWatch
from sao.runtime.run_dir import RunDir
from sao.runtime.saver import Saver
from sao.types import Trajectory


def rollout_metrics(batch: list[Trajectory], version: int) -> dict[str, float]:
    lags = [t.lag(version) for t in batch]
    m = {
        "async/lag_mean": sum(lags) / len(lags),
        "async/lag_max": float(max(lags)),
        "async/queue_age_s": queue_age_s(batch),
        "rollout/action_tokens_mean": sum(t.num_action_tokens for t in batch) / len(batch),
        "rollout/turns_mean": sum(t.turns for t in batch) / len(batch),
        "rollout/truncated_frac": sum(t.status.value == "truncated" for t in batch) / len(batch),
        "async/versions_per_traj": sum(len({v for v in t.token_versions if v >= 0}) for t in batch) / len(batch),
    }
    for k in sorted({k for t in batch for k in t.metrics}):
        m[f"env/{k}"] = sum(t.metrics.get(k, 0.0) for t in batch) / len(batch)
    return m


class StepSink:
    def __init__(self, cfg: Config, run: RunDir, progress: RunProgress, decode: Callable, evaluate: Callable[[int], float],
                 saver: Saver, watch: RolloutWatch, step: int = 0):
        self.cfg, self.run, self.progress, self.decode = cfg, run, progress, decode
        self.evaluate, self.saver, self.watch, self.step = evaluate, saver, watch, step
        self.live_parity = LiveParity(cfg)  # an engine other than torch is gated on its first batch
        self.critic_watch = CriticWatch()  # warns once on a critic that explains nothing

    def traced_rows(self, step: int) -> int:
        """Rows of step `step`'s batch whose per-token values the trainer records: on the steps that dump
        trajectories, the first `output.trace_trajectories` of those dumped (sao/trainer/trace.py)."""
        out = self.cfg.output
        return 0 if step % out.trajectories_every else min(out.trace_trajectories, out.trajectories_per_dump)

    def saves_at(self, step: int) -> bool:
        """A periodic checkpoint follows step `step` (the final one follows the last step)."""
        every = self.cfg.output.save_every
        return bool(every) and step % every == 0 and step < self.cfg.train.steps

    def save(self, tag: str) -> None:
        self.saver.save(tag, self.step)

    def finish(self, step: int, batch: list[Trajectory], version: int, metrics: dict) -> None:
        """Log the step's row, dump trajectories and traces, evaluate and checkpoint on schedule."""
        cfg, out = self.cfg, self.cfg.output
        trace = metrics.pop("trace", None)  # what the trainer computed per token (traced_rows)
        self.step = step
        metrics.update(rollout_metrics(batch, version))
        self.live_parity(metrics)
        warning = self.critic_watch.update(metrics, cfg.critic.warn_low_ev_steps, step)
        if warning:
            self.progress.warn(warning)
        self.watch.trained(batch, step)
        self.run.log(step, metrics)
        if step % out.trajectories_every == 0:
            self.run.write_trajectories(step, batch[: out.trajectories_per_dump], self.decode)
        if trace:
            self.run.write_traces(step, batch, trace, self.decode, cfg.algo.name, version)
        self.progress.step(metrics)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
            self.evaluate(step)
        if self.saves_at(step):
            self.save(f"step_{step:06d}")
