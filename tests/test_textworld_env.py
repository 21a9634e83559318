"""`textworld`: games generated from seeds and cached, a train/held-out split that shares no game, SFT
demos from training games only, and real generated games played through the agent loop."""

import asyncio
import json
import os
import random

import pytest

pytest.importorskip("textworld")

from sao.envs import make_environment  # noqa: E402
from sao.envs.textworld_env import TextWorldOptions, render  # noqa: E402
from sao.envs.textworld_games import fingerprint, generate_game, load_records, prepare_games  # noqa: E402
from sao.rollout.agent_loop import EpisodeLimits, run_episode  # noqa: E402
from sao.types import Generation, SamplingParams, Status  # noqa: E402

SMALL = {"num_train_games": 4, "num_heldout_games": 2, "quest_length": 3, "world_size": 3, "nb_objects": 4}


def _env(tmp_path, **options):
    return make_environment("textworld", {**SMALL, "cache_dir": str(tmp_path / "cache"), **options}, seed=0)


class ScriptedEngine:
    """Replays fixed commands as the model's turns (the agent loop's tokens, masks and statuses stay real)."""

    def __init__(self, codec, turns):
        self.codec, self.turns = codec, list(turns)

    async def generate(self, prompt_ids, params, session=None):
        ids = self.codec.action_ids(self.turns.pop(0))
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop")

    def release(self, session):
        pass


def _play(environment, task, codec, commands, max_turns):
    engine = ScriptedEngine(codec, commands)
    # scripted commands ignore the budget (a real engine never does): room for the longest walkthrough command
    limits = EpisodeLimits(max_turns=max_turns, max_action_tokens=128, max_episode_tokens=4096)
    return asyncio.run(run_episode(environment.new_episode(None), task, engine, codec, SamplingParams(), limits))


def test_generation_is_deterministic_for_a_seed_and_cached(tmp_path):
    options = TextWorldOptions(**SMALL)
    assert fingerprint(generate_game(options, 5)) == fingerprint(generate_game(options, 5))
    assert fingerprint(generate_game(options, 5)) != fingerprint(generate_game(options, 6))
    a = prepare_games(TextWorldOptions(**SMALL, cache_dir=str(tmp_path / "a")))
    b = prepare_games(TextWorldOptions(**SMALL, cache_dir=str(tmp_path / "b")))
    assert a.name == b.name  # keyed by the settings
    assert json.loads((a / "games.json").read_text()) == json.loads((b / "games.json").read_text())
    for record in load_records(a):  # the game files themselves are the same bytes
        assert (a / record.path.split(a.name + "/")[1]).read_bytes() == (b / record.path.split(b.name + "/")[1]).read_bytes()
    stamp = os.stat(a / "games.json").st_mtime_ns
    assert prepare_games(TextWorldOptions(**SMALL, cache_dir=str(tmp_path / "a"))) == a
    assert os.stat(a / "games.json").st_mtime_ns == stamp  # a hit: nothing generated again
    other = prepare_games(TextWorldOptions(**{**SMALL, "quest_length": 2}, cache_dir=str(tmp_path / "a")))
    assert other != a and not list(tmp_path.glob("a/*.partial-*"))  # other settings, another entry; no leftovers


def test_generation_in_processes_writes_the_same_entry(tmp_path):
    """Thousands of games took 18 min on one core while the other idled: a pool of processes generates them,
    and the entry must be the same bytes as one process writes, duplicates skipped the same way (held-out
    seeds overlapping the training seeds make some)."""
    from sao.envs.textworld_games import _generate_all

    options = TextWorldOptions(**{**SMALL, "num_train_games": 6, "num_heldout_games": 3, "heldout_seed": 3})
    said: list[str] = []
    one = _generate_all(options, tmp_path / "one", log=said.append, workers=1)
    two = _generate_all(options, tmp_path / "two", log=said.append, workers=2)
    assert json.dumps(one) == json.dumps(two)
    assert [r["seed"] for r in two if r["split"] == "heldout"] == [6, 7, 8]  # seeds 3-5 are training games again
    for r in one:
        assert (tmp_path / "one" / r["file"]).read_bytes() == (tmp_path / "two" / r["file"]).read_bytes()
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["heldout", "train"]  # no scratch left
    assert said[-1].endswith("(2 processes)")


def test_generation_in_processes_from_a_script_without_a_main_guard(tmp_path):
    """Reproduction: the first pool (multiprocessing, spawn) re-imported the caller's main module, so a script
    without `if __name__ == "__main__"` (what a user calling sao.train writes) started itself again and failed.
    The workers are plain `python -c` processes now."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import pathlib, sys\n"
                      "from sao.envs.textworld_env import TextWorldOptions\n"
                      "from sao.envs.textworld_games import _generate_all\n"
                      f"options = TextWorldOptions(**{SMALL!r})\n"
                      "rows = _generate_all(options, pathlib.Path(sys.argv[1]), log=print, workers=2)\n"
                      "print('games', len(rows))\n")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "games 6"


def test_generation_says_what_it_does(tmp_path, capsys):
    """Thousands of games take minutes: a miss says so (to the given log, else stderr), a hit says nothing."""
    said: list[str] = []
    options = TextWorldOptions(**SMALL, cache_dir=str(tmp_path))
    entry = prepare_games(options, log=said.append)
    total = options.num_train_games + options.num_heldout_games
    assert said[0] == f"generating TextWorld games into {entry}"
    assert said[-1].startswith(f"generated {total} TextWorld games in ")
    prepare_games(TextWorldOptions(**{**SMALL, "quest_length": 2}, cache_dir=str(tmp_path)))
    err = capsys.readouterr().err
    assert "generating TextWorld games into" in err and f"generated {total} TextWorld games" in err
    prepare_games(options)
    assert capsys.readouterr().err == ""


def test_games_are_the_same_in_every_process(tmp_path):
    """Reproduction: two cold runs of `sao bench horizon` with the same seeds wrote different games.json (and
    so different SFT demos and observations): the states' facts came out of TextWorld's sets in an order that
    follows PYTHONHASHSEED. Each process here has its own hash seed; the files and observations must agree."""
    import subprocess
    import sys

    script = ("import sys; from sao.envs.textworld_env import TextWorldOptions; "
              "from sao.envs.textworld_games import prepare_games; "
              f"prepare_games(TextWorldOptions(**{SMALL!r}, cache_dir=sys.argv[1]))")
    for name, hash_seed in (("x", "1"), ("y", "2")):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], check=True, timeout=300,
                       env={**os.environ, "PYTHONHASHSEED": hash_seed})
    x, y = (next(p for p in (tmp_path / n).glob("textworld-*") if p.is_dir()) for n in "xy")
    assert (x / "games.json").read_bytes() == (y / "games.json").read_bytes()
    options = TextWorldOptions(**SMALL)
    for rx, ry in zip(load_records(x), load_records(y)):
        assert [render(s, options) for s in rx.states] == [render(s, options) for s in ry.states]


def test_train_and_heldout_never_share_a_game(tmp_path):
    # held-out seeds that overlap the training seeds generate training games again: those must be skipped
    env = _env(tmp_path, num_train_games=4, num_heldout_games=3, heldout_seed=2)
    train = {t.meta["fingerprint"] for t in env.train}
    heldout = {t.meta["fingerprint"] for t in env.heldout}
    assert len(train) == 4 and len(heldout) == 3 and not train & heldout
    assert [t.id for t in env.heldout] == ["tw-heldout-4", "tw-heldout-5", "tw-heldout-6"]  # seeds 2, 3 skipped
    assert not {t.prompt for t in env.train} & {t.prompt for t in env.heldout}
    assert {t.id for t in env.eval_tasks(7)} == {t.id for t in env.heldout}
    stream = env.train_tasks()
    assert {next(stream).id for _ in range(30)} == {t.id for t in env.train}


def test_sft_demos_come_from_training_games_only(tmp_path):
    env = _env(tmp_path)
    stream, rng = env.train_tasks(), random.Random(0)  # what the SFT warm start samples (model_setup._build)
    heldout_prompts = {t.prompt for t in env.heldout}
    for _ in range(20):
        task = next(stream)
        demo = env.demo(task, rng)
        assert task.meta["split"] == "train" and demo[0]["content"] not in heldout_prompts
        assert [m["content"] for m in demo if m["role"] == "assistant"] == task.meta["walkthrough"]
    with pytest.raises(ValueError, match="held-out"):
        env.demo(env.heldout[0], rng)


@pytest.mark.parametrize("rewards", ["sparse", "dense"])
def test_walkthrough_wins_a_real_game_through_the_agent_loop(tmp_path, tiny, rewards):
    _, codec = tiny
    env = _env(tmp_path, rewards=rewards)
    for task in env.train[:2] + env.heldout[:1]:
        walk = task.meta["walkthrough"]
        traj = _play(env, task, codec, [w.upper() for w in walk], max_turns=len(walk) + 1)
        assert (traj.status, traj.reward, traj.turns, traj.metrics["won"]) == (Status.OK, 1.0, len(walk), 1.0)
        # the observations the model saw are the ones the SFT demos teach
        if task.meta["split"] == "train":
            demo = env.demo(task, random.Random(0))
            assert codec.tokenizer.decode(traj.token_ids).count(demo[2]["content"]) == 1


def test_turn_limit_truncates_with_partial_credit_only_when_dense(tmp_path, tiny):
    _, codec = tiny
    for rewards, expected in (("sparse", 0.0), ("dense", 1 / 3), ("balanced", None)):
        env = _env(tmp_path, rewards=rewards)
        task = env.train[0]
        walk = task.meta["walkthrough"]
        traj = _play(env, task, codec, ["dance", *walk], max_turns=2)  # an invalid command, then one step
        assert traj.status == Status.TRUNCATED and traj.metrics["invalid_commands"] == 1
        if expected is not None:
            assert traj.reward == pytest.approx(expected)
        assert 0.0 <= traj.reward < 1.0


def test_observation_is_bounded_and_lists_are_cut():
    facts = [["at", ["P", "hall"], ["P", "r"]], *[["at", [f"thing {i}", "hall"], ["o", "r"]] for i in range(20)],
             ["north_of", ["attic", "hall"], ["r", "r"]], ["link", ["hall", "wooden door", "attic"], ["r", "d", "r"]],
             ["closed", ["wooden door"], ["d"]], ["in", ["coin", "I"], ["o", "I"]]]
    text = render(facts, TextWorldOptions(max_items=3, observation_chars=1000))
    assert text == ("at hall. here: thing 0, thing 1, thing 2, +17 more. exits: north (closed wooden door). "
                    "carrying: coin.")
    assert len(render(facts, TextWorldOptions(max_items=50, observation_chars=60))) == 60


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^env\.options\.rewards: "):
        _env(tmp_path, rewards="often")
    with pytest.raises(ValueError, match=r"^env\.options\.quest_length: "):
        _env(tmp_path, quest_length=0)


@pytest.mark.parametrize("commands", ["listed", "numbered"])
def test_commands_are_listed_and_numbered_demos_win(tmp_path, tiny, commands):
    _, codec = tiny
    env = _env(tmp_path, commands=commands)
    for task in env.train[:2]:
        demo = env.demo(task, random.Random(0))
        assert "\ncan: " in demo[0]["content"] and "look" not in demo[0]["content"].split("can: ")[1]
        answers = [m["content"] for m in demo if m["role"] == "assistant"]
        if commands == "numbered":
            assert all(a.isdigit() for a in answers) and "can: 1 " in demo[0]["content"]
        else:
            assert answers == task.meta["walkthrough"]
        # what the demo answers wins the real game through the agent loop, and the observations match
        traj = _play(env, task, codec, answers, max_turns=len(answers))
        assert (traj.status, traj.reward) == (Status.OK, 1.0)
        if len(answers) > 1:
            assert codec.tokenizer.decode(traj.token_ids).count(demo[2]["content"].split("\ncan: ")[1]) == 1
    # a number out of range, or one when commands are only listed, is an invalid command
    ep = env.new_episode(None)
    ep.reset(env.train[0])
    assert ep.step("99").observation.startswith("(invalid) ") and ep.counts["invalid_commands"] == 1


def test_goal_steps_spells_out_the_walkthrough_for_training_and_heldout_games_alike(tmp_path):
    last, steps = _env(tmp_path, commands="numbered"), _env(tmp_path, commands="numbered", goal="steps")
    for a, b in zip(last.train + last.heldout, steps.train + steps.heldout):
        walkthrough = a.meta["walkthrough"]
        assert a.prompt.split("\n")[0] == f"goal: {walkthrough[-1]}"
        assert b.prompt.split("\n")[0] == f"goal: {walkthrough[-1]}. steps: {', '.join(walkthrough)}."
        assert a.prompt.split("\n")[1:] == b.prompt.split("\n")[1:]  # the same game: only the goal line differs
    # the same generated games (the goal is how they are shown, not which): no second generation
    assert last.folder == steps.folder
    demo = steps.demo(steps.train[0], random.Random(0))
    assert demo[0]["content"] == steps.train[0].prompt


def test_sft_games_keeps_the_warm_starts_games_apart_from_rls(tmp_path):
    """An SFT that memorized its games leaves RL reward 1 on every one of them (no signal): with sft_games the
    SFT learns from the first N training games and RL plays only the others."""
    from itertools import islice

    from sao.runtime.model_setup import demo_tasks

    env = _env(tmp_path, sft_games=3)
    sft = {t.id for t in islice(demo_tasks(env), 12)}
    rl = {t.id for t in islice(env.train_tasks(), 12)}
    assert len(sft) == 3 and len(rl) == 1 and not sft & rl
    assert sft | rl == {t.id for t in _env(tmp_path).train}  # together: every training game
    shared = _env(tmp_path)
    assert {t.id for t in islice(demo_tasks(shared), 12)} == {t.id for t in islice(shared.train_tasks(), 12)}
    env.demo(next(iter(env.train)), random.Random(0))  # RL's games still have walkthroughs (the bench's pretraining)
    with pytest.raises(ValueError, match=r"sft_games \(4\) must be below num_train_games \(4\)"):
        _env(tmp_path, sft_games=4)
