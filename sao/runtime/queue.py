"""The trajectory queue and the staleness gate (docs/algorithm.md §6).

Staleness is bounded two ways. *Pacing*: a worker may start trajectory number n (in start order)
only while n < (batches_consumed + max_lag + 1) * B, counting a batch as consumed once the weights
that follow it are published, so nothing starts that could not be trained within `max_lag` versions.
*Drop at dequeue*: a trajectory whose lag (current version minus its
oldest token version) exceeds `max_lag` anyway is dropped and counted, never trained on.
"""

from __future__ import annotations

import time
from collections import deque

from sao.types import TRAINABLE, Trajectory


class Pacer:
    """Admission counter shared by the worker (admit) and the trainer (consumed).

    Each counter has one writer (the worker writes `started`; the trainer writes `consumed` and
    `refunded`), so shared `multiprocessing.Value`s need no lock. Episodes dropped at dequeue are
    refunded: their replacements may start, or the worker would stall short of a full batch.
    """

    def __init__(self, batch_size: int, max_lag: int, started=None, consumed=None, refunded=None):
        self.batch_size, self.max_lag = batch_size, max_lag
        self._started = started if started is not None else _Counter()
        self._consumed = consumed if consumed is not None else _Counter()
        self._refunded = refunded if refunded is not None else _Counter()

    def admit(self) -> bool:
        in_play = self._started.value - self._refunded.value
        if in_play >= (self._consumed.value + self.max_lag + 1) * self.batch_size:
            return False
        self._started.value += 1
        return True

    def mark_consumed(self, batches: int = 1) -> None:
        """Called when the weights that follow these batches are published (or, during critic
        warm-up, when the batch is taken): a trajectory admitted afterwards starts from a version
        no older than the trainer's, so it is trained within `max_lag` versions."""
        self._consumed.value += batches

    def refund(self, n: int) -> None:
        self._refunded.value += n


class _Counter:
    def __init__(self) -> None:
        self.value = 0


class TrajectoryQueue:
    """Finished trajectories in arrival order; `get_batch` applies the drop-at-dequeue rule."""

    def __init__(self) -> None:
        self._items: deque[Trajectory] = deque()
        self.dropped_stale = 0
        self.failed: dict[str, int] = {}  # status -> count of untrainable episodes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, traj: Trajectory) -> None:
        self._items.append(traj)

    def get_batch(self, batch_size: int, current_version: int, max_lag: int
                  ) -> tuple[list[Trajectory], list[Trajectory]]:
        """Up to `batch_size` trainable trajectories within the lag bound, plus those dropped."""
        batch, dropped = [], []
        while self._items and len(batch) < batch_size:
            traj = self._items.popleft()
            if traj.status not in TRAINABLE or traj.num_action_tokens == 0:
                self.failed[traj.status.value] = self.failed.get(traj.status.value, 0) + 1
                dropped.append(traj)
            elif traj.lag(current_version) > max_lag:
                self.dropped_stale += 1
                dropped.append(traj)
            else:
                batch.append(traj)
        for traj in reversed(batch if len(batch) < batch_size else []):
            self._items.appendleft(traj)  # incomplete batch: put back, caller waits for more
        return (batch if len(batch) == batch_size else []), dropped


def queue_age_s(batch: list[Trajectory], now: float | None = None) -> float:
    now = time.time() if now is None else now
    return sum(now - t.finished_at for t in batch) / max(1, len(batch))
