"""The ray backend on the real CLI: same Trajectory contract, metrics, results and audit as local;
a SIGKILLed worker actor: tests/test_faults.py."""

import json
import subprocess
import sys

import pytest
from conftest import TINY
from faults import audit_of
from faults import rows as _rows
from test_smoke_train import REQUIRED

pytestmark = pytest.mark.ray


def _actor_pids():
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "ray::RolloutActor" in line]


def test_train_on_the_ray_backend(tmp_path, ray_address):
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "train.steps=4", "eval.every=2",
                           "runtime.backend=ray", f"runtime.ray_address={ray_address}", "runtime.rollout_workers=2",
                           "output.name=ray", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "ray"
    steps = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    local_only = {"perf/trainer_all_cores_frac"}  # adaptive threads lend the local workers' cores (loop.py)
    assert not [k for k in REQUIRED if k not in set().union(*steps) and k not in local_only]
    assert [r["step"] for r in _rows(run) if "eval/accuracy" in r] == [0, 2, 4]
    assert all(r["async/lag_max"] <= 1 for r in steps)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    audit_of(run)
    assert not _actor_pids()  # the run's actors are gone; the shared cluster stays up


