"""A solved task stays solved (docs/algorithm.md §4, "Batches with no reward contrast").

After SFT on binary-search demonstrations the tiny model solves tests/guess_env.py every time (held-out
1.0), so batches come with every reward 1. A critic-based advantage on such a batch is only the critic's
error, and Adam turns that noise into full-size steps on a near-deterministic policy: SAO drove the
task down (replies of digits that never end, truncated at the action token limit; async runs went to
held-out 0.000 by step 30; this sync run to 0.69 with a training reward of ~0.6). With
algo.skip_uniform_rewards (the default) the actor does not step on those batches (the critic still
learns) and the task stays solved. Sync mode, so both runs are deterministic for one install (not across
package versions). At train.lr=2e-4: at the default 5e-4 a batch with one failure, the actor's first step
after the warm-up (Adam's first step moves every weight by about lr), can knock this seed off the task with
or without the skip (measured 2026-12-05, transformers 5.25: held-out 0.66 with, 0.88 without; docs/algorithm.md
§4), which is not what the skip is for."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ARGS = ["env.name=guess_env:GuessEnvironment", "sft.steps=300", "train.steps=30", "train.batch_size=8",
        "rollout.max_turns=6", "rollout.max_action_tokens=24", "rollout.max_episode_tokens=320",
        "eval.num_tasks=32", "eval.every=10", "runtime.mode=sync", "train.seed=0", "train.lr=2e-4", "output.root=runs"]


def _train(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    from conftest import SFT_CACHE

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *ARGS, f"model.cache_dir={SFT_CACHE}",
                           f"output.name={name}", *extra, "--quiet"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_solved_task_stays_solved(tmp_path):
    rows = _train(tmp_path, "guarded")
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    skipped = sum(r["actor/uniform_skipped"] for r in rows if "reward/mean" in r)
    assert evals[0] >= 0.9 and min(evals) >= 0.9, evals  # solved after SFT, and it stays so
    assert sum(rewards[-10:]) / 10 >= 0.9, rewards
    assert 10 <= skipped < 30 and skipped + 10 <= 30  # the warm-up's 10 steps never count as skipped

    guarded_evals, guarded_reward = evals, sum(rewards[-10:]) / 10
    rows = _train(tmp_path, "unguarded", "algo.skip_uniform_rewards=false")  # the mechanism: it degrades
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    # how far it degrades depends on the install (sync runs are deterministic for one install only): measured
    # 2026-12-05 held-out 1.0, 1.0, 0.97, 0.75 and a last-10-steps reward of 0.94; on 2026-12-06's fresh install
    # (failing the same way on the commit before this session's) held-out 1.0, 1.0, 0.97, 0.97 for both runs, the unguarded
    # one's training reward 0.75-0.875 on four of its last 20 steps (0.963 over the last 10) and its entropy up 5x,
    # the guarded one's 1.0 on every step after its warm-up but one
    assert evals[0] >= 0.9 and sum(r["actor/uniform_skipped"] for r in rows if "reward/mean" in r) == 0
    assert min(guarded_evals) >= min(evals) and guarded_reward > sum(rewards[-10:]) / 10, (guarded_evals, evals, rewards)
