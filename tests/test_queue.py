"""Staleness: pacing at admission, drop at dequeue, refunds, untrainable episodes, re-issue."""

import itertools
import json

from sao.runtime.pacing import Pacing
from sao.runtime.queue import TrajectoryQueue, drop_reason
from sao.runtime.scheduler import Audit, Scheduler, TaskStream
from sao.types import Finished, Status, Task, Trajectory, WorkerLost


def traj(version, status=Status.OK, n_actions=2):
    ids = [1, 2] + [3] * n_actions
    return Trajectory(id=f"v{version}", task_id="t", token_ids=ids, action_mask=[0, 0] + [1] * n_actions,
                      behavior_logprobs=[0.0] * len(ids), token_versions=[-1, -1] + [version] * n_actions,
                      prompt_len=2, status=status)


class Recorder:
    """The receiving end of `Backend.submit`, recording what each worker was handed."""

    def __init__(self, workers):
        self.workers, self.got = workers, {w: [] for w in range(workers)}

    def submit(self, worker, items):
        self.got[worker] += items


def scheduler(tmp_path, workers=1, batch_size=2, ahead=1):
    tasks = TaskStream(Task(f"t{i}", "p") for i in itertools.count())
    backend = Recorder(workers)
    return Scheduler(backend, tasks, Audit(tmp_path / "audit.jsonl"), Pacing(batch_size, ahead)), backend


def test_pacing_admits_max_lag_plus_one_batches_ahead(tmp_path):
    sched, backend = scheduler(tmp_path)
    sched.fill(0)
    assert len(backend.got[0]) == 4  # (0 consumed + 1 + 1) * 2
    sched.fill(0)
    assert len(backend.got[0]) == 4  # nothing more until a batch is consumed
    sched.pacing.consumed += 1
    sched.fill(1)
    assert len(backend.got[0]) == 6
    sched.dropped([traj(0)], 1, drop_reason)  # a dropped episode frees its slot
    sched.fill(1)
    assert len(backend.got[0]) == 7 and sched.tasks.cursor == 7


def test_work_is_spread_over_workers_and_a_lost_workers_episodes_are_issued_again(tmp_path):
    sched, backend = scheduler(tmp_path, workers=2, batch_size=2, ahead=1)
    sched.fill(0)
    assert [len(backend.got[w]) for w in (0, 1)] == [2, 2]
    first = backend.got[1][0]
    q = TrajectoryQueue()
    done = Trajectory(first.id, first.task.id, [1, 2], [0, 1], [0.0, -1.0], [-1, 0], 1)
    assert sched.handle([Finished(1, done)], q, 1) == 1
    sched.handle([WorkerLost(1, "killed")], q, 1)  # the other assignment of worker 1 was unfinished
    sched.fill(1)
    reissued = [a.id for a in backend.got[0][2:]]  # to worker 0: the restarted worker 1 is still loading
    assert reissued == [backend.got[1][1].id] and backend.got[1][2:] == []  # the same episode, not a fresh task
    assert sched.tasks.cursor == 4
    assert sched.handle([Finished(1, done)], q, 1) == 0  # a duplicate delivery is ignored
    events = [json.loads(line)["event"] for line in open(tmp_path / "audit.jsonl")]
    assert events.count("lost") == 1 and events.count("finished") == 1 and events.count("issued") == 5


def test_scheduler_state_round_trips_pending_work(tmp_path):
    sched, backend = scheduler(tmp_path)
    sched.fill(0)
    state = {"scheduler": sched.state_dict(), "pacing": sched.pacing.state_dict(), "tasks": sched.tasks.state_dict()}
    again, backend2 = scheduler(tmp_path)
    again.load_state_dict(state["scheduler"])
    again.pacing.load_state_dict(state["pacing"])
    again.tasks.load_state_dict(state["tasks"])
    again.fill(0)
    assert [a.id for a in backend2.got[0]] == [a.id for a in backend.got[0]]  # the same ids, run again
    assert again.tasks.cursor == 4 and again.pacing.issued == 4


def test_drop_at_dequeue_counts_stale_and_failed():
    q = TrajectoryQueue()
    for t in (traj(0), traj(3), traj(4, Status.ENV_ERROR), traj(5), traj(4, n_actions=0)):
        q.put(t)
    batch, dropped = q.get_batch(2, current_version=5, max_lag=2)
    # v0 has lag 5 > 2: dropped; v3 lag 2 ok; env_error dropped; v5 lag 0 ok
    assert [t.id for t in batch] == ["v3", "v5"]
    assert [t.id for t in dropped] == ["v0", "v4"] and q.dropped_stale == 1 and q.failed == {"env_error": 1}


def test_incomplete_batch_waits():
    q = TrajectoryQueue()
    q.put(traj(0))
    batch, dropped = q.get_batch(2, 0, 1)
    assert batch == [] and dropped == [] and len(q) == 1
    q.put(traj(0))
    assert len(q.get_batch(2, 0, 1)[0]) == 2


def test_lag_uses_the_oldest_token_version():
    t = traj(3)
    t.token_versions[-1] = 5  # in-flight weight swap: later tokens are newer
    assert t.oldest_version == 3 and t.lag(6) == 3
    assert Trajectory.from_json(t.to_json()) == t


def test_a_worker_that_keeps_dying_before_reporting_stops_the_run(tmp_path):
    import pytest

    from sao.runtime.scheduler import WorkerCrashLoop

    sched, _ = scheduler(tmp_path, workers=2)
    q = TrajectoryQueue()
    sched.handle([WorkerLost(0, "exit 1")], q, 0)
    sched.handle([WorkerLost(0, "exit 1")], q, 0)  # died again before reporting: still retried
    with pytest.raises(WorkerCrashLoop, match="rollout worker 0 died 3 times in a row .*exit 1"):
        sched.handle([WorkerLost(0, "exit 1")], q, 0)
