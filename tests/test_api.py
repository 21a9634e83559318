"""The Python API (`from sao import Config, train, evaluate`) and the trackers, offline.

One short run of examples/api_quickstart.py covers: an environment class defined in a script's
`__main__` with no `if __name__ == "__main__":` guard, sent by value to the rollout process
(forked from the fork server); the API's validation; and tensorboard, wandb (offline) and trackio (local) receiving the
same metric names as metrics.jsonl.
"""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY as BASE

import sao
from sao.config import value_sources

ROOT = Path(__file__).resolve().parents[1]

TINY = [*BASE, "train.steps=3", "rollout.max_turns=1", "output.name=api"]


def test_api_validates_like_the_cli(tmp_path):
    with pytest.raises(sao.ConfigError, match=r"^train\.stpes: unknown key; did you mean train\.steps\?$"):
        sao.train({"train": {"stpes": 3}})
    with pytest.raises(sao.ConfigError, match=r"^env\.name: unknown environment 'nope'"):
        sao.train(sao.Config(), "env.name=nope", f"output.root={tmp_path}")
    with pytest.raises(sao.ConfigError, match="^env: expected an environment class"):
        sao.train(None, env=3)
    cfg = sao.load_config({"train": {"steps": 5}}, ["train.lr=0.01"])
    src = value_sources(cfg)
    assert (src["train.steps"], src["train.lr"], src["train.seed"]) == ("api", "override", "default")
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_quickstart_script_trains_a_main_module_environment_and_reports_to_every_tracker(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "api_quickstart.py"), *TINY,
                           "output.report_to=[tensorboard,wandb,trackio]"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy:" in proc.stdout and "greedy held-out accuracy:" in proc.stdout
    run = tmp_path / "runs" / "api"
    assert "name: LargerEnvironment  # api" in (run / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    names = {k for r in rows for k in r if k not in ("step", "time")}
    assert {"reward/mean", "dis/masked_low_frac", "eval/accuracy"} <= names
    assert list((run / "tb").glob("events.out.tfevents.*"))
    # wandb, offline: the run's transaction log holds every metric name
    logs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    blob = logs[0].read_bytes()
    assert all(name.encode() in blob for name in ("reward/mean", "dis/masked_low_frac", "eval/accuracy"))
    # trackio, local: the same names and steps in its SQLite store
    with sqlite3.connect(tmp_path / "trackio" / "sao.db") as db:
        stored = [(step, json.loads(m)) for step, m in db.execute("select step, metrics from metrics where run_name='api'")]
    assert {"reward/mean", "dis/masked_low_frac", "eval/accuracy"} <= {k for _, m in stored for k in m}
    assert sorted({s for s, m in stored if "reward/mean" in m}) == [1, 2, 3]
