"""`runtime.backend=thread` (sao/runtime/inprocess.py): an async run whose rollout workers are threads of
the trainer's process, on the real `sao train` CLI: no second process, every episode accounted for, and a
worker thread that crashes is restarted with its episodes issued again, as a dead worker process is."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import TINY as BASE

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

# A user environment that fails twice in `new_episode`, counted over the rollout worker threads of the
# whole process (under a lock: CI once saw no restart, consistent with both threads reading the count after
# both had incremented it past 30): the 5th episode raises RuntimeError, which ends only that episode (env_error); the 30th
# calls sys.exit, which no episode catches: the worker thread's event loop stops as a worker process
# would exit. Evaluation (the trainer's own thread) is not counted.
CRASHING = '''
import sys
import threading

from examples.word_env.word_env import WordEnvironment

CALLS = [0]
LOCK = threading.Lock()


class CrashingEnvironment(WordEnvironment):
    def new_episode(self, ctx):
        if threading.current_thread().name.startswith("sao-rollout"):
            with LOCK:  # two worker threads: each call must see its own count, or both can miss the 30th
                CALLS[0] += 1
                n = CALLS[0]
            if n == 5:
                raise RuntimeError("crashing environment: cannot open an episode")
            if n == 30:
                sys.exit("crashing environment: exits")
        return super().new_episode(ctx)
'''


def _train(args, cwd, env=None):
    return subprocess.Popen([sys.executable, "-m", "sao.cli", "train", *BASE, "runtime.backend=thread", *args,
                             "--quiet"], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid):
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines()]


def _audit(run):
    events: dict[str, list[dict]] = {}
    for line in (run / "audit.jsonl").read_text().splitlines():
        e = json.loads(line)
        events.setdefault(e["event"], []).append(e)
    return events


def test_an_async_run_on_the_thread_backend_is_one_process(tmp_path):
    proc = _train(["train.steps=6", "output.name=t"], tmp_path)
    seen = []
    while proc.poll() is None:
        seen += _children(proc.pid)
        time.sleep(0.1)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    # no fork server and no worker process (the SFT warm start of a cold cache may run in a child first:
    # the model cache is warm in the test suite, see conftest.py)
    assert not [c for c in seen if "forkserver" in c or "sao-rollout" in c], seen
    run = tmp_path / "runs" / "t"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert max(r["async/lag_max"] for r in steps) <= 1  # runtime.max_lag=1 in BASE
    events = _audit(run)
    trained = [e["id"] for e in events["trained"]]
    assert len(trained) == len(set(trained)) == 6 * 4  # none twice


def test_a_crashed_worker_thread_is_restarted_and_its_episodes_run_again(tmp_path):
    (tmp_path / "crashing_env.py").write_text(textwrap.dedent(CRASHING))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = _train(["train.steps=12", "env.name=crashing_env:CrashingEnvironment", "output.name=c"], tmp_path, env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    run = tmp_path / "runs" / "c"
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert steps[-1]["async/worker_restarts_total"] == 1
    assert steps[-1]["async/failed_episodes_total"] >= 1  # the RuntimeError: that episode only
    events = _audit(run)
    lost = events["lost"]
    assert lost and all("(a thread) stopped with SystemExit: crashing environment: exits" in e["reason"]
                        for e in lost)
    trained = [e["id"] for e in events["trained"]]
    assert len(trained) == len(set(trained)) == 12 * 4
    # every issued episode was trained, dropped, failed, or is still running at the end (none vanished)
    settled = {e["id"] for k in ("trained", "dropped", "unfinished_at_exit", "queued_at_exit")
               for e in events.get(k, [])}
    assert {e["id"] for e in events["issued"]} <= settled


# An environment that cannot be built in a rollout worker (the trainer builds it with train.seed, the
# workers with train.seed + 1 + 1000 * index): every start fails.
WORKER_FAILS = '''
from examples.word_env.word_env import WordEnvironment


class WorkerSeedsFail(WordEnvironment):
    def __init__(self, options, seed=0):
        if seed % 1000:
            raise RuntimeError("no dictionary file in this worker")
        super().__init__(options, seed=seed)
'''


@pytest.mark.parametrize("backend", ["local", "thread"])
def test_a_worker_that_cannot_start_stops_the_run_in_one_line(tmp_path, backend):
    """On the thread backend the host's error escaped from the backend as a traceback; now both backends
    go through the scheduler's crash-loop rule (the thread's line also says why)."""
    (tmp_path / "worker_fails.py").write_text(textwrap.dedent(WORKER_FAILS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *BASE, f"runtime.backend={backend}",
                           "env.name=worker_fails:WorkerSeedsFail", "output.name=f", "--quiet"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sao: error: rollout worker 0 died 3 times in a row before reporting anything"), last
    if backend == "thread":
        assert "RuntimeError: no dictionary file in this worker" in last
        assert "Traceback" not in proc.stderr  # nothing else runs in a worker thread's own process
    assert (tmp_path / "runs" / "f" / "config.yaml").exists()  # the run directory is kept
