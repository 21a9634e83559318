"""`sao bench`: the collapse detector, time to target and recovery by hand, a bad experiment refused
with one line, and one quick preset run end to end (every file it promises)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sao.bench.analysis import accuracy_at, collapse, nonfinite_step, recovery, time_to_target
from sao.bench.experiment import _progress_line, load_experiment, train_args

ROOT = Path(__file__).resolve().parents[1]


def _run(evals, entropy=None, loss=None, n=10):
    steps = list(range(1, n + 1))
    return {"step": steps, "wall_s": [10.0 * s for s in steps], "entropy": entropy or [1.0] * n,
            "loss": loss or [0.1] * n, "eval_step": [s for s, _ in evals], "eval_accuracy": [a for _, a in evals],
            "eval_wall_s": [10.0 * s for s, _ in evals],
            "nonfinite": [s for s, x in zip(steps, loss or [0.1] * n) if not math.isfinite(x)]}


def test_only_a_non_finite_update_is_a_non_finite_step():
    """Rows as the learner logs them: a batch whose rewards are all equal skips the actor by design
    (actor/uniform_skipped, no loss/policy); reproduced on the stability rivals bench, where it was reported
    as a non-finite collapse of every SAO run."""
    uniform = {"step": 76, "reward/mean": 1.0, "actor/uniform_skipped": 1.0, "guard/skipped_updates": 0,
               "guard/skipped_updates_total": 0, "critic/value_loss": 0.0008}
    assert not nonfinite_step(uniform)
    later = {"step": 90, "loss/policy": -0.01, "guard/skipped_updates": 0, "guard/skipped_updates_total": 3}
    assert not nonfinite_step(later)  # a skip long ago is not this step's
    assert nonfinite_step({"step": 91, "loss/policy": -0.01, "guard/skipped_updates": 1})
    assert nonfinite_step({"step": 92, "loss/policy": float("nan"), "guard/skipped_updates": 0})
    assert nonfinite_step({"step": 93, "loss/policy": None})


def test_progress_shows_what_a_run_does_before_its_first_step(tmp_path):
    run_dir, log_file = tmp_path / "q2-sao-s0", tmp_path / "q2-sao-s0.log"
    assert _progress_line(run_dir, 40, log_file) == "step 0/40"  # nothing written yet
    log_file.write_text("generating TextWorld games into .sao_cache/x\ngenerating TextWorld games: 300/1152 (30s)\n")
    assert _progress_line(run_dir, 40, log_file) == "step 0/40, generating TextWorld games: 300/1152 (30s)"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert _progress_line(run_dir, 40, log_file) == "step 1/40, reward 0.50"  # then the metrics


def test_collapse_detector():
    # best 0.6 at step 4; 0.2 at step 6 is < 50% of it and every later evaluation stays below 0.3
    assert collapse(_run([(0, 0.3), (2, 0.5), (4, 0.6), (6, 0.2), (8, 0.1), (10, 0.25)]))[0] == 6
    # one bad evaluation that recovers is noise, not a collapse
    assert collapse(_run([(0, 0.3), (4, 0.6), (6, 0.2), (8, 0.5), (10, 0.55)])) == (None, "")
    # a single low final evaluation cannot show that it stays
    assert collapse(_run([(0, 0.3), (4, 0.6), (10, 0.1)])) == (None, "")
    # entropy under 10% of its start (1.0) from step 7 on; a non-finite loss at step 9 comes later
    ent = [1.0, 0.9, 0.8, 0.5, 0.3, 0.2, 0.05, 0.04, 0.03, 0.02]
    loss = [0.1] * 8 + [float("nan"), 0.1]
    step, reason = collapse(_run([(0, 0.3), (10, 0.3)], entropy=ent, loss=loss))
    assert step == 7 and reason.startswith("entropy")
    assert collapse(_run([(0, 0.3), (10, 0.3)], loss=loss))[0] == 9
    # the same entropy on a policy that converged: every evaluation from step 7 on is >= 90% of its best
    assert collapse(_run([(0, 0.3), (6, 0.9), (8, 0.95), (10, 0.9)], entropy=ent)) == (None, "")
    # entropy gone while accuracy still climbs, ending at its best: convergence as well
    assert collapse(_run([(0, 0.3), (6, 0.5), (8, 0.8), (10, 0.95)], entropy=ent)) == (None, "")
    # near-deterministic but ending far below its best (0.95 -> 0.6): still an entropy collapse
    assert collapse(_run([(0, 0.3), (6, 0.95), (8, 0.7), (10, 0.6)], entropy=ent))[0] == 7


def test_quick_preset_replaces_analysis_settings():
    online = load_experiment("online")
    assert online.preset(quick=False).analysis["recovery"]["window"] == 10
    quick = online.preset(quick=True)
    assert quick.analysis["recovery"]["window"] == 2  # fits in the quick preset's 3-step phases
    phases = next(o for o in quick.overrides if o.startswith("env.options.phases"))
    assert "start: 3" in phases
    # --seeds replaces the seeds of either preset
    assert online.preset(quick=False, seeds=[4]).seeds == [4] and online.preset(quick=True, seeds=[5, 6]).seeds == [5, 6]
    from sao.cli import build_parser

    assert build_parser().parse_args(["bench", "stability", "--seeds", "0", "1"]).seeds == [0, 1]


def test_time_to_target_accuracy_at_and_recovery():
    run = _run([(0, 0.3), (4, 0.55), (6, 0.62), (10, 0.7)])
    assert time_to_target(run, 0.6) == (60.0, 6) and time_to_target(run, 0.9) == (None, None)
    assert accuracy_at(run, 50.0) == 0.55
    steps = list(range(0, 30))
    rewards = [1.0] * 10 + [0.0] * 5 + [1.0] * 15  # switch at 10: new phase rewards 1 from step 15
    # window 3: the mean of the new phase's last 3 rewards first reaches 0.8 at step 17 -> 7 steps after the switch
    assert recovery(steps, rewards, [0, 10], recover_at=0.8, window=3) == [7]
    assert recovery(steps, [1.0] * 10 + [0.0] * 20, [0, 10], 0.8, 3) == [None]


def test_experiments_ship_with_the_package_and_later_settings_win():
    import fnmatch

    import sao.bench
    from sao.bench.experiment import EXPERIMENTS_DIR

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package = Path(sao.bench.__file__).parent
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["sao.bench"]
    shipped = sorted(EXPERIMENTS_DIR.glob("*.yaml"))
    assert EXPERIMENTS_DIR.parent == package
    assert [p.stem for p in shipped] == ["ablation", "horizon", "online", "stability", "wallclock"]
    for path in shipped:
        assert any(fnmatch.fnmatch(str(path.relative_to(package)), g) for g in globs)  # in the wheel
        exp = load_experiment(path.stem)
        assert exp.variants and exp.description
        assert exp.config is None  # no file outside the package: it runs from any folder
    exp = load_experiment("stability").preset(quick=True)
    args = train_args(exp, "grpo", 0, Path("r"), ["train.steps=3"])
    assert "train.steps=3" in args and sum(a.startswith("train.steps=") for a in args) == 1
    assert "algo.group_size=4" in args and "algo.name=grpo" in args


def _sao(*args, cwd, timeout):
    return subprocess.run([sys.executable, "-m", "sao.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_bad_experiment_is_refused_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("variants:\n  a: [algo.name=sao]\nbudget: 3\n")
    proc = _sao("bench", str(bad), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "budget: unknown key" in proc.stderr and len(proc.stderr.splitlines()) == 1
    bad.write_text("variants:\n  a: [algo.name=grpo, train.batch_size=6]\n")
    proc = _sao("bench", str(bad), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "variant 'a': train.batch_size: 6 is not a multiple" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_wallclock_quick_preset_writes_every_file(tmp_path, monkeypatch):
    proc = _sao("bench", "wallclock", "--quick", "--out", "out", "model.cache_dir=cache", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "curves.png"}
    res = json.loads((out / "results.json").read_text())
    assert set(res["variants"]) == {"sao", "sao_sync", "sao_rollout_only", "grpo_sync", "grpo_async"}
    assert all(r["returncode"] == 0 for r in res["runs"]) and len(res["runs"]) == 5
    for v in res["variants"].values():
        s = v["per_seed"]["0"]
        assert s["steps_done"] == 6 and s["final_accuracy"] is not None and s["train_wall_s"] > 0
    ratio = res["overlap"]["sao vs sao_rollout_only"][0]
    assert ratio["gen_only_from"] == "rollout_only run" and ratio["gen_only_s"] > 0 and ratio["train_only_s"] > 0
    assert ratio["gen_only_s"] == res["variants"]["sao_rollout_only"]["per_seed"]["0"]["train_wall_s"]
    assert ratio["async_over_max"] > 0
    # the rollout-only run trained nothing: its final actor is the starting policy, bit for bit
    from safetensors.torch import load_file

    run = next(r for r in res["runs"] if r["variant"] == "sao_rollout_only")
    start = load_file(next((tmp_path / "cache").glob("tiny-*/model.safetensors")))
    final = load_file(tmp_path / run["run_dir"] / "checkpoints" / "final" / "actor" / "model.safetensors")
    assert start.keys() == final.keys() and all(torch.equal(start[k], final[k]) for k in start)
    # ...and it is neither a training run at equal wall-clock nor one that can reach a target
    assert "sao_rollout_only" not in res["accuracy_at_equal_wall"]
    assert "accuracy_at_equal_wall" in res and (out / "curves.png").stat().st_size > 10_000
    md = (out / "results.md").read_text()
    assert "| `grpo_async` |" in md and "sao train" in md
    # every variant's final accuracy with its interval over the held-out games (evals/ of each run), in the
    # table too; grpo_sync is compared with sao_sync paired (same settings, algo.name=sao)
    for v in res["variants"].values():
        c = v["final_accuracy_ci95"]
        assert c["ci95"][0] <= c["mean"] <= c["ci95"][1] and c["seeds"] == 1
    assert res["paired_vs_reference"]["grpo_sync"]["reference"] == "sao_sync"
    assert "final, mean [95% CI]" in md and "Paired against the same settings with SAO" in md
    # the same folder again (an interrupted bench, or a changed analysis): finished runs are reused, not re-run
    from sao.bench.run import _previous_records, finished_run

    root = next((tmp_path / "runs" / "bench").iterdir())
    proc = _sao("bench", "wallclock", "--quick", "--out", "out2", "--runs", str(root.relative_to(tmp_path)),
                "model.cache_dir=cache", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("already, reused") == 5
    again = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert again["variants"] == res["variants"] and [r["process_s"] for r in again["runs"]] == [
        r["process_s"] for r in res["runs"]]
    # other settings on the same folder: that run is trained again
    exp = load_experiment("wallclock").preset(quick=True)
    rel = root.relative_to(tmp_path)
    monkeypatch.chdir(tmp_path)  # the recorded commands name the folder relative to where the bench ran
    prev = _previous_records(rel, Path("out"))
    assert finished_run(exp, "sao", 0, rel, ["model.cache_dir=cache"], 6, prev) is not None
    assert finished_run(exp, "sao", 0, rel, ["model.cache_dir=cache", "train.lr=1e-3"], 6, prev) is None


@pytest.mark.slow
def test_a_bench_killed_mid_run_runs_that_run_again_and_keeps_the_partial_one(tmp_path):
    """Reproduction: a bench killed while a run trains left `v-s0/` without a summary, and the
    next `sao bench` on the same folder failed that run with "run directory ... exists already"."""
    import os
    import signal
    import time

    exp = tmp_path / "tiny.yaml"
    exp.write_text(
        "overrides: [model.hidden_size=32, model.num_layers=1, model.num_heads=2, model.intermediate_size=64,\n"
        "            sft.steps=5, sft.batch_size=4, train.steps=6, train.batch_size=4, critic.warmup_steps=1,\n"
        "            rollout.max_turns=2, rollout.max_action_tokens=8, eval.every=0, eval.num_tasks=4,\n"
        "            env.options.step_latency_s=1.0, env.options.step_latency_sigma=0, runtime.issue_ahead=0,\n"
        "            model.cache_dir=cache]\n"
        "variants:\n  sao: [algo.name=sao]\n")
    cmd = [sys.executable, "-m", "sao.cli", "bench", str(exp), "--out", "out", "--runs", "r"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = tmp_path / "r" / "sao-s0" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and '"reward/mean"' in metrics.read_text()) and proc.poll() is None:
        assert time.time() < deadline, "the run never reached its first step"
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the bench and its `sao train` child, mid-run
    proc.wait()
    assert not (tmp_path / "r" / "sao-s0" / "summary.json").exists()
    partial = metrics.read_text()

    again = _sao("bench", str(exp), "--out", "out", "--runs", "r", cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "moved to sao-s0.interrupted-" in again.stdout
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["returncode"] for r in res["runs"]] == [0]
    assert res["variants"]["sao"]["per_seed"]["0"]["steps_done"] == 6
    # the killed run is kept as it was, its log beside it
    aside = [p for p in (tmp_path / "r").iterdir() if p.name.startswith("sao-s0.interrupted-")]
    assert sorted(p.suffix == ".log" for p in aside) == [False, True]
    kept = next(p for p in aside if p.is_dir())
    assert (kept / "metrics.jsonl").read_text() == partial
    # a third bench on the folder reuses the finished run and leaves the set-aside one alone
    third = _sao("bench", str(exp), "--out", "out", "--runs", "r", cwd=tmp_path, timeout=300)
    assert third.returncode == 0 and third.stdout.count("already, reused") == 1, third.stdout[-2000:]
    # main also let a bench whose run failed exit 0, the failure visible only in results.json: now it exits 1,
    # says which run failed, and results.md lists it (a real failure: the model folder does not exist)
    bad = _sao("bench", str(exp), "--out", "out-bad", "--runs", "r-bad", "model.path=missing-model", cwd=tmp_path,
               timeout=300)
    assert bad.returncode == 1 and "1 of 1 runs failed: sao seed 0 (exit 2" in bad.stdout, bad.stdout[-2000:]
    assert "- `sao` seed 0: exit 2: sao: error: model.path:" in (tmp_path / "out-bad" / "results.md").read_text()
    assert "Traceback" not in bad.stderr and "Warning" not in bad.stderr, bad.stderr[-2000:]
