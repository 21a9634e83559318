"""Group sampling for group algorithms (grpo, grpo_dis): G rollouts of one prompt, trained together.

Backend-independent: the two hooks sit where tasks are drawn and where finished trajectories wait.

    task_stream   each drawn task is issued G times in a row, as copies with a per-draw id
                  `task.id#gN`; the G rollouts share `Trajectory.task_id`, which is the group key
    GroupQueue    holds finished trajectories until all G members of their group are in, then releases
                  the group whole; `get_batch` takes whole groups in the order they completed

As with the anchors of the paper's GRPO baseline, a group waits for its slowest member, and its lag
is counted from its oldest token: a group whose oldest token is more than `max_lag` versions behind
is dropped whole. A group with any untrainable member (failed, empty) is dropped whole too, so
every trained group has exactly G members and its mean/std are over the same G rollouts.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator

from sao.runtime.queue import Queue, TrajectoryQueue, drop_reason, load_queue_state, queue_counts, queue_state
from sao.types import TRAINABLE, Task, Trajectory


def grouped(tasks: Iterator[Task], group_size: int) -> Iterator[Task]:
    """Each task `group_size` times in a row, with an id unique to this draw (the group key)."""
    for n, task in enumerate(tasks):
        copy = dataclasses.replace(task, id=f"{task.id}#g{n}")
        for _ in range(group_size):
            yield copy


def task_stream(environment, algo, cfg) -> Iterator[Task]:
    """The training tasks as the runtime should issue them for `algo`."""
    if hasattr(environment, "tasks_per_step"):  # a curriculum: its stage follows the draws of each step
        environment.tasks_per_step = cfg.train.batch_size // (cfg.algo.group_size if algo.grouped else 1)
    tasks = environment.train_tasks()
    return grouped(tasks, cfg.algo.group_size) if algo.grouped else tasks


def make_queue(algo, cfg) -> Queue:
    return GroupQueue(cfg.algo.group_size) if algo.grouped else TrajectoryQueue()


def _usable(traj: Trajectory) -> bool:
    return traj.status in TRAINABLE and traj.num_action_tokens > 0


class GroupQueue:
    """Same interface as TrajectoryQueue; releases only complete groups of `group_size`."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._open: dict[str, list[Trajectory]] = {}  # group key -> members finished so far
        self._complete: deque[list[Trajectory]] = deque()
        self.dropped_stale = 0
        self.dropped_group = 0  # usable members dropped because a group mate failed
        self.failed: dict[str, int] = {}
        self._reasons: dict[str, str] = {}  # trajectory id -> why get_batch dropped it (the audit's word)

    def __len__(self) -> int:
        return sum(len(g) for g in self._complete) + sum(len(g) for g in self._open.values())

    def items(self) -> list[Trajectory]:
        return [t for g in self._complete for t in g] + [t for g in self._open.values() for t in g]

    def counts(self) -> dict[str, float]:
        return {**queue_counts(self), "async/dropped_group_total": self.dropped_group}

    def state_dict(self) -> dict:
        return {**queue_state(self), "dropped_group": self.dropped_group}

    def load_state_dict(self, state: dict) -> None:
        load_queue_state(self, state)
        self.dropped_group = state.get("dropped_group", 0)

    def drop_reason(self, traj: Trajectory) -> str:
        return self._reasons.pop(traj.id, "stale")

    def put(self, traj: Trajectory) -> None:
        members = self._open.setdefault(traj.task_id, [])
        members.append(traj)
        if len(members) == self.group_size:
            self._complete.append(self._open.pop(traj.task_id))

    def get_batch(self, batch_size: int, current_version: int, max_lag: int
                  ) -> tuple[list[Trajectory], list[Trajectory]]:
        """`batch_size // group_size` whole groups within the lag bound (else []), plus the dropped."""
        batch: list[Trajectory] = []
        dropped: list[Trajectory] = []
        taken: list[list[Trajectory]] = []
        while self._complete and len(batch) < batch_size:
            group = self._complete.popleft()
            bad = [t for t in group if not _usable(t)]
            if bad:
                for t in bad:
                    self.failed[t.status.value] = self.failed.get(t.status.value, 0) + 1
                self.dropped_group += len(group) - len(bad)
                for t in group:
                    self._reasons[t.id] = drop_reason(t) if not _usable(t) else "group_member_failed"
                dropped += group
            elif max(t.lag(current_version) for t in group) > max_lag:  # lag of its oldest token
                self.dropped_stale += len(group)
                dropped += group
            else:
                taken.append(group)
                batch += group
        if len(batch) < batch_size:
            self._complete.extendleft(reversed(taken))  # incomplete batch: put back, caller waits
            return [], dropped
        return batch, dropped
