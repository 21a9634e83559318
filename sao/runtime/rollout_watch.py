"""`RolloutWatch`: says once when the rollouts themselves show the run trains on nothing useful, and stops
a run whose episodes almost all fail.

    all truncated   every trajectory of `TRUNCATED_STEPS` trained batches in a row was truncated (no episode
                    ended by itself): rewards are the environment's partial credit at best, 0 for most tasks.
                    Seen with rollout.max_action_tokens one token short of the environment's action format:
                    every action was cut, every episode ran into the turn limit, 20 steps of reward 0, silently
    mostly failed   more than half of the last `runtime.failure_window` finished episodes failed (any status
                    but ok / truncated: an environment error, a timeout, an agent that exits): they are not
                    trained on. Warned once
    failing         more than `runtime.max_failed_frac` of them failed: the run stops in one line naming the
                    top reason (`TooManyFailures`). An agent command that exits 1 after each call used to loop
                    for ever (failed episodes count as arrivals, so runtime.receive_timeout_s never fires), and
                    an OpenEnv server at its session limit failed 6,493 episodes in 3 steps with exit code 0

Every finished episode is counted as it arrives (`finished`, from the scheduler or the sync loop's
generation), not per step: a run whose every episode fails never finishes a step. The counts start
again on resume.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from sao.errors import RunStopped
from sao.types import TRAINABLE, Trajectory

TRUNCATED_STEPS = 5
WARN_FRAC = 0.5


class TooManyFailures(RunStopped):
    """Past runtime.max_failed_frac of the last runtime.failure_window finished episodes failed."""


def failure_label(traj: Trajectory) -> str:
    """`status: reason` with the reason's first line, short enough to count alike failures together."""
    reason = (traj.status_reason or "").strip().splitlines()[0][:120] if traj.status_reason else ""
    return f"{traj.status.value}: {reason}" if reason else traj.status.value


class RolloutWatch:
    def __init__(self, warn: Callable[[str], None] = print, window: int = 100, max_failed_frac: float = 0.9):
        self.warn, self.max_failed_frac = warn, max_failed_frac
        self.truncated_steps = 0
        self.recent: deque[str | None] = deque(maxlen=window)  # the last finished episodes: failure label or None
        self.warned: set[str] = set()

    def finished(self, traj: Trajectory) -> None:
        """Count one finished episode (before any queue decides what to train on)."""
        self.recent.append(None if traj.status in TRAINABLE else failure_label(traj))
        if len(self.recent) < self.recent.maxlen:
            return
        labels = Counter(x for x in self.recent if x is not None)
        failed, n = sum(labels.values()), len(self.recent)
        if not failed:
            return
        top = labels.most_common(1)[0][0]
        if failed > self.max_failed_frac * n and self.max_failed_frac < 1.0:
            raise TooManyFailures(f"{failed} of the last {n} episodes failed (most: {top}); stopping "
                                  f"(runtime.max_failed_frac={self.max_failed_frac:g}; audit.jsonl names each "
                                  "one's reason)")
        if failed > WARN_FRAC * n and "failed" not in self.warned:
            self.warned.add("failed")
            by = ", ".join(f"{k} x{v}" for k, v in labels.most_common(3))
            self.warn(f"sao: warning: {failed} of the last {n} episodes failed ({by}); failed episodes are not "
                      f"trained on, and past runtime.max_failed_frac={self.max_failed_frac:g} the run stops")

    def trained(self, batch: list[Trajectory], step: int) -> None:
        """Count a trained batch: the all-truncated warning."""
        truncated = [t for t in batch if t.status.value == "truncated"]
        self.truncated_steps = self.truncated_steps + 1 if batch and len(truncated) == len(batch) else 0
        if self.truncated_steps >= TRUNCATED_STEPS and "truncated" not in self.warned:
            self.warned.add("truncated")
            reasons = Counter(t.status_reason or "truncated" for t in truncated).most_common(1)[0][0]
            self.warn(f"sao: warning: every trajectory of the last {self.truncated_steps} steps was truncated "
                      f"({reasons}; step {step}): no episode ends by itself, so the rewards are 0 or partial. "
                      "Check rollout.max_turns and rollout.max_action_tokens (an action cut at its token budget "
                      "can miss the environment's format every time)")
