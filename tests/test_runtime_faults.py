"""Faults the runtime must survive: hung environment steps and an interrupted trainer (then --resume), on
the real CLI and real processes. Killed processes of every runner: tests/test_faults.py."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import TINY as BASE
from faults import audit_of, popen, rows, wait_for_step

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


def test_sigterm_writes_a_checkpoint_that_resumes(tmp_path):
    run = tmp_path / "runs" / "t"
    proc = popen([*TINY, "train.steps=12", "output.name=t"], tmp_path)
    wait_for_step(proc, run, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "SIGTERM: checkpoint" in err, err[-3000:]
    stopped_at = torch.load(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                            / "trainer_state.pt", weights_only=False)
    assert stopped_at["step"] >= 2 and stopped_at["queue"]["queued"] + stopped_at["scheduler"]["pending"]
    resumed = subprocess.run([sys.executable, "-m", "sao.cli", "train", "--resume", str(run), "--quiet"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in rows(run) if "reward/mean" in r] == list(range(1, 13))
    audit_of(run)
