"""The built-in `calc` environment: tools, rewards, malformed calls, the fixed split, demos."""

import random

import pytest

from sao.envs import make_environment
from sao.envs.calc import CalcError, evaluate, stepwise_calls
from sao.types import Task


def test_calculator_evaluates_integer_arithmetic_only():
    assert evaluate("37*12+5") == 449
    assert evaluate("-(3-10)*2") == 14
    for bad in ("2**10", "__import__('os')", "1/2", "3+", "x", "9" * 70):
        with pytest.raises(CalcError):
            evaluate(bad)


def test_episode_tool_call_then_answer():
    env = make_environment("calc", {}, seed=0).new_episode(None)
    msgs = env.reset(Task("t", "37*12+5", 449))
    assert msgs == [{"role": "user", "content": "37*12+5"}]
    r = env.step("<calc>37*12+5</calc>")
    assert (r.observation, r.done) == ("<result>449</result>", False)
    r = env.step("<answer>449</answer>")
    assert r.done and r.reward == 1.0 and r.info["tool_calls"] == 1


def test_malformed_calls_get_error_observations_not_crashes():
    env = make_environment("calc", {}, seed=0).new_episode(None)
    env.reset(Task("t", "2+2", 4))
    for action in ("<calc>2+</calc>", "<calc>open('x')</calc>", "no tags at all", "<calc>1"):
        r = env.step(action)
        assert not r.done and r.observation.startswith("<result>error")
    r = env.step("<answer>four</answer>")
    assert r.done and r.reward == 0.0


def test_split_is_fixed_by_data_seed_and_disjoint_for_every_train_seed():
    a = make_environment("calc", {}, seed=3)
    b = make_environment("calc", {}, seed=0)  # another train.seed: the same held-out set
    held = a.eval_tasks(200)
    assert [t.prompt for t in held] == [t.prompt for t in b.eval_tasks(200)]
    assert len({t.prompt for t in held}) == 200  # distinct problems
    for env in (a, b):  # no run's training stream (nor the SFT demos, drawn with sft.seed) reaches it
        train = env.train_tasks()
        assert not {next(train).prompt for _ in range(3000)} & {t.prompt for t in held}
    other = make_environment("calc", {"data_seed": 1}, seed=3).eval_tasks(200)
    assert {t.prompt for t in other} != {t.prompt for t in held}


def test_difficulty_knobs_and_option_errors():
    env = make_environment("calc", {"min_digits": 3, "max_digits": 3, "min_ops": 3, "max_ops": 3}, seed=0)
    task = env.eval_tasks(1)[0]
    assert len(task.meta["operands"]) == 4 and all(100 <= x <= 999 for x in task.meta["operands"])
    with pytest.raises(ValueError, match="env.options.max_ops"):
        make_environment("calc", {"max_ops": 0}, seed=0)
    with pytest.raises(ValueError, match="env.options.colour"):
        make_environment("calc", {"colour": 1}, seed=0)


def test_demos_are_solved_episodes():
    env = make_environment("calc", {"demo_tool_rate_hard": 1.0, "demo_calls": "stepwise"}, seed=0)
    task = Task("t", "5+37*12", 449, {"operands": [5, 37, 12], "ops": ["+", "*"], "easy": False})
    msgs = env.demo(task, random.Random(0))
    assert [m["content"] for m in msgs[1:]] == [
        "<calc>37*12</calc>", "<result>444</result>", "<calc>5+444</calc>", "<result>449</result>", "<answer>449</answer>"]
    assert stepwise_calls([2, 3], ["-"]) == [("2-3", -1)]


def test_system_prompt_option_leads_every_episode_and_demo():
    import random

    from sao.envs import make_environment
    from sao.envs.base import EpisodeContext

    env = make_environment("calc", {"system_prompt": "Use <answer> tags."}, seed=0)
    task = next(env.train_tasks())
    messages = env.new_episode(EpisodeContext(0, 0)).reset(task)
    assert messages[0] == {"role": "system", "content": "Use <answer> tags."} and messages[1]["role"] == "user"
    assert env.demo(task, random.Random(0))[0]["role"] == "system"
    plain = make_environment("calc", {}, seed=0)
    assert plain.new_episode(EpisodeContext(0, 0)).reset(task)[0]["role"] == "user"  # default: no system message


def test_accept_untagged_judges_a_plain_reply_by_its_last_integer():
    from sao.envs import make_environment
    from sao.envs.base import EpisodeContext

    env = make_environment("calc", {"accept_untagged": True}, seed=0)
    task = next(env.train_tasks())
    ep = env.new_episode(EpisodeContext(0, 0))
    ep.reset(task)
    res = ep.step(f"The value of {task.prompt} is {task.answer}.")
    assert res.done and res.reward == 1.0
    strict = make_environment("calc", {}, seed=0).new_episode(EpisodeContext(0, 0))
    strict.reset(task)
    assert not strict.step(f"The answer is {task.answer}.").done  # default: tags required, an error observation
