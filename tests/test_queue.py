"""Staleness: pacing at admission, drop at dequeue, refunds, untrainable episodes."""

from sao.runtime.queue import Pacer, TrajectoryQueue
from sao.types import Status, Trajectory


def traj(version, status=Status.OK, n_actions=2):
    ids = [1, 2] + [3] * n_actions
    return Trajectory(id=f"v{version}", task_id="t", token_ids=ids, action_mask=[0, 0] + [1] * n_actions,
                      behavior_logprobs=[0.0] * len(ids), token_versions=[-1, -1] + [version] * n_actions,
                      prompt_len=2, status=status)


def test_pacing_admits_max_lag_plus_one_batches_ahead():
    pacer = Pacer(batch_size=2, max_lag=1)
    assert sum(pacer.admit() for _ in range(10)) == 4  # (0 consumed + 1 + 1) * 2
    pacer.mark_consumed()
    assert sum(pacer.admit() for _ in range(10)) == 2
    pacer.refund(1)  # a dropped episode frees its slot
    assert pacer.admit() and not pacer.admit()


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
