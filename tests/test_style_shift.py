"""The online-learning environment: the rewarded style switches with the trainer's step."""

import random

import pytest

from sao.envs import make_environment
from sao.envs.base import EpisodeContext


def _episode(env, step, task):
    ep = env.new_episode(EpisodeContext(policy_version=0, trainer_version=step))
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
