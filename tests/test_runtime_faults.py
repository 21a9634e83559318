"""Faults the runtime must survive: hung environment steps, dead rollout workers, a killed or
interrupted trainer (then --resume), all on the real CLI and real processes."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import TINY as BASE

from sao.engine.torch_engine import TorchEngine
from sao.envs.base import StepResult
from sao.rollout.agent_loop import EpisodeLimits, hung_steps, run_episode
from sao.types import SamplingParams, Status, Task

RELEASE = threading.Event()


class SometimesHangs:
    """A plain (synchronous) env whose reset never returns for tasks named 'hang*' (reset and step go
    through the same path; reset is used so the test does not depend on what the model samples)."""

    def reset(self, task):
        if task.id.startswith("hang"):
            RELEASE.wait(60)
        return [{"role": "user", "content": "1+1"}]

    def step(self, action):
        return StepResult("", 1.0, True)


def test_hung_sync_steps_cost_only_their_own_episodes(tiny):
    """More hung steps than the default thread pool has threads (min(32, cpus + 4)): later episodes
    must still complete (they all timed out before, once the shared pool was exhausted)."""
    model, codec = tiny
    n_hung = (os.cpu_count() or 1) + 5
    limits = EpisodeLimits(max_turns=1, max_action_tokens=4, step_timeout_s=0.5)

    async def go():
        engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=64, seed=0)
        try:
            hung = await asyncio.gather(*(run_episode(SometimesHangs(), Task(f"hang{i}", "x"), engine, codec,
                                                      SamplingParams(max_new_tokens=4), limits) for i in range(n_hung)))
            ok = await asyncio.gather(*(run_episode(SometimesHangs(), Task(f"ok{i}", "x"), engine, codec,
                                                    SamplingParams(max_new_tokens=4), limits) for i in range(16)))
        finally:
            await engine.close()
        return hung, ok

    torch.manual_seed(0)
    hung, ok = asyncio.run(go())
    assert all(t.status == Status.TIMEOUT for t in hung)
    assert all(t.status in (Status.OK, Status.TRUNCATED) and t.turns == 1 for t in ok), [t.status_reason for t in ok]
    assert hung_steps() == n_hung  # counted while they hang
    RELEASE.set()
    deadline = time.time() + 5
    while hung_steps() and time.time() < deadline:
        time.sleep(0.05)
    assert hung_steps() == 0


TINY = BASE
pytestmark = pytest.mark.slow


def _popen(args, cwd):
    return subprocess.Popen([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(run):
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(proc, run, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.get("step", 0) >= step and "reward/mean" in r for r in _rows(run)):
            return
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached")


def _children(pid):
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [(int(line.split()[0]), line) for line in out.splitlines()]


def _workers(pid):
    """Rollout worker processes of trainer `pid`: the children of its fork server (sao/runtime/local.py)."""
    servers = [p for p, args in _children(pid) if "forkserver" in args]
    return [p for s in servers for p, _ in _children(s)]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def audit_of(run):
    """(issued ids, trained ids in order, dropped ids, pending ids of the final checkpoint), checked clean:
    nothing lost (every issued id is trained, dropped or pending) and nothing trained twice."""
    events = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()]
    issued = {e["id"] for e in events if e["event"] == "issued"}
    trained = [e["id"] for e in events if e["event"] == "trained"]
    dropped = [e["id"] for e in events if e["event"] == "dropped"]
    state = torch.load(run / "checkpoints" / "final" / "trainer_state.pt", weights_only=False)
    pending = {a["id"] for a in state["scheduler"]["pending"]} | {json.loads(t)["id"] for t in state["queue"]["queued"]}
    assert len(set(trained)) == len(trained), "an episode was trained twice"
    assert not set(trained) & set(dropped) and not pending & (set(trained) | set(dropped))
    assert issued == set(trained) | set(dropped) | pending, "an issued episode was lost"
    return events, state


def test_a_killed_rollout_worker_is_restarted_and_its_episodes_run_again(tmp_path):
    run = tmp_path / "runs" / "w"
    proc = _popen([*TINY, "train.steps=12", "runtime.rollout_workers=2", "output.name=w"], tmp_path)
    _wait_for_step(proc, run, 1)
    victim = _workers(proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["async/worker_restarts_total"] >= 1
    events, _ = audit_of(run)
    lost = [e for e in events if e["event"] == "lost"]
    assert lost and all("restarted" in e["reason"] for e in lost)
    reissued = {e["id"] for e in lost}
    assert reissued <= {e["id"] for e in events if e["event"] in ("trained", "dropped", "finished")}


def test_trainer_sigkill_leaves_no_worker_and_resume_is_lossless(tmp_path):
    run = tmp_path / "runs" / "k"
    args = [*TINY, "train.steps=12", "output.save_every=2", "output.name=k"]
    proc = _popen(args, tmp_path)
    _wait_for_step(proc, run, 3)
    kids = _workers(proc.pid)
    assert kids, "the trainer has rollout workers"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(k) for k in kids):
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids), "a rollout worker outlived the trainer"
    err = proc.stderr.read()  # the workers wrote here too: none may print a traceback as it goes
    assert "Traceback" not in err, err[-3000:]
    saved = (run / "checkpoints" / "latest").read_text().strip()
    assert saved in [f"step_{s:06d}" for s in range(2, 12, 2)]
    resumed = subprocess.run([sys.executable, "-m", "sao.cli", "train", "--resume", str(run), "--quiet"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in _rows(run) if "reward/mean" in r]
    assert steps == list(range(1, 13))  # continuous: steps after the checkpoint are not recorded twice
    _, state = audit_of(run)
    # optimizer state was restored, not rebuilt: Adam's step count equals the actor steps of the whole run
    trainer = state["trainer"]
    assert state["step"] == 12 and trainer["actor_opt"]["state"][0]["step"] == trainer["actor_version"] == 11
    assert trainer["critic_opt"]["state"][0]["step"] == trainer["critic_version"] == 12 * 2


def test_sigterm_writes_a_checkpoint_that_resumes(tmp_path):
    run = tmp_path / "runs" / "t"
    proc = _popen([*TINY, "train.steps=12", "output.name=t"], tmp_path)
    _wait_for_step(proc, run, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "SIGTERM: checkpoint" in err, err[-3000:]
    stopped_at = torch.load(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                            / "trainer_state.pt", weights_only=False)
    assert stopped_at["step"] >= 2 and stopped_at["queue"]["queued"] + stopped_at["scheduler"]["pending"]
    resumed = subprocess.run([sys.executable, "-m", "sao.cli", "train", "--resume", str(run), "--quiet"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in _rows(run) if "reward/mean" in r] == list(range(1, 13))
    audit_of(run)
