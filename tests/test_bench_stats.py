"""Intervals in `sao bench` (sao/bench/analysis.py): the two-level bootstrap over held-out games and seeds,
the paired comparison against SAO on the same games, and the per-game results a run writes (evals/)."""

import json
import random

import pytest

from sao.bench.analysis import bootstrap, final_games, paired_differences, start_games
from sao.bench.experiment import Experiment
from sao.bench.report import intervals, reference_of
from sao.runtime.run_dir import RunDir
from sao.types import Status, Trajectory


def _games(p: float, n: int, rng: random.Random) -> list[float]:
    return [float(rng.random() < p) for _ in range(n)]


def test_bootstrap_is_deterministic_and_covers_the_mean():
    rng = random.Random(0)
    seeds = [_games(0.5, 128, rng) for _ in range(3)]
    a, b = bootstrap(seeds), bootstrap(seeds)
    assert a == b  # seeded
    mean, lo, hi = a
    assert lo < mean < hi and lo < 0.5 < hi
    assert 0.05 < hi - lo < 0.25  # ~0.1 from the games alone; the seed level adds to it
    assert bootstrap([[1.0] * 10, [1.0] * 10]) == (1.0, 1.0, 1.0)
    assert bootstrap([]) is None


def test_paired_differences_separate_what_unpaired_intervals_cannot():
    """Arm B solves the games arm A solves plus ~8% more: its unpaired interval overlaps A's, the paired
    interval of B - A excludes 0."""
    rng = random.Random(1)
    runs_a, runs_b = {}, {}
    for seed in range(3):
        a = {f"g{i}": float(rng.random() < 0.5) for i in range(128)}
        b = {k: 1.0 if v == 1.0 or rng.random() < 0.16 else 0.0 for k, v in a.items()}
        runs_a[seed], runs_b[seed] = {"final_games": a}, {"final_games": b}
    ua = bootstrap([list(r["final_games"].values()) for r in runs_a.values()])
    ub = bootstrap([list(r["final_games"].values()) for r in runs_b.values()])
    assert ub[1] < ua[2]  # the unpaired intervals overlap
    diff, lo, hi = bootstrap(paired_differences(runs_b, runs_a))
    assert lo > 0 and diff == pytest.approx(ub[0] - ua[0])


def test_the_reference_is_the_same_settings_with_sao():
    exp = Experiment(name="x", description="", config=None, overrides=[], seeds=[0], analysis={}, variants={
        "q2-sao": ["algo.name=sao", "env.options.quest_length=2"],
        "q2-grpo": ["algo.name=grpo", "env.options.quest_length=2"],
        "q5-grpo": ["algo.name=grpo", "env.options.quest_length=5"],
        "q2-sao-dense": ["algo.name=sao", "env.options.quest_length=2", "env.options.rewards=dense"],
        "q2-grpo-dense": ["env.options.rewards=dense", "algo.name=grpo", "env.options.quest_length=2"]})
    assert reference_of(exp, "q2-grpo") == "q2-sao"
    assert reference_of(exp, "q2-grpo-dense") == "q2-sao-dense"
    assert reference_of(exp, "q5-grpo") is None and reference_of(exp, "q2-sao") is None
    runs = {"q2-sao": {0: {"final_games": {"a": 1.0, "b": 0.0}}}, "q2-grpo": {0: {"final_games": {"a": 0.0, "b": 0.0}}}}
    ci, paired = intervals(exp, runs)
    assert ci["q2-sao"]["mean"] == 0.5 and paired["q2-grpo"]["reference"] == "q2-sao"
    assert paired["q2-grpo"]["diff"] == -0.5


def test_the_gain_over_the_start_is_paired_per_game():
    """Training that wins 2 more of 4 games on seed 0 and loses 1 on seed 1: the gain is the mean over seeds
    of the per-game differences, its interval from the same bootstrap; a run without a start has none."""
    exp = Experiment(name="x", description="", config=None, overrides=[], seeds=[0, 1], analysis={},
                     variants={"sao": ["algo.name=sao"]})
    runs = {"sao": {0: {"start_games": {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0},
                        "final_games": {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0}},
                    1: {"start_games": {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0},
                        "final_games": {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0}}}}
    ci, _ = intervals(exp, runs)
    assert ci["sao"]["start"]["mean"] == pytest.approx((0.25 + 0.5) / 2)
    assert ci["sao"]["gain"]["mean"] == pytest.approx((2 / 4 - 1 / 4) / 2)  # +0.125
    assert bootstrap([[1.0, 1.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0]])[1:] == tuple(ci["sao"]["gain"]["ci95"])
    assert ci["sao"]["gain"]["outside_noise"] is False  # 4 games: the interval spans 0
    del runs["sao"][0]["start_games"], runs["sao"][1]["start_games"]
    assert "gain" not in intervals(exp, runs)[0]["sao"]


def test_a_run_writes_every_held_out_game(tmp_path):
    run = RunDir(tmp_path)
    trajs = [Trajectory(f"t{i}", f"task{i % 3}", [1], [1], [0.0], [0], 0, reward=r, status=s)
             for i, (r, s) in enumerate([(1.0, Status.OK), (0.7, Status.TRUNCATED), (0.0, Status.ENV_ERROR),
                                          (0.0, Status.OK)])]
    run.write_eval_games(50, trajs)
    data = json.loads((tmp_path / "evals" / "step_000050.json").read_text())
    assert [g["score"] for g in data["games"]] == [1.0, 0.0, None, 0.0]  # truncated scores 0; failed: not scored
    assert final_games(tmp_path) == {"task0": 1.0, "task1": 0.0, "task0#3": 0.0}
    assert start_games(tmp_path) is None  # no evaluation at step 0
    run.write_eval_games(0, trajs[:2])
    assert start_games(tmp_path) == {"task0": 1.0, "task1": 0.0} and final_games(tmp_path)["task0#3"] == 0.0
