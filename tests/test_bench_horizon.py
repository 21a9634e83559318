"""`sao bench horizon`: the experiment's variants (SAO, GRPO+DIS and the three single-rollout rivals x three
quest lengths, 3 seeds, 128 held-out games per evaluation), and its quick preset run end to end on real
TextWorld games, writing every file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sao.bench.experiment import load_experiment


def test_horizon_experiment_covers_every_algorithm_and_quest_length():
    exp = load_experiment("horizon")
    length = {name: next(o for o in v if "quest_length=" in o).split("=")[1] for name, v in exp.variants.items()}
    algo = {name: next(o for o in v if o.startswith("algo.name=")).split("=")[1] for name, v in exp.variants.items()}
    for q in ("2", "5", "10"):
        assert {a for n, a in algo.items() if length[n] == q} == {"sao", "grpo_dis", "sppo", "crf_ntf", "pact"}
    assert "env.options.rewards=sparse" in exp.overrides and "runtime.max_lag=3" in exp.overrides
    assert any(o.startswith("env.options.step_latency_s=") for o in exp.overrides)
    # statistics that separate: 3 seeds per arm, 128 held-out games per evaluation (and that many games exist)
    assert len(exp.seeds) >= 3 and "eval.num_tasks=128" in exp.overrides
    assert "env.options.num_heldout_games=128" in exp.overrides
    # the setting whose starting policy wins at every length (benchmarks/results/horizon/start.md)
    assert {"env.options.goal=steps", "model.tokenizer=bpe"} <= set(exp.overrides)
    assert any(o.startswith("env.options.sft_games=") for o in exp.overrides)  # RL plays games the SFT never saw
    turns = {name: int(next(o for o in v if o.startswith("rollout.max_turns=")).split("=")[1])
             for name, v in exp.variants.items()}
    assert all(turns[n] == 2 * int(length[n]) for n in exp.variants)  # twice the shortest solution
    quick = exp.preset(quick=True)
    assert set(quick.variants) < set(exp.variants) and {algo[n] for n in quick.variants} == set(algo.values())
    assert quick.seeds == [0]
    # the full preset's longer quests take fewer steps (each costs more); the quick preset's sizing wins over that
    from sao.bench.run import total_steps

    assert [total_steps(exp, [], f"q{q}-sao") for q in (2, 5, 10)] == [40, 25, 15]
    assert {total_steps(quick, [], n) for n in quick.variants} == {3}
    assert exp.analysis["groups"] == ["q2-", "q5-", "q10-"]


@pytest.mark.slow
def test_horizon_quick_preset_writes_every_file(tmp_path):
    pytest.importorskip("textworld")
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "bench", "horizon", "--quick", "--out", "out",
                           "model.cache_dir=cache", "env.options.cache_dir=cache"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "curves.png"}
    res = json.loads((out / "results.json").read_text())
    quick = load_experiment("horizon").preset(quick=True)
    assert list(res["variants"]) == list(quick.variants)
    assert all(r["returncode"] == 0 for r in res["runs"]) and len(res["runs"]) == len(quick.variants)
    for v in res["variants"].values():
        s = v["per_seed"]["0"]
        assert s["steps_done"] == 3 and s["final_accuracy"] is not None and s["lag_mean"] is not None
    assert set(res["accuracy_at_equal_wall"]) == set(quick.variants)
    groups = res["equal_wall_by_group"]  # equal wall-clock within a quest length
    assert set(groups) == {"q2-", "q10-"} and set(groups["q10-"]["accuracy"]) == {"q10-sao"}
    assert groups["q2-"]["wall_s"] == min(v["per_seed"]["0"]["train_wall_s"] for n, v in res["variants"].items()
                                          if n.startswith("q2-"))
    # the games were generated once per setting and cached; the runs played them with the latency on
    assert len(list((tmp_path / "cache").glob("textworld-*/games.json"))) == 2  # q2, q10
    run = tmp_path / next(r["run_dir"] for r in res["runs"] if r["variant"] == "q10-sao")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["env"]["options"]["quest_length"], cfg["rollout"]["max_turns"]) == (10, 20)
    assert any((run / "trajectories").iterdir())
    assert "| `q2-pact` |" in (out / "results.md").read_text()
    # a bench cut short: --finished-only writes the results of what finished and starts no run
    root = str(Path(res["runs"][0]["run_dir"]).parent)  # as the bench wrote it: part of each run's command
    runs = tmp_path / root
    (runs / "q2-grpo_dis-s0" / "summary.json").unlink()  # as if it had been stopped mid-run
    again = subprocess.run([sys.executable, "-m", "sao.cli", "bench", "horizon", "--quick", "--out", "out2", "--runs",
                            root, "--finished-only", "model.cache_dir=cache", "env.options.cache_dir=cache"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "q2-grpo_dis seed 0: not finished" in again.stdout
    assert not (runs / "q2-grpo_dis-s0" / "summary.json").exists()  # not run again
    res2 = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert [r["variant"] for r in res2["runs"]] == [n for n in quick.variants if n != "q2-grpo_dis"]
    assert res2["variants"]["q2-sao"] == res["variants"]["q2-sao"]
    bad = subprocess.run([sys.executable, "-m", "sao.cli", "bench", "horizon", "--finished-only"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--runs" in bad.stderr and "Traceback" not in bad.stderr
