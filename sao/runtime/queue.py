"""The trajectory queue and the staleness gate (docs/algorithm.md §6).

Pacing (sao/runtime/scheduler.py) bounds how much work is in flight. The *drop at dequeue* here
is what bounds staleness: a trajectory whose lag (current version minus its oldest token version)
exceeds `max_lag` is dropped and counted, never trained on.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from sao.types import TRAINABLE, Trajectory


class Queue(Protocol):
    """What the loop's batch sources and the checkpoint ask of a queue: TrajectoryQueue, or GroupQueue
    for group algorithms (sao/runtime/groups.py)."""

    dropped_stale: int
    failed: dict[str, int]

    def __len__(self) -> int: ...

    def put(self, traj: Trajectory) -> None: ...

    def items(self) -> list[Trajectory]: ...

    def get_batch(self, batch_size: int, current_version: int, max_lag: int
                  ) -> tuple[list[Trajectory], list[Trajectory]]: ...

    def drop_reason(self, traj: Trajectory) -> str: ...

    def counts(self) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


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

    def items(self) -> list[Trajectory]:
        return list(self._items)

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

    def drop_reason(self, traj: Trajectory) -> str:
        return drop_reason(traj)

    def counts(self) -> dict[str, float]:
        return queue_counts(self)

    def state_dict(self) -> dict:
        return queue_state(self)

    def load_state_dict(self, state: dict) -> None:
        load_queue_state(self, state)


def queue_counts(queue: Queue) -> dict[str, float]:
    """The run's totals of finished episodes not trained on, as a queue counted them (a step's metrics)."""
    return {"async/dropped_stale_total": queue.dropped_stale, "async/failed_episodes_total": sum(queue.failed.values()),
            "async/env_error_episodes_total": queue.failed.get("env_error", 0)}  # env faults, not the model's


def queue_state(queue: Queue) -> dict:
    """Finished, untrained trajectories (a resume trains them) and the drop counters, of either queue."""
    return {"queued": [t.to_json() for t in queue.items()], "dropped_stale": queue.dropped_stale,
            "failed": dict(queue.failed)}


def load_queue_state(queue: Queue, state: dict) -> None:
    for line in state["queued"]:
        queue.put(Trajectory.from_json(line))
    queue.dropped_stale, queue.failed = state["dropped_stale"], dict(state["failed"])


def drop_reason(traj: Trajectory) -> str:
    """Why `get_batch` dropped it (the audit's vocabulary)."""
    if traj.status not in TRAINABLE:
        return traj.status.value
    return "no_action_tokens" if traj.num_action_tokens == 0 else "stale"


def queue_age_s(batch: list[Trajectory], now: float | None = None) -> float:
    now = time.time() if now is None else now
    return sum(now - t.finished_at for t in batch) / max(1, len(batch))
