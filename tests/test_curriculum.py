"""`env.options.curriculum` (sao/envs/curriculum.py): env.options that change on a schedule of training steps,
for any environment; a stage per draw number (so resume draws the same), episodes on their task's stage."""

import asyncio
import json
import random
import re
import subprocess
import sys

import pytest

from sao.envs import make_environment
from sao.envs.base import EpisodeContext
from sao.rollout.env_calls import open_episode

STAGES = [{"start": 0, "ops": "+"}, {"start": 2, "ops": "*"}, {"start": 4, "ops": "-", "max_ops": 1}]


def _ops(prompt: str) -> set[str]:
    return {c for c in prompt.split("\n")[-1] if c in "+-*"}


def test_the_stage_follows_the_training_step_of_each_draw():
    env = make_environment("calc", {"curriculum": STAGES}, seed=0)
    env.tasks_per_step = 4  # train.batch_size=4: draws 0-3 are step 0's, 4-7 step 1's, ...
    stream = env.train_tasks()
    drawn = [next(stream) for _ in range(24)]  # steps 0..5
    stages = [t.meta["curriculum_stage"] for t in drawn]
    assert stages == [0] * 8 + [1] * 8 + [2] * 8
    assert all(_ops(t.prompt) == {"+"} for t in drawn[:8])
    assert all(_ops(t.prompt) == {"*"} for t in drawn[8:16])
    assert all(_ops(t.prompt) == {"-"} for t in drawn[16:])
    # a resumed run replays the cursor: the same tasks in the same order
    again = make_environment("calc", {"curriculum": STAGES}, seed=0)
    again.tasks_per_step = 4
    stream = again.train_tasks()
    assert [next(stream).prompt for _ in range(24)] == [t.prompt for t in drawn]


def test_sft_rotates_the_stages_and_evaluation_uses_the_last():
    env = make_environment("calc", {"curriculum": STAGES}, seed=0)
    stream = env.train_tasks()  # no tasks_per_step: the SFT warm start's draws
    assert [next(stream).meta["curriculum_stage"] for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    held = env.eval_tasks(8)
    assert held and all(_ops(t.prompt) == {"-"} and t.meta["curriculum_stage"] == 2 for t in held)
    task = next(stream)
    demo = env.demo(task, random.Random(0))  # the demo of the task's own stage
    assert demo is not None


def test_an_episode_opens_on_its_tasks_stage():
    env = make_environment("calc", {"curriculum": STAGES}, seed=0)
    env.tasks_per_step = 1
    stream = env.train_tasks()
    plus = next(stream)  # stage 0, though it runs when the run is at a later step
    episode = open_episode(env, EpisodeContext(trainer_step=9), plus)
    assert episode.__class__ is env.environments[0].new_episode(EpisodeContext()).__class__
    a, op, b = plus.prompt.split("\n")[-1].partition("+")
    messages = episode.reset(plus)
    assert messages[-1]["content"] == plus.prompt
    result = asyncio.run(episode.step(f"<answer>{plus.answer}</answer>")) if asyncio.iscoroutinefunction(episode.step) \
        else episode.step(f"<answer>{plus.answer}</answer>")
    assert result.done and result.reward == 1.0


def test_textworld_quest_length_on_schedule_and_heldout_apart(tmp_path):
    pytest.importorskip("textworld")
    small = {"num_train_games": 3, "num_heldout_games": 2, "world_size": 3, "nb_objects": 4,
             "cache_dir": str(tmp_path / "cache")}
    env = make_environment("textworld", {**small, "curriculum": [{"start": 0, "quest_length": 1},
                                                                  {"start": 1, "quest_length": 3}]}, seed=0)
    env.tasks_per_step = 2
    stream = env.train_tasks()
    drawn = [next(stream) for _ in range(6)]
    lengths = [len(t.meta["walkthrough"]) for t in drawn]
    assert lengths[:2] == [1, 1] and lengths[2:] == [3, 3, 3, 3]
    train = {t.meta["fingerprint"] for e in env.environments for t in e.train}
    assert not train & {t.meta["fingerprint"] for t in env.eval_tasks(2)}


@pytest.mark.parametrize("stages, words", [
    ([{"start": 1, "ops": "+"}], "env.options.curriculum[0].start: stages start at step 0"),
    ([{"start": 0}, {"start": 0, "ops": "*"}], "env.options.curriculum[1].start: stages start at step 0 and at increasing"),
    ([{"start": 0}, {"start": 3, "max_ops": 99}], "env.options.curriculum[1].max_ops:"),
    ([{"start": 0, "opps": "+"}], "env.options.curriculum[0].opps: unknown key"),
    ("+", "env.options.curriculum: expected a non-empty list"),
])
def test_bad_stages_are_one_line_errors(stages, words):
    with pytest.raises(ValueError, match="^" + words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        make_environment("calc", {"curriculum": stages}, seed=0)


def test_sao_train_with_a_curriculum(tmp_path):
    """The real CLI, async: step 1's batch comes from stage 0, the last step's from stage 1, and a bad stage
    is refused in one line before anything is written."""
    from conftest import TINY

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"env": {"name": "calc", "options": {"curriculum": [
        {"start": 0, "ops": "+", "max_ops": 1}, {"start": 3, "ops": "*", "max_ops": 1}]}}}))
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", str(cfg), *TINY, "train.steps=4",
                           "runtime.max_lag=0", "output.trajectories_every=1", "output.name=c", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traj = tmp_path / "runs" / "c" / "trajectories"

    def problems(step):
        text = (traj / f"step_{step:06d}.txt").read_text()
        return re.findall(r"\[PROMPT\] <\|im_start\|>user\n(.*?)<\|im_end\|>", text)

    assert problems(1) and all("+" in p and "*" not in p for p in problems(1))
    assert problems(4) and all("*" in p and "+" not in p for p in problems(4))
    bad = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "env.options.curriculum=[{start: 2}]",
                          "output.name=bad"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == ("sao: error: env.options.curriculum[0].start: stages start at "
                                                   "step 0 and at increasing steps (got 2)")
    assert not (tmp_path / "runs" / "bad").exists()
