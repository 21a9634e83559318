"""The online-learning environment: the rewarded style switches with the trainer's step."""

import random

import pytest

from sao.envs import make_environment
from sao.envs.base import EpisodeContext


def _episode(env, step, task):
    ep = env.new_episode(EpisodeContext(policy_version=0, trainer_step=step))
    return ep, ep.reset(task)


def test_reward_follows_the_phase_of_the_trainer_step():
    env = make_environment("style_shift", {}, seed=0)
    task = env.eval_tasks(1)[0]
    a, b = map(int, task.prompt.split("+"))
    action = f"<style>cute</style><answer>{a + b}</answer>"
    ep, msgs = _episode(env, 0, task)
    assert msgs[0]["content"].startswith("styles: ") and msgs[0]["content"].endswith(task.prompt)
    r = ep.step(action)
    assert r.done and r.reward == 1.0 and r.info["chose_cute"] == 1.0
    ep, _ = _episode(env, 100, task)  # phase 2 rewards chuuni
    assert ep.step(action).reward == 0.0
    assert ep.step(f"<style>chuuni</style><answer>{a + b}</answer>").reward == 1.0
    assert ep.step(f"<style>chuuni</style><answer>{a + b + 1}</answer>").reward == 0.0  # wrong answer


def test_candidates_change_between_phases():
    env = make_environment("style_shift", {}, seed=0)
    task = env.eval_tasks(1)[0]
    early = _episode(env, 0, task)[1][0]["content"].splitlines()[0].split()[1:]
    late = _episode(env, 250, task)[1][0]["content"].splitlines()[0].split()[1:]
    assert sorted(early) == ["chuuni", "classical", "cute", "plain"]
    assert sorted(late) == ["classical", "formal", "pirate", "plain"]


def test_custom_schedule_and_validation():
    phases = [{"start": 0, "rewarded": "plain", "candidates": ["plain", "cute"]},
              {"start": 5, "rewarded": "cute", "candidates": ["plain", "cute"]}]
    env = make_environment("style_shift", {"phases": phases}, seed=1)
    assert env.options.phase_at(4).rewarded == "plain" and env.options.phase_at(5).rewarded == "cute"
    with pytest.raises(ValueError, match="env.options"):
        make_environment("style_shift", {"phases": [{"start": 3, "rewarded": "cute", "candidates": ["cute", "plain"]}]}, 0)
    with pytest.raises(ValueError, match="not among the candidates"):
        make_environment("style_shift", {"phases": [{"start": 0, "rewarded": "x", "candidates": ["cute", "plain"]}]}, 0)


def test_demos_pick_a_listed_style_and_answer_correctly():
    env = make_environment("style_shift", {}, seed=0)
    rng = random.Random(0)
    tasks = env.train_tasks()
    for _ in range(20):
        task = next(tasks)
        user, reply = env.demo(task, rng)
        listed = user["content"].splitlines()[0].split()[1:]
        style = reply["content"].split("<style>")[1].split("</style>")[0]
        assert style in listed and reply["content"].endswith(f"<answer>{task.answer}</answer>")
    held = {t.prompt for t in env.eval_tasks(50)}
    assert not held & {next(tasks).prompt for _ in range(500)}


def _benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "style_shift.py"
    spec = importlib.util.spec_from_file_location("style_shift_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_recovery_is_measured_against_an_absolute_reward():
    bench = _benchmark()
    # phase 0 (steps 1-10) at 1.0; phase 1 (11-30) at 0 for 5 steps, then 1.0; phase 2 (31-40) stays at 0
    steps = list(range(1, 41))
    rewards = [1.0] * 10 + [0.0] * 5 + [1.0] * 15 + [0.0] * 10
    fig = bench.phase_figures(steps, rewards, [0, 11, 31], 40, recover_at=0.8, window=4)
    # the 4-step mean first reaches 0.8 at step 19 (rewards of steps 16-19 are all 1): 19 - 11 = 8
    assert fig["steps_to_recover"] == [8, None]
    # stable reward = mean of each phase's last quarter: phase 1's last 5 steps are all 1.0
    assert fig["stable_reward"] == [1.0, 1.0, 0.0]
    # a phase that stayed at zero reward does not hide the recovery after it
    rewards = [1.0] * 10 + [0.0] * 20 + [1.0] * 10
    assert bench.phase_figures(steps, rewards, [0, 11, 31], 40, window=4)["steps_to_recover"] == [None, 3]


def test_benchmark_median_counts_unrecovered_runs_as_slowest():
    bench = _benchmark()
    assert bench.median_or_none([30, None, 10]) == 30.0
    assert bench.median_or_none([None, None, 10]) is None
    assert bench.median_or_none([4, 8]) == 4.0  # lower median of an even count


def test_style_shift_recipe_sets_a_smaller_actor_lr_unless_the_user_overrides_it():
    from pathlib import Path

    from sao.config import load_config
    from sao.runtime.preflight import preflight

    recipe = Path(__file__).resolve().parents[1] / "examples" / "configs" / "style_shift.yaml"
    cfg = load_config(recipe)
    preflight(cfg)
    assert cfg.env.name == "style_shift" and cfg.train.lr == 2e-4
    cfg = load_config(recipe, ["train.lr=5e-4"])
    preflight(cfg)
    assert cfg.train.lr == 5e-4


def test_a_split_with_an_empty_side_is_an_error_naming_the_option_not_a_hang():
    from sao.config import load_config
    from sao.runtime.preflight import preflight

    # four sums (0..1 + 0..1), none of which data_seed 2 holds out at the default fraction
    cfg = load_config(None, ["env.name=style_shift", "env.options.max_operand=1", "env.options.data_seed=2"])
    with pytest.raises(ValueError, match=r"^env\.options\.heldout_fraction: no held-out task in \d+ draws"):
        preflight(cfg)


def test_held_out_sums_do_not_depend_on_the_training_seed():
    a, b = make_environment("style_shift", {}, seed=0), make_environment("style_shift", {}, seed=5)
    held = [t.prompt for t in a.eval_tasks(50)]
    assert held == [t.prompt for t in b.eval_tasks(50)]
    train = b.train_tasks()
    assert not {next(train).prompt for _ in range(500)} & set(held)


def test_the_old_name_of_the_episode_contexts_step_still_reads():
    """EpisodeContext.trainer_step was called trainer_version (it counts steps, not policy versions);
    environments written against the old name keep working."""
    assert EpisodeContext(trainer_step=7).trainer_version == 7
