"""env.name=textworld_express (sao/envs/textworld_express_env.py): TextWorldExpress games on the package's own
Java engine. sao's demonstrations are shortest and the same in every process; held-out games (test fold)
never equal a training game; an episode plays the numbered commands to a win; `sao train` runs on it."""

import itertools
import json
import random
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("textworld_express", reason="the textworld extra is not installed (pip install 'sao[textworld]')")
if shutil.which("java") is None:
    pytest.skip("textworld-express runs its engine on a JVM: no `java` here", allow_module_level=True)

from sao.envs import make_environment  # noqa: E402
from sao.envs.textworld_express_env import (  # noqa: E402
    TextWorldExpressOptions,
    _engine,
    _release,
    _replay,
    commands,
)

OPTIONS = {"game_params": "numLocations=5,includeDoors=0,numDistractorItems=0", "num_train_games": 6,
           "num_heldout_games": 6}

PATHS = """
import json, sys
from sao.envs.textworld_express_env import TextWorldExpressOptions, _engine, shortest_path
options = TextWorldExpressOptions(game_params="numLocations=5,includeDoors=0,numDistractorItems=0")
engine = _engine()
print(json.dumps([shortest_path(engine, options, "train", seed) for seed in range(int(sys.argv[1]))]))
"""


def test_demonstrations_are_shortest_and_the_same_in_every_process():
    """Two fresh processes find the same paths (the engine's valid actions come in a per-process order); each
    wins when replayed, none is longer than the engine's gold path without its idle commands, and no shorter
    command sequence wins (every one tried)."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", PATHS, "6"], capture_output=True, text=True,
                                      timeout=300, check=True).stdout) for _ in range(2)]
    assert runs[0] == runs[1] and all(runs[0])
    options = TextWorldExpressOptions(**{k: v for k, v in OPTIONS.items() if k == "game_params"})
    engine = _engine()
    try:
        for seed, path in enumerate(runs[0]):
            assert _replay(engine, options, "train", seed, tuple(path))[1]["tasksuccess"]
            engine.reset(seed=seed, gameFold="train", gameName="coin", gameParams=options.game_params,
                         generateGoldPath=True)
            gold = [a for a in engine.getGoldActionSequence() if a not in ("look around", "inventory")]
            assert len(path) <= len(gold), (seed, path, gold)
            if len(path) <= 3:  # every shorter sequence of the commands offered on the way loses
                for n in range(1, len(path)):
                    assert not _wins_in(engine, options, seed, n), (seed, n)
    finally:
        _release(engine)


def _wins_in(engine, options, seed: int, n: int) -> bool:
    """Whether any sequence of n offered commands wins game `seed` (exhaustive, for small n)."""
    def grow(prefix: tuple) -> bool:
        _, infos = _replay(engine, options, "train", seed, prefix)
        if infos["tasksuccess"]:
            return True
        if len(prefix) == n or infos["taskfailure"]:
            return False
        return any(grow(prefix + (a,)) for a in commands(infos))
    return grow(())


def test_held_out_games_never_equal_training_games_and_episodes_play_to_a_win(tmp_path, capsys):
    env = make_environment("textworld_express", {**OPTIONS, "solution_length": 3, "cache_dir": str(tmp_path)}, seed=0)
    assert len(env.train) == 6 and len(env.heldout) == 6
    assert {t.meta["fold"] for t in env.train} == {"train"} and {t.meta["fold"] for t in env.heldout} == {"test"}
    train_prompts = {t.prompt for t in env.train}
    assert not train_prompts & {t.prompt for t in env.heldout}  # what the model sees first differs, every game
    assert not {t.meta["fingerprint"] for t in env.train} & {t.meta["fingerprint"] for t in env.heldout}
    assert all(len(t.meta["path"]) == 3 for t in env.train + env.heldout)
    with pytest.raises(ValueError, match="held-out"):
        env.demo(env.heldout[0], random.Random(0))
    for task in env.train[:3]:
        demo = env.demo(task, random.Random(0))
        answers = [m["content"] for m in demo if m["role"] == "assistant"]
        assert all(a.isdigit() for a in answers) and len(answers) == 3
        episode = env.new_episode(None)
        assert episode.reset(task)[0]["content"] == task.prompt
        bad = episode.step("fly away")
        assert bad.observation.startswith("(invalid)") and not bad.done and bad.info["invalid_commands"] == 1
        results = [episode.step(a) for a in answers]
        episode.close()
        assert [r.done for r in results] == [False, False, True] and results[-1].reward == 1.0
        assert [m["content"] for m in demo if m["role"] == "tool"] == [r.observation for r in results[:-1]]
    err = capsys.readouterr().err  # the search said what it did (minutes for thousands of games)
    assert f"prepared 12 textworld-express games into {tmp_path}" in err
    # the same settings again: read from the cache, the same games, nothing said
    again = make_environment("textworld_express", {**OPTIONS, "solution_length": 3, "cache_dir": str(tmp_path)}, seed=0)
    assert capsys.readouterr().err == ""
    assert [t.id for t in again.train + again.heldout] == [t.id for t in env.train + env.heldout]
    assert len(list(tmp_path.glob("textworld-express-*.json"))) == 1


def test_parameters_the_engine_refuses_are_one_line(tmp_path, sao_cli):
    for option, said in (("env.options.game=chess", "env.options.game: 'chess' is not a TextWorldExpress game"),
                         ("env.options.game_params=numLocations=99", "cannot make coin games with 'numLocations=99': "
                                                                     "Number of locations must be less than or equal to 11")):
        proc = sao_cli("train", "env.name=textworld_express", option, f"env.options.cache_dir={tmp_path}", "--quiet",
                       cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert said in proc.stderr, proc.stderr


def test_a_length_no_game_has_is_one_line(tmp_path, sao_cli):
    proc = sao_cli("train", "env.name=textworld_express", "env.options.solution_length=40",
                   "env.options.max_search_states=3", "env.options.num_train_games=1",
                   f"env.options.cache_dir={tmp_path}", "--quiet", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "among the first 64 games of the train fold of coin" in proc.stderr
    assert "0 have a shortest solution of 40 commands" in proc.stderr


@pytest.mark.slow
def test_sao_train_on_textworld_express(tmp_path):
    args = ["env.name=textworld_express", "env.options.num_train_games=8", "env.options.num_heldout_games=4",
            "env.options.solution_length=2", f"env.options.cache_dir={tmp_path / 'cache'}",
            "env.options.observation_chars=120", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
            "model.intermediate_size=64", "model.max_positions=1024", "rollout.max_episode_tokens=1000",
            "rollout.max_turns=4", "rollout.max_action_tokens=4", "sft.steps=10", "sft.batch_size=4",
            "train.steps=2", "train.batch_size=4", "critic.warmup_steps=1", "eval.num_tasks=4", "eval.every=0",
            "output.trajectories_every=1", "output.root=runs", "output.name=twx"]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for f in sorted((tmp_path / "runs" / "twx" / "trajectories").glob("step_*.jsonl"))
            for line in f.read_text().splitlines()]
    assert rows and all(r["status"] in ("ok", "truncated") for r in rows), [r["status_reason"] for r in rows]
    assert all(r["reward"] in (0.0, 1.0) for r in rows)
    assert set(itertools.chain.from_iterable([r["task_id"].split("-")[1]] for r in rows)) == {"train"}
