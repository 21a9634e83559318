"""The warning on a critic that explains nothing (sao/runtime/critic_watch.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY

from sao.config import ConfigError, load_config
from sao.runtime.critic_watch import LOW_EV, CriticWatch


def _row(ev, warmup=0.0):
    return {"critic/explained_variance": ev, "train/critic_warmup": warmup}


def test_warns_once_after_the_limit_of_low_steps_and_counts_only_informative_ones():
    watch = CriticWatch()
    for step in range(10):  # critic warm-up: not counted
        assert watch.update(_row(0.0, warmup=1.0), 5, step) is None
    rows = [_row(0.001), _row(float("nan")), _row(None), _row(-0.02), _row(0.0), _row(0.049)]
    out = [watch.update(r, 5, 10 + i) for i, r in enumerate(rows)]
    assert out == [None] * 6 and watch.low_steps == 4  # equal rewards (nan / None) neither count nor reset
    row = _row(0.0)
    message = watch.update(row, 5, 16)
    assert message is not None and "step 16" in message and "critic.path" in message and "\n" not in message
    assert row["critic/low_ev_steps"] == 5.0
    assert [watch.update(_row(0.0), 5, s) for s in range(17, 30)] == [None] * 13  # once per run


def test_a_critic_that_explains_something_resets_the_count():
    watch = CriticWatch()
    for step in range(4):
        watch.update(_row(0.0), 5, step)
    watch.update(_row(LOW_EV + 0.01), 5, 4)
    assert watch.low_steps == 0
    assert [watch.update(_row(0.0), 5, s) for s in range(5, 9)] == [None] * 4


def test_zero_turns_it_off_and_the_default_is_50():
    watch = CriticWatch()
    assert [watch.update(_row(0.0), 0, s) for s in range(200)] == [None] * 200
    assert load_config(overrides=[]).critic.warn_low_ev_steps == 50
    assert load_config(overrides=["critic.warn_low_ev_steps=0"]).critic.warn_low_ev_steps == 0
    with pytest.raises(ConfigError):
        load_config(overrides=["critic.warn_low_ev_steps=-1"])


COIN = '''
import zlib
from examples.word_env.word_env import WordEnvironment, WordEpisode
from sao.envs.base import StepResult


class CoinEpisode(WordEpisode):
    async def step(self, action):  # a reward no critic can predict: a hash of the reply's text
        return StepResult("", reward=float(zlib.crc32(action.encode()) % 2), done=True)


class CoinEnvironment(WordEnvironment):
    def new_episode(self, ctx):
        return CoinEpisode(1)
'''


@pytest.mark.slow
def test_a_run_whose_critic_explains_nothing_prints_the_warning_once(tmp_path):
    """End to end: a reward no state predicts, a critic that barely learns; the warning comes once, in one
    line, and the run goes on to the end."""
    (tmp_path / "coinenv.py").write_text(COIN)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "env.name=coinenv:CoinEnvironment",
                           "train.steps=6", "critic.lr=1e-9", "critic.warn_low_ev_steps=2", "--sync", "--quiet"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "critic/explained_variance has stayed below" in line]
    assert len(warnings) == 1 and warnings[0].startswith("sao: warning:"), proc.stderr[-3000:]
    run = next((tmp_path / "runs").iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("critic/low_ev_steps", 0) for r in rows) >= 2 and "held-out accuracy" in proc.stdout
