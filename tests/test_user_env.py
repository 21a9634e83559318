"""User environments: the example `word` environment through `module:Class` and the registry, and a
user environment that raises in ~20% of episodes, run through the real `sao train` CLI."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TINY as BASE

from sao.envs import base, make_environment, register_environment
from sao.types import Task

REPO = Path(__file__).resolve().parents[1]
WORD = "examples.word_env.word_env:WordEnvironment"


@pytest.fixture()
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # `examples` is importable from the repository root


def test_example_env_through_module_class_path(repo_on_path):
    env = make_environment(WORD, {"min_len": 4, "max_len": 4}, seed=0)
    train = env.train_tasks()
    tasks = [next(train) for _ in range(300)]
    assert all(len(t.answer) == 4 and t.prompt == f"reverse: {t.answer[::-1]}" for t in tasks)
    held = env.eval_tasks(30)
    assert [t.prompt for t in held] == [t.prompt for t in make_environment(WORD, {"min_len": 4, "max_len": 4},
                                                                           seed=7).eval_tasks(30)]
    assert not {t.prompt for t in tasks} & {t.prompt for t in held}  # disjoint splits

    ep = env.new_episode(base.EpisodeContext())
    assert ep.reset(Task("t", "reverse: kato", "otak")) == [{"role": "user", "content": "reverse: kato"}]
    r = ep.step("<answer>otka</answer>")  # 2 of 4 letters right: hint, one more try
    assert (r.observation, r.done) == ("<result>2 of 4 letters right</result>", False)
    r = ep.step("<answer>otak</answer>")
    assert r.done and r.reward == 1.0 and r.info == {"correct": 1.0, "char_acc": 1.0, "attempts": 2}
    demo = env.demo(held[0], random.Random(0))
    assert demo[-1] == {"role": "assistant", "content": f"<answer>{held[0].answer}</answer>"}


def test_example_env_option_errors_and_registration(repo_on_path):
    with pytest.raises(ValueError, match=r"^env\.options\.max_attempts:"):
        make_environment(WORD, {"max_attempts": 0}, seed=0)
    with pytest.raises(ValueError, match=r"^env\.options\.colour:"):
        make_environment(WORD, {"colour": "red"}, seed=0)
    with pytest.raises(ValueError, match=r"^env\.name: module 'examples\.word_env\.word_env' has no attribute"):
        make_environment("examples.word_env.word_env:Nope", {}, seed=0)
    from examples.word_env.word_env import WordEnvironment

    register_environment("word-test", WordEnvironment)
    try:
        env = make_environment("word-test", {"max_attempts": 1}, seed=0)
        ep = env.new_episode(base.EpisodeContext())
        ep.reset(Task("t", "reverse: ab", "ba"))
        assert ep.step("no answer").done  # one attempt only
    finally:
        base._REGISTRY.pop("word-test")


# A user environment whose `step` raises in a seeded, deterministic fail_rate of episodes (by task id).
FLAKY = '''
    import random

    from pydantic import Field

    from examples.word_env.word_env import WordEnvironment, WordEpisode, WordOptions


    class FlakyOptions(WordOptions):
        fail_rate: float = Field(0.2, gt=0, le=1, description="fraction of episodes whose step raises")


    class FlakyEpisode(WordEpisode):
        def __init__(self, max_attempts, fail_rate, seed):
            super().__init__(max_attempts)
            self.fail_rate, self.seed, self.broken = fail_rate, seed, False

        def reset(self, task):  # task ids are word-<split>-<index>
            _, split, index = task.id.split("-")
            block = round(1 / self.fail_rate)  # in each block of 5 consecutive tasks, one (seeded) breaks
            position = random.Random(f"{self.seed}:{split}:{int(index) // block}").randrange(block)
            self.broken = int(index) % block == position
            return super().reset(task)

        def step(self, action):
            if self.broken:
                raise RuntimeError("flaky environment: lost its connection")
            return super().step(action)


    class FlakyEnvironment(WordEnvironment):
        Options = FlakyOptions

        def new_episode(self, ctx):
            return FlakyEpisode(self.options.max_attempts, self.options.fail_rate, self.seed)
'''

TINY = [*BASE, "rollout.max_action_tokens=16", "eval.num_tasks=8", "output.trajectories_every=1"]


@pytest.mark.slow
def test_failing_user_env_through_the_cli(tmp_path):
    (tmp_path / "flaky_env.py").write_text(textwrap.dedent(FLAKY))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "sao.cli", "train", *TINY, "env.name=flaky_env:FlakyEnvironment",
         "env.options.fail_rate=0.2", "output.name=flaky", "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "flaky"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    failed = [r["async/failed_episodes_total"] for r in steps]
    assert failed == sorted(failed)  # a running total
    # One task in every block of five raises once `step` is reached (an episode cut off before its first
    # step cannot). Measured: 3-5 failures per run. At most one per five tasks started, counting the
    # 16 trained, the stale-dropped and up to rollout.concurrency=8 still in flight.
    started = failed[-1] + 4 * 4 + steps[-1]["async/dropped_stale_total"] + 8
    assert 1 <= failed[-1] <= started / 5 + 1, failed
    assert json.loads((run / "summary.json").read_text())["extra"]["failed"] == failed[-1]
    for line in (run / "trajectories" / "step_000001.jsonl").read_text().splitlines():
        assert json.loads(line)["status"] in ("ok", "truncated")  # broken episodes are never trained on



# new_episode raises on the 5th episode a rollout worker opens (a worker process on the local backend;
# evaluation in the trainer process is not counted)
BAD_OPEN = '''
import multiprocessing

from examples.word_env.word_env import WordEnvironment

CALLS = [0]


class BadOpen(WordEnvironment):
    def new_episode(self, ctx):
        if multiprocessing.current_process().name.startswith("sao-rollout"):
            CALLS[0] += 1
            if CALLS[0] == 5:
                raise RuntimeError("bad open: no episode")
        return super().new_episode(ctx)
'''


@pytest.mark.slow
def test_an_env_that_raises_in_new_episode_fails_that_episode_only(tmp_path):
    """It raised outside the episode's error handling: the worker's slot died with it, the episode never
    finished (`unfinished_at_exit` at the end) and the worker served on with one slot fewer."""
    (tmp_path / "bad_open.py").write_text(textwrap.dedent(BAD_OPEN))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "sao.cli", "train", *TINY, "env.name=bad_open:BadOpen", "output.name=b", "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "b"
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert steps[-1]["async/failed_episodes_total"] == 1
    events = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "finished" and e["status"] == "env_error"]
    assert len(failed) == 1 and failed[0]["id"] == "e0000004"  # the 5th issued episode
    assert "e0000004" not in {e["id"] for e in events if e["event"] == "unfinished_at_exit"}
    dropped = [e for e in events if e["event"] == "dropped" and e["id"] == "e0000004"]
    assert [e["reason"] for e in dropped] == ["env_error"]
