"""RolloutWatch (sao/runtime/rollout_watch.py): one warning when every trajectory of 5 steps in a row was
truncated, one when most episodes of a 10-step window failed; on the real CLI, an action budget too short
for the environment's format is said once."""

import subprocess
import sys

import pytest

from sao.runtime.rollout_watch import TRUNCATED_STEPS, WINDOW, RolloutWatch
from sao.types import Status, Trajectory


def _traj(status: Status, reason: str = "") -> Trajectory:
    t = Trajectory("i", "t", [1, 2], [0, 1], [0.0, -1.0], [-1, 0], 1)
    t.status, t.status_reason = status, reason
    return t


def test_all_truncated_steps_warn_once():
    watch = RolloutWatch()
    trunc = [_traj(Status.TRUNCATED, "turn limit")] * 4
    mixed = trunc[:3] + [_traj(Status.OK)]
    assert watch.update(trunc, {}, 1) == [] and watch.update(mixed, {}, 2) == []  # an ok episode resets the count
    said = [w for step in range(3, 3 + TRUNCATED_STEPS) for w in watch.update(trunc, {}, step)]
    assert len(said) == 1 and "every trajectory of the last 5 steps was truncated (turn limit; step 7)" in said[0]
    assert all(watch.update(trunc, {}, s) == [] for s in range(8, 20))  # once per run


def test_mostly_failed_window_warns_once_with_the_top_reasons():
    """Failure counts are the queue's running totals by status; per step 4 trained. Steps 1-10 fail 3 per step
    (2 env_error + 1 timeout: 30 failed vs 40 trained, no warning); then 6 per step (5 + 1). At step k > 10 the
    window (steps k-9..k) holds (20-k) x 3 + (k-10) x 6 = 3k failed, first above 40 at k = 14: 42 failed,
    env_error 6 x 2 + 4 x 5 = 32, timeout 10."""
    watch = RolloutWatch()
    ok, totals, said = [_traj(Status.OK)] * 4, {"env_error": 0, "timeout": 0}, []
    for step in range(1, 21):
        per_step = 3 if step <= WINDOW else 6
        totals = {"env_error": totals["env_error"] + per_step - 1, "timeout": totals["timeout"] + 1}
        said += [(step, w) for w in watch.update(ok, dict(totals), step)]
    assert len(said) == 1 and said[0][0] == 14
    assert "42 of 82 episodes that finished in the last 10 steps failed (env_error: 32, timeout: 10; step 14)" in said[0][1]


@pytest.mark.slow
def test_an_action_budget_too_short_is_said_once_on_the_cli(tmp_path):
    """calc's actions need a tag (<calc>...</calc>, <answer>...</answer>): with rollout.max_action_tokens=2 every
    action is cut, every episode ends at the turn limit, and the run says so once (it used to say nothing)."""
    from conftest import TINY

    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "rollout.max_action_tokens=2",
                           "train.steps=7", "output.name=t", "--quiet"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("every trajectory of the last 5 steps was truncated (action token limit") == 1, \
        proc.stderr[-3000:]
