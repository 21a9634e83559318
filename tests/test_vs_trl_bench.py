"""benchmarks/vs_trl.py: the shared task and reward, the figures, and a real run of its sao arms.

TRL itself is never installed into the main venv: the end-to-end test runs `--arms` without `trl`.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # vs_trl.py imports vs_trl_task as a sibling
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_needs_eos_and_the_right_answer():
    task = _load("vs_trl_task")
    assert task.reward("7", 7, eos=True) == 1.0
    assert task.reward("7", 7, eos=False) == 0.0  # cut at the token limit: no credit
    assert task.reward("it is 3 or 7", 7, eos=True) == 1.0  # untagged: the last integer
    assert task.reward("<answer>3</answer> 7", 7, eos=True) == 0.0  # a tagged answer wins
    assert task.reward("seven", 7, eos=True) == 0.0
    pairs = task.tasks(0, 200)
    assert pairs == task.tasks(0, 200) and pairs != task.tasks(1, 200)  # seeded
    for text, answer in pairs:
        a, b = map(int, text.removeprefix("What is ").removesuffix("?").split("+"))
        assert 0 <= a <= 4 and 0 <= b <= 4 and answer == a + b


def test_sao_environment_scores_with_the_shared_reward():
    task = _load("vs_trl_task")
    env = task.AdditionEnvironment(task.EnvOptions(), seed=0)
    t = next(env.train_tasks())
    ep = env.new_episode(None)
    assert ep.reset(t) == [{"role": "user", "content": t.prompt}]
    right, wrong = ep.step(str(t.answer)), ep.step(str(t.answer + 1))
    assert right.done and right.reward == 1.0 and wrong.reward == 0.0
    assert len({x.prompt for x in env.eval_tasks(25)}) == 25  # every (a, b) pair once


def test_thresholds_use_the_trailing_window():
    bench = _load("vs_trl")
    # rewards 0 for 20 steps, then 1: the trailing-20 mean reaches 0.1 when 2 of the last 20 are 1 (step 22),
    # 0.2 at step 24; steps take 0.5 s each
    curve = [{"step": i + 1, "wall_s": 0.5 * (i + 1), "reward": 0.0 if i < 20 else 1.0} for i in range(30)]
    fig = bench.figures({"curve": curve})
    assert fig["reach_0.1"] == {"step": 22, "wall_s": 11.0}
    assert fig["reach_0.2"] == {"step": 24, "wall_s": 12.0}
    assert fig["final_trailing_reward"] == 0.5 and fig["completions_per_s"] == 16 * 30 / 15.0


@pytest.mark.slow
def test_quick_run_of_the_sao_arms_writes_every_figure(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "benchmarks/vs_trl.py", "--quick", "--steps", "3", "--arms", "sao_sync", "sao_async",
           "--out", str(out), "--runs-root", str(runs), "--trl-venv", str(tmp_path / "no-trl")]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=900)
    res = json.loads((out / "results.json").read_text())
    assert (out / "curves.png").stat().st_size > 0
    assert not (tmp_path / "no-trl").exists()  # no TRL arm: no TRL venv
    assert [r["arm"] for r in res["runs"]] == ["sao_sync", "sao_async"]
    assert "load" in res["settings"]
    for r in res["runs"]:
        assert len(r["curve"]) == 3 and r["peak_tree_rss_mb"] > 100 and 0 < r["peak_tree_pss_mb"] <= r["peak_tree_rss_mb"]
        assert {"steps_wall_s", "completions_per_s", "reach_0.1", "reach_0.3", "final_trailing_reward"} <= set(
            r["figures"])
    # the async tree has the trainer, the fork server and a rollout worker; sync is one process
    assert len(res["runs"][1]["processes_at_rss_peak"]) >= 3 and len(res["runs"][0]["processes_at_rss_peak"]) == 1
    assert set(res["summary"]["sao_async"]["over_sync"]) == {"steps_wall", "peak_rss", "peak_pss", "peak_uss"}
