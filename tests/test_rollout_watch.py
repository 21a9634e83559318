"""RolloutWatch (sao/runtime/rollout_watch.py): one warning when every trajectory of 5 steps in a row was
truncated, one when most of the last finished episodes failed, and a one-line stop past
runtime.max_failed_frac; on the real CLI, an action budget too short for the environment's format is said
once."""

import subprocess
import sys

import pytest

from sao.runtime.rollout_watch import TRUNCATED_STEPS, RolloutWatch, TooManyFailures
from sao.types import Status, Trajectory


def _traj(status: Status, reason: str = "") -> Trajectory:
    t = Trajectory("i", "t", [1, 2], [0, 1], [0.0, -1.0], [-1, 0], 1)
    t.status, t.status_reason = status, reason
    return t


def test_all_truncated_steps_warn_once():
    said = []
    watch = RolloutWatch(said.append)
    trunc = [_traj(Status.TRUNCATED, "turn limit")] * 4
    mixed = trunc[:3] + [_traj(Status.OK)]
    watch.trained(trunc, 1)
    watch.trained(mixed, 2)  # an ok episode resets the count
    assert said == []
    for step in range(3, 20):
        watch.trained(trunc, step)
    assert len(said) == 1 and "every trajectory of the last 5 steps was truncated (turn limit; step 7)" in said[0]
    assert TRUNCATED_STEPS == 5


def test_mostly_failed_episodes_warn_once_then_stop_in_one_line_with_the_top_reason():
    """A window of 20 finished episodes: 10 failed of 20 says nothing, 11 warns once, 19 stops (> 0.9 x 20)."""
    said = []
    watch = RolloutWatch(said.append, window=20, max_failed_frac=0.9)
    ok, full = _traj(Status.OK), _traj(Status.ENV_ERROR, "session limit reached\n(the server's traceback)")
    for t in [ok] * 10 + [full] * 10:
        watch.finished(t)
    assert said == []
    watch.finished(_traj(Status.TIMEOUT, "episode took over 600s"))  # 11 of the last 20
    assert said == ["sao: warning: 11 of the last 20 episodes failed (env_error: session limit reached x10, "
                    "timeout: episode took over 600s x1); failed episodes are not trained on, and past "
                    "runtime.max_failed_frac=0.9 the run stops"]
    for _ in range(7):
        watch.finished(full)  # 18 of 20: not above 0.9
    assert len(said) == 1
    with pytest.raises(TooManyFailures) as exc:
        watch.finished(full)
    assert str(exc.value) == ("19 of the last 20 episodes failed (most: env_error: session limit reached); "
                              "stopping (runtime.max_failed_frac=0.9; audit.jsonl names each one's reason)")


def test_max_failed_frac_1_never_stops():
    said = []
    watch = RolloutWatch(said.append, window=10, max_failed_frac=1.0)
    for _ in range(50):
        watch.finished(_traj(Status.ENV_ERROR, "down"))
    assert len(said) == 1


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
