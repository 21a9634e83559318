"""Who runs what, on the trainer side of any backend: the task stream, pacing, re-issue, the audit.

The trainer issues every episode as an `Assignment` with a run-unique id. Pacing (docs/algorithm.md §6) is one
global counter: at most `(batches_consumed + ahead + 1) * B` episodes are in play (issued and not
yet dropped), where a batch counts as consumed once the weights that follow it are published, and
`ahead` (runtime.issue_ahead, at most max_lag) is how many batches the rollout side may run ahead.
When the trainer is the bottleneck every batch is `ahead` versions stale (docs/performance.md §6).
This bounds the work in flight, not the lag of each episode: episodes finish out of order, so a
long one can still end up more than `max_lag` versions old; the drop at dequeue
(sao/runtime/queue.py) enforces the bound on what is trained, and counts what it drops.

Every id's life is written to RUN/audit.jsonl: issued (again after its worker died), finished,
then trained or dropped (with the reason), so a run can be checked for lost or doubled work. At
exit, what the checkpoint carries over is written too (unfinished_at_exit: run again on resume;
queued_at_exit: trained on resume), and a resume writes a `resumed` line naming its checkpoint.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from sao.runtime.run_dir import append_line
from sao.types import Assignment, Finished, Record, Status, Task, Trajectory, WorkerLost, WorkerStats

ENGINE_RERUNS = 3  # an episode the engine failed is run again this many times before it counts as failed
START_FAILURES = 3  # a worker that dies this many times in a row before reporting anything stops the run


class WorkerCrashLoop(RuntimeError):
    """A rollout worker keeps dying before it reports anything (e.g. it cannot load the model)."""


class TaskStream:
    """The environment's training tasks with a cursor (tasks drawn so far), so a resume continues."""

    def __init__(self, tasks: Iterator[Task], cursor: int = 0):
        self._it, self.cursor = tasks, 0
        for _ in range(cursor):
            self.next()

    def next(self) -> Task:
        self.cursor += 1
        return next(self._it)

    __next__ = next

    def __iter__(self) -> TaskStream:
        return self


class Audit:
    """RUN/audit.jsonl, one whole line per event (sao/runtime/run_dir.py append_line: a killed run or a
    full disk never leaves half a line)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, event: str, trajs_or_items, step: int, **extra) -> None:
        lines = []
        for x in trajs_or_items:
            task = x.task.id if isinstance(x, Assignment) else x.task_id
            lines.append(json.dumps({"event": event, "id": x.id, "task": task, "step": step, **extra}) + "\n")
        if lines:
            append_line(self.path, "".join(lines))

    def note(self, event: str, step: int, **extra) -> None:
        """A run-level event with no episode id (a resume)."""
        append_line(self.path, json.dumps({"event": event, "step": step, **extra}) + "\n")

    def lines(self) -> int:
        return sum(1 for _ in open(self.path)) if self.path.exists() else 0


class Scheduler:
    def __init__(self, backend, tasks: TaskStream, audit: Audit, batch_size: int, max_lag: int,
                 state: dict | None = None, ahead: int | None = None):
        self.backend, self.tasks, self.audit = backend, tasks, audit
        self.batch_size, self.max_lag = batch_size, max_lag
        self.ahead = max_lag if ahead is None else min(ahead, max_lag)
        state = state or {}
        self.issued = state.get("issued", 0)  # fresh assignments ever issued (re-issues not counted)
        self.consumed = state.get("consumed", 0)  # batches whose following weights are published
        self.refunded = state.get("refunded", 0)  # assignments dropped: their replacements may start
        self.retry: deque[Assignment] = deque(Assignment(a["id"], Task(**a["task"]), a["trainer_step"])
                                              for a in state.get("pending", []))
        self.outstanding: dict[str, tuple[int, Assignment]] = {}  # id -> (worker, assignment)
        self.stats: dict[int, WorkerStats] = {}
        self.lost = 0
        self.engine_reruns: dict[str, int] = {}
        self.cold: set[int] = set()  # restarted workers that have not reported yet (they load for seconds)
        self.start_failures: dict[int, int] = {}

    def room(self) -> int:
        return (self.consumed + self.ahead + 1) * self.batch_size - (self.issued - self.refunded)

    def fill(self, step: int) -> None:
        """Issue re-runs first, then fresh tasks while pacing allows; to the least-loaded worker, preferring
        workers that have reported since they (re)started, so re-runs do not wait for a restart."""
        per_worker: dict[int, list[Assignment]] = {}
        load = [0] * self.backend.workers
        for w, _ in self.outstanding.values():
            load[w] += 1
        while self.retry or self.room() > 0:
            if self.retry:
                item = self.retry.popleft()
            else:
                item = Assignment(f"e{self.issued:07d}", self.tasks.next(), step)
                self.issued += 1
            w = min(range(len(load)), key=lambda i: (i in self.cold, load[i]))  # warm, least loaded
            load[w] += 1
            self.outstanding[item.id] = (w, item)
            per_worker.setdefault(w, []).append(item)
        for w, items in per_worker.items():
            self.audit.write("issued", items, step, worker=w)
            self.backend.submit(w, items)

    def handle(self, records: list[Record], queue, step: int) -> int:
        """Apply received records; finished trajectories go into `queue`. Returns how many arrived."""
        arrived = 0
        for rec in records:
            if not isinstance(rec, WorkerLost):
                self.cold.discard(rec.worker)
            if isinstance(rec, Finished):
                traj = rec.trajectory
                _, item = self.outstanding.pop(traj.id, (None, None))
                if item is None:
                    continue  # a re-run already delivered it (a dying worker's last message): ignore
                if traj.status == Status.ENGINE_ERROR and self.engine_reruns.get(traj.id, 0) < ENGINE_RERUNS:
                    self.engine_reruns[traj.id] = self.engine_reruns.get(traj.id, 0) + 1  # not the task's fault
                    self.audit.write("engine_error", [traj], step, worker=rec.worker, reason=traj.status_reason)
                    self.retry.append(item)
                    continue
                self.audit.write("finished", [traj], step, status=traj.status.value, worker=rec.worker)
                queue.put(traj)
                arrived += 1
            elif isinstance(rec, WorkerStats):
                self.stats[rec.worker] = rec
            elif isinstance(rec, WorkerLost):
                self.lost += 1
                failures = self.start_failures.get(rec.worker, 0) + 1 if rec.worker in self.cold else 1
                self.start_failures[rec.worker] = failures
                if failures >= START_FAILURES:
                    raise WorkerCrashLoop(f"rollout worker {rec.worker} died {failures} times in a row before "
                                          f"reporting anything; last: {rec.reason}")
                self.cold.add(rec.worker)
                lost = sorted((a for w, a in self.outstanding.values() if w == rec.worker), key=lambda a: a.id)
                for a in lost:
                    del self.outstanding[a.id]
                self.audit.write("lost", lost, step, worker=rec.worker, reason=rec.reason)
                self.retry.extend(lost)
        return arrived

    def trained(self, batch: list[Trajectory], step: int) -> None:
        self.audit.write("trained", batch, step)

    def dropped(self, trajs: list[Trajectory], step: int, reason_of) -> None:
        self.refunded += len(trajs)
        for t in trajs:
            self.audit.write("dropped", [t], step, reason=reason_of(t))

    def pending(self) -> list[Assignment]:
        """Issued and unfinished: waiting to be re-issued, or out on a worker."""
        return list(self.retry) + sorted((a for _, a in self.outstanding.values()), key=lambda a: a.id)

    def state(self, queued: list[Trajectory]) -> dict:
        """What a resume needs: counters, and every issued-but-untrained episode (unfinished ones are
        run again; finished ones come back into the queue, see sao/runtime/checkpoint.py)."""
        pending = self.pending()
        return {"issued": self.issued, "consumed": self.consumed, "refunded": self.refunded,
                "cursor": self.tasks.cursor,
                "pending": [{"id": a.id, "task": a.task.__dict__, "trainer_step": a.trainer_step} for a in pending]}

    def worker_totals(self) -> dict[str, float]:
        s = list(self.stats.values())
        return {"tokens": sum(x.tokens for x in s), "busy_s": sum(x.busy_s for x in s),
                "wall_s": sum(x.wall_s for x in s), "version": min((x.version for x in s), default=0),
                "hung_steps": sum(x.hung_steps for x in s), "engine_errors": sum(x.engine_errors for x in s)}
