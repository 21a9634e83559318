"""TextWorld games for the `textworld` environment: generated ahead of time from seeds, cached on disk.

Games come from TextWorld's own generator (`textworld.generator.make_game`, what `tw-make custom`
runs) with the world size, number of objects and quest length of `TextWorldOptions`, one game per
seed. Training games use seeds `train_seed, train_seed + 1, ...`, held-out games `heldout_seed, ...`;
a held-out game whose content (initial state and walkthrough) equals a training game's is skipped
for the next seed, so the two sets never share a game even in worlds so small that two seeds
generate the same one.

Reward density (textworld's `tw-simple --rewards` idea on custom games): the quest's walkthrough
is one chain of actions; `dense` adds an optional sub-quest worth one point after every walkthrough
action but the last, `balanced` only after the ones that are not moves (`go ...`), `sparse` none. The
game itself scores them (`GameProgression.score`); the game is won when the main quest is done.

    CACHE/textworld-<key>/games.json         manifest (written last): per game its seed, file,
                                             fingerprint and walkthrough
    CACHE/textworld-<key>/{train,heldout}/<seed>.json   the games (textworld's own JSON format)
    CACHE/textworld-<key>.lock               held (flock) by the one process generating that entry

The key hashes every setting that shapes the games, so two configs that would generate the same
games share an entry. As for the SFT model cache (sao/runtime/model_setup.py), an entry is built by
one process at a time in a folder of its own and renamed into place, so an interrupted generation
leaves nothing half-written.

Games are played with textworld's pure-Python engine for `.json` games (`textworld.envs.tw`), not
compiled to Z-machine files: the same game logic, no Inform 7 compile (~0.2 s a game instead of
3-7 s), and the state facts the compact observation is rendered from (sao/envs/textworld_env.py).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sao.envs.dataset import option_error

GAMES_FORMAT = 2  # bump when generation or the reward sub-quests change (2: facts in sorted order)
# textworld's loading and game logic share module-level state that is not thread-safe (concurrent
# loads failed with "pop from empty list"); the agent loop runs plain env steps in threads, so every
# call into textworld holds this lock (a step takes ~2 ms).
TEXTWORLD_LOCK = threading.RLock()


@dataclass(frozen=True)
class GameRecord:
    """One cached game: where it lies and what the environment needs without loading it."""

    split: str  # "train" or "heldout"
    seed: int
    path: str  # absolute path of the game's JSON file
    fingerprint: str  # sha256 of the initial state facts and the walkthrough
    walkthrough: tuple[str, ...]
    max_score: int
    states: tuple  # the state facts before the first walkthrough command and after each one (see `facts_of`)


def _textworld():
    try:
        import textworld
    except ImportError:
        raise option_error("quest_length", "env.name=textworld needs the textworld package: "
                                           "bash scripts/install.sh test,textworld") from None
    return textworld


def generation_settings(options: Any) -> dict:
    """Every option that shapes the generated games (the cache key is their hash)."""
    keys = ("world_size", "nb_objects", "quest_length", "rewards", "num_train_games", "num_heldout_games",
            "train_seed", "heldout_seed")
    return {"fmt": GAMES_FORMAT, "textworld": _textworld().__version__, **{k: getattr(options, k) for k in keys}}


def settings_key(options: Any) -> str:
    return hashlib.sha256(json.dumps(generation_settings(options), sort_keys=True).encode()).hexdigest()[:16]


def _with_rewards(game, density: str):
    """The game with optional one-point sub-quests along its walkthrough (see the module docstring)."""
    from textworld.generator.game import Event, Game, Quest

    if density == "sparse":
        return game
    main = game.quests[0]
    actions = list(main.win_events[0].actions)
    subs = [Quest(win_events=[Event(actions[: k + 1])], reward=1, optional=True)
            for k, action in enumerate(actions[:-1]) if density == "dense" or not action.name.startswith("go")]
    out = Game(game.world, game.grammar, [main, *subs])
    out.metadata = dict(game.metadata)
    return out


def generate_game(options: Any, seed: int):
    """One game from textworld's generator; deterministic for (options, seed)."""
    textworld = _textworld()
    from textworld.generator import make_game

    opts = textworld.GameOptions()
    opts.seeds = seed
    opts.nb_rooms, opts.nb_objects, opts.quest_length = options.world_size, options.nb_objects, options.quest_length
    return _with_rewards(make_game(opts), options.rewards)


def new_play(path: str, loaded=None):
    """A fresh textworld engine (`textworld.envs.tw.TextWorldEnv`, reset) on a cached game. The game
    and its Inform7 helper come from `load_game` (or `loaded`); the attributes set are the ones its
    `load` sets, without loading the file again."""
    textworld = _textworld()
    from textworld.envs.tw import TextWorldEnv

    play = TextWorldEnv(textworld.EnvInfos(facts=True, won=True, lost=True, score=True, max_score=True,
                                           admissible_commands=True))
    with TEXTWORLD_LOCK:
        play._gamefile = path
        play._game, play._inform7 = loaded or load_game(path)
        play._game_progression = None
        return play, play.reset()


def facts_of(state) -> list[list]:
    """A state's facts as plain data: [predicate, [argument names], [argument types]], sorted. TextWorld
    keeps them in a set, whose order follows the process's string-hash seed: unsorted, the same game
    listed its objects and exits in another order in every process (so cached demos, the SFT model and
    live observations differed between runs of one seed)."""
    return sorted([f.name, [str(v.name) for v in f.arguments], [str(v.type) for v in f.arguments]]
                  for f in state["facts"])


def walkthrough_states(path: str) -> list[list]:
    """The facts before the walkthrough and after each of its commands; the last state must be a win."""
    loaded = load_game.__wrapped__(path)  # not kept: the file is still in its temporary folder
    play, state = new_play(path, loaded)
    states = [facts_of(state)]
    for command in loaded[0].quests[0].commands:
        state, _, _ = play.step(command)
        states.append(facts_of(state))
    if not state["won"]:
        raise RuntimeError(f"textworld game {path}: its walkthrough does not win it")
    return states


def walkthrough_commands(record: GameRecord) -> list[list[str]]:
    """The admissible commands before the walkthrough and after each of its commands (a replay, ~10 ms)."""
    play, state = new_play(record.path)
    out = [list(state["admissible_commands"])]
    with TEXTWORLD_LOCK:
        for command in record.walkthrough[:-1]:
            state, _, _ = play.step(command)
            out.append(list(state["admissible_commands"]))
    return out + [[]]


def fingerprint(game) -> str:
    """A game's identity: its initial facts and its walkthrough (not its seed or uuid)."""
    facts = sorted(str(f) for f in game.world.facts)
    blob = json.dumps({"facts": facts, "walkthrough": list(game.quests[0].commands)})
    return hashlib.sha256(blob.encode()).hexdigest()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _made(options: Any, seed: int, path: str) -> dict:
    """One game generated and saved to `path`, with what the manifest needs."""
    game = generate_game(options, seed)
    game.save(path)
    return {"seed": seed, "fingerprint": fingerprint(game), "walkthrough": list(game.quests[0].commands),
            "max_score": int(game.max_score), "states": walkthrough_states(path)}


POOL_MIN_GAMES = 64  # a worker process takes ~2 s to import textworld: below this, one process is faster
GAME_KEYS = ("world_size", "nb_objects", "quest_length", "rewards")  # what `generate_game` reads


def generation_workers(total: int) -> int:
    """Processes that generate `total` games: every core this process may use (at most 8), one for few games."""
    return 1 if total < POOL_MIN_GAMES else max(1, min(8, len(os.sched_getaffinity(0))))


WORKER = "import sys; from sao.envs.textworld_games import _worker_main; _worker_main(sys.argv[1:])"


class _Worker:
    """A `python -c WORKER` process generating a block of seeds into a scratch folder, one
    JSON row per game on its stdout. A plain subprocess, not multiprocessing: spawn re-imports the caller's
    main module (an unguarded script calling sao.train would start itself again) and fork copies a trainer's
    threads."""

    def __init__(self, options: Any, seeds: list[int], scratch: Path) -> None:
        settings = json.dumps({k: getattr(options, k) for k in GAME_KEYS})
        self.rows: list[dict] = []
        self.err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty worker never blocks on a full one
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, settings, str(scratch), *map(str, seeds)],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.rows.append(json.loads(line))

    def result(self) -> list[dict]:
        self.reader.join()
        if self.proc.wait() != 0:
            self.err.seek(0)
            lines = self.err.read().strip().splitlines() or [f"exit {self.proc.returncode}"]
            raise RuntimeError(f"textworld game generation failed: {lines[-1]}")
        return self.rows

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def _round(options: Any, seeds: range, scratch: Path, workers: int, on_game) -> list[dict]:
    """The rows of these seeds, in seed order: generated here, or by `workers` processes in contiguous blocks."""
    if workers == 1 or len(seeds) < 2 * workers:
        rows = []
        for s in seeds:
            rows.append(_made(options, s, str(scratch / f"{s}.json")))
            on_game(len(rows))
        return rows
    size = -(-len(seeds) // workers)
    procs = [_Worker(options, list(seeds[i:i + size]), scratch) for i in range(0, len(seeds), size)]
    try:
        while any(p.reader.is_alive() for p in procs):
            next(p for p in procs if p.reader.is_alive()).reader.join(timeout=1.0)  # wake up to report progress
            on_game(sum(len(p.rows) for p in procs))
        return sorted((row for p in procs for row in p.result()), key=lambda row: row["seed"])
    finally:
        for p in procs:
            p.kill()


def _generate_all(options: Any, folder: Path, log=_stderr, workers: int | None = None) -> list[dict]:
    """Every game of the entry into `folder`, generated by `workers` processes (default: `generation_workers`);
    a progress line every 30 s (minutes for thousands of games).

    Seeds are tried in rounds of as many seeds as games are still missing, in parallel, and their results
    kept in seed order, so the entry is the same bytes for any number of workers: a game is kept unless an
    earlier seed made the same one."""
    rows: list[dict] = []
    seen: set[str] = set()
    total = options.num_train_games + options.num_heldout_games
    workers = workers or generation_workers(total)
    t0 = last = time.monotonic()

    def on_game(done_in_round: int) -> None:
        nonlocal last
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            log(f"generating TextWorld games: {len(rows) + done_in_round}/{total} ({last - t0:.0f}s, {workers} processes)")

    for split, start, count in (("train", options.train_seed, options.num_train_games),
                                ("heldout", options.heldout_seed, options.num_heldout_games)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        scratch = folder / f"{split}.made"
        scratch.mkdir(exist_ok=True)
        seed, made, tries = start, 0, 0
        while made < count:
            seeds = range(seed, seed + count - made)  # each seed adds at most one game: no round overshoots
            for row in _round(options, seeds, scratch, workers, on_game):
                tries += 1
                if tries > 20 * count + 100:
                    raise option_error(f"num_{split}_games", f"only {made} distinct {split} games in {tries} seeds; "
                                                             "the world is too small for this many (raise world_size, "
                                                             "nb_objects or quest_length, or ask for fewer games)")
                made_path = scratch / f"{row['seed']}.json"
                if row["fingerprint"] in seen:  # a duplicate (within a split, or a held-out game equal to a training one)
                    made_path.unlink()
                    continue
                seen.add(row["fingerprint"])
                os.replace(made_path, folder / split / f"{row['seed']}.json")
                rows.append({"split": split, "seed": row["seed"], "file": f"{split}/{row['seed']}.json", **row})
                made += 1
            seed += len(seeds)
        shutil.rmtree(scratch)
    log(f"generated {total} TextWorld games in {time.monotonic() - t0:.0f}s ({workers} processes)")
    return rows


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry_ok(path: Path) -> bool:
    try:
        rows = json.loads((path / "games.json").read_text())["games"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((path / r["file"]).is_file() for r in rows)


def prepare_games(options: Any, log=None) -> Path:
    """The cache entry of these settings, generated on a miss (one generator at a time per entry), with
    progress lines to `log` (default: stderr)."""
    out = Path(options.cache_dir) / f"textworld-{settings_key(options)}"
    if _entry_ok(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process generating the same entry: wait, then use it
        if _entry_ok(out):
            return out
        log = log or _stderr
        log(f"generating TextWorld games into {out}")
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
        try:
            rows = _generate_all(options, tmp, log)
            (tmp / "games.json").write_text(json.dumps({"settings": generation_settings(options), "games": rows}))
            for f in [*sorted(tmp.rglob("*")), tmp]:  # whole files before the rename publishes them
                _fsync(f)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_records(folder: Path) -> list[GameRecord]:
    rows = json.loads((folder / "games.json").read_text())["games"]
    return [GameRecord(r["split"], r["seed"], str(folder / r["file"]), r["fingerprint"], tuple(r["walkthrough"]),
                       r["max_score"], tuple(r["states"])) for r in rows]


@functools.lru_cache(maxsize=1024)
def load_game(path: str):
    """(game, inform7) of a cached game, loaded once per process (~10 ms and ~40 kB each) and shared by its episodes:
    both are only read while playing; each episode has its own `GameProgression`."""
    textworld = _textworld()
    from textworld.generator.inform7 import Inform7Game

    game = textworld.Game.load(path)
    return game, Inform7Game(game)


def _worker_main(argv: list[str]) -> None:
    """`python -c WORKER SETTINGS_JSON SCRATCH SEED...`: a `_Worker` process."""
    from types import SimpleNamespace

    options, scratch = SimpleNamespace(**json.loads(argv[0])), Path(argv[1])
    for seed in map(int, argv[2:]):
        print(json.dumps(_made(options, seed, str(scratch / f"{seed}.json"))), flush=True)
