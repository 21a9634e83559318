"""Who runs what, on the trainer side of any backend: the task stream, pacing, re-issue, the audit.

The trainer issues every episode as an `Assignment` with a run-unique id, within the room that pacing
(sao/runtime/pacing.py) leaves, to the least-loaded worker; a lost worker's episodes are issued again.

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

from sao.errors import RunStopped
from sao.runtime.pacing import Pacing
from sao.runtime.rollout_watch import RolloutWatch
from sao.runtime.run_dir import append_line, count_lines, truncate_lines
from sao.types import Assignment, Finished, Record, Status, Task, Trajectory, WorkerLost, WorkerStats

ENGINE_RERUNS = 3  # an episode the engine failed is run again this many times before it counts as failed
START_FAILURES = 3  # a worker that dies this many times in a row before reporting anything stops the run


class WorkerCrashLoop(RunStopped):
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

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        for _ in range(state["cursor"] - self.cursor):  # tasks are drawn again in the same order
            self.next()


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

    def state_dict(self) -> dict:
        return {"audit_lines": count_lines(self.path)}

    def load_state_dict(self, state: dict) -> None:
        truncate_lines(self.path, state["audit_lines"])


class Scheduler:
    def __init__(self, backend, tasks: TaskStream, audit: Audit, pacing: Pacing, watch: RolloutWatch | None = None):
        self.backend, self.tasks, self.audit, self.pacing = backend, tasks, audit, pacing
        self.watch = watch  # counts every finished episode: warns on, then stops, a run whose episodes fail
        self.retry: deque[Assignment] = deque()  # lost or not yet re-issued after a resume
        self.outstanding: dict[str, tuple[int, Assignment]] = {}  # id -> (worker, assignment)
        self.stats: dict[int, WorkerStats] = {}
        self.lost = 0
        self.engine_reruns: dict[str, int] = {}
        self.cold: set[int] = set()  # restarted workers that have not reported yet (they load for seconds)
        self.start_failures: dict[int, int] = {}

    def fill(self, step: int) -> None:
        """Issue re-runs first, then fresh tasks while pacing allows; to the least-loaded worker, preferring
        workers that have reported since they (re)started, so re-runs do not wait for a restart."""
        per_worker: dict[int, list[Assignment]] = {}
        load = [0] * self.backend.workers
        for w, _ in self.outstanding.values():
            load[w] += 1
        while self.retry or self.pacing.room() > 0:
            if self.retry:
                item = self.retry.popleft()
            else:
                item = Assignment(f"e{self.pacing.issued:07d}", self.tasks.next(), step)
                self.pacing.issued += 1
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
                if self.watch is not None:
                    self.watch.finished(traj)
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
        self.pacing.refunded += len(trajs)
        for t in trajs:
            self.audit.write("dropped", [t], step, reason=reason_of(t))

    def pending(self) -> list[Assignment]:
        """Issued and unfinished: waiting to be re-issued, or out on a worker."""
        return list(self.retry) + sorted((a for _, a in self.outstanding.values()), key=lambda a: a.id)

    def state_dict(self) -> dict:
        """Every issued-but-unfinished episode: a resume runs them again (finished, untrained ones travel
        with the queue's state). Pacing and the task cursor have their own."""
        return {"pending": [{"id": a.id, "task": a.task.__dict__, "trainer_step": a.trainer_step}
                            for a in self.pending()]}

    def load_state_dict(self, state: dict) -> None:
        self.retry.extend(Assignment(a["id"], Task(**a["task"]), a["trainer_step"]) for a in state.get("pending", []))

    def worker_totals(self) -> dict[str, float]:
        s = list(self.stats.values())
        return {"tokens": sum(x.tokens for x in s), "busy_s": sum(x.busy_s for x in s),
                "wall_s": sum(x.wall_s for x in s), "version": min((x.version for x in s), default=0),
                "hung_steps": sum(x.hung_steps for x in s), "engine_errors": sum(x.engine_errors for x in s),
                "engine_restarts": sum(x.engine_restarts for x in s)}
