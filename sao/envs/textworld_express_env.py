"""`textworld_express`: TextWorldExpress games, a second family of long-horizon, sparse-reward agent tasks.

The `textworld-express` package (the `textworld` extra) ships its Java engine in the wheel and runs it on
the machine's JVM through py4j: nothing is downloaded. Each task is one game of `game` (default `coin`:
find the coin somewhere in a house of `numLocations` rooms, `game_params`) picked by seed:

    user:       Your task is to find the coin. ...
                You are in the kitchen. ... To the North you see the pantry. To the East you see the corridor.
                can: 1 move east, 2 move north, 3 take coin
    assistant:  2                                          (a number, or the command itself)
    tool:       You are in the pantry. ...
    ...                                                   (the episode ends when the game is won or lost)

Training games come from the engine's `train` seed fold, held-out games from its `test` fold, so no game
is both (their fingerprints, the task text and first observation, are checked apart when the games are
prepared). `solution_length=L` keeps only games whose shortest solution is L commands: the quest length of
a curriculum or a horizon comparison.

Demonstrations (the SFT warm start) are computed by sao: the engine's own gold paths are not shortest
(coin's starts with `look around`) and its valid actions come in an order that changes between processes.
`shortest_path` searches breadth-first over the game's states (a state: what `look` and `inventory` say,
with the score), expanding the valid actions in sorted order and reaching each state by replaying its
commands from a reset (the engine has no cheaper copy), so the first winning path is a shortest one and
the same in every process. It is a shortest path when what `look` and `inventory` say is the whole state
(coin and mapreader without doors); with state out of sight (doors, closed containers) two states can look
alike and the path found may be longer. Preparing the games (a search per game, ~1-3 s each) is cached in `cache_dir`,
keyed by the settings.

Reward: 1 when the task succeeds, 0 otherwise (sparse; the engine's partial score is reported in info).
Held-out accuracy is the win rate: only a won episode ends `ok`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from pydantic import Field

from sao.envs.base import EpisodeContext, Message, StepResult, register_environment
from sao.envs.latency import LatencyOptions, with_latency
from sao.envs.splits import in_turn, reshuffled
from sao.types import Task

_IDLE = ("look around", "inventory")  # they change nothing: never listed, never in a demonstration


class TextWorldExpressOptions(LatencyOptions):
    game: str = Field("coin", description="the TextWorldExpress game (coin, mapreader, cookingworld, twc, sorting, ...)")
    game_params: str = Field("numLocations=5,includeDoors=0,numDistractorItems=0", description=(
        "the game's generation parameters, as the engine takes them (coin: numLocations, includeDoors, "
        "numDistractorItems)"))
    solution_length: int | None = Field(None, ge=1, le=60, description=(
        "keep only games whose shortest solution has this many commands (the quest length); None: any"))
    num_train_games: int = Field(64, ge=1, description="training games, from the engine's train seed fold")
    num_heldout_games: int = Field(32, ge=1, description="held-out games, from the engine's test fold; never trained on")
    observation_chars: int = Field(400, ge=40, description="an observation is cut to this many characters")
    max_commands: int = Field(24, ge=1, le=99, description="valid commands listed (numbered) after each observation")
    max_search_states: int = Field(5000, ge=1, description=(
        "states the shortest-path search may visit per game; a game it cannot solve within them is skipped"))
    cache_dir: str = Field(".sao_cache", description="where prepared games (and their shortest paths) are cached")


# ---------------------------------------------------------------- the engine


_POOL: list = []  # idle engines (one JVM each), reused across episodes of this process
_POOL_LOCK = threading.Lock()


def _engine():
    with _POOL_LOCK:
        if _POOL:
            return _POOL.pop()
    from textworld_express import TextWorldExpressEnv

    return TextWorldExpressEnv(envStepLimit=1000)


POOL_SIZE = 16  # idle engines kept per process; more are closed (a JVM each)


def _release(engine) -> None:
    with _POOL_LOCK:
        if len(_POOL) < POOL_SIZE:
            _POOL.append(engine)
            return
    _close(engine)


def _close(engine) -> None:
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - a dead JVM has nothing left to close
        pass


def _reset(engine, options: TextWorldExpressOptions, fold: str, seed: int) -> tuple[str, dict]:
    return engine.reset(seed=seed, gameFold=fold, gameName=options.game, gameParams=options.game_params,
                        generateGoldPath=False)


def commands(infos: dict) -> list[str]:
    """The commands the model is offered: the valid ones that change something, sorted (the engine's order
    changes between processes)."""
    return sorted(a for a in infos["validActions"] if a not in _IDLE)


def _state_key(infos: dict) -> tuple:
    return infos["look"], infos["inventory"], infos["scoreRaw"]


def shortest_path(engine, options: TextWorldExpressOptions, fold: str, seed: int) -> list[str] | None:
    """A shortest winning command sequence of game (fold, seed), breadth-first over its states; None when
    none is found within `max_search_states`. Deterministic: actions are expanded in sorted order."""
    _, infos = _reset(engine, options, fold, seed)
    frontier, seen = deque([()]), {_state_key(infos)}
    while frontier:
        path = frontier.popleft()
        for action in _children(engine, options, fold, seed, path):
            _, infos = _replay(engine, options, fold, seed, path + (action,))
            if infos["tasksuccess"]:
                return list(path + (action,))
            key = _state_key(infos)
            if infos["taskfailure"] or key in seen:
                continue
            if len(seen) >= options.max_search_states:
                return None
            seen.add(key)
            frontier.append(path + (action,))
    return None


def _replay(engine, options, fold: str, seed: int, path: tuple) -> tuple[str, dict]:
    obs, infos = _reset(engine, options, fold, seed)
    for action in path:
        obs, _, _, infos = engine.step(action)
    return obs, infos


def _children(engine, options, fold: str, seed: int, path: tuple) -> list[str]:
    return commands(_replay(engine, options, fold, seed, path)[1])


def observe(obs: str, infos: dict, options: TextWorldExpressOptions) -> str:
    """The observation cut to observation_chars, then the numbered commands."""
    shown = commands(infos)[: options.max_commands]
    listed = ", ".join(f"{i} {c}" for i, c in enumerate(shown, 1))
    return f"{' '.join(obs.split())[: options.observation_chars]}\ncan: {listed}"


def _settings_key(options: TextWorldExpressOptions) -> str:
    keep = ("game", "game_params", "solution_length", "num_train_games", "num_heldout_games", "max_search_states")
    blob = json.dumps({k: getattr(options, k) for k in keep}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Progress:
    """A line every 30 s while games are searched (a search per seed: minutes for thousands of games)."""

    def __init__(self, total: int, log) -> None:
        self.total, self.log, self.done = total, log, 0
        self.t0 = self.last = time.monotonic()

    def add(self) -> None:
        self.done += 1
        if time.monotonic() - self.last >= 30:
            self.last = time.monotonic()
            self.log(f"searching textworld-express games: {self.done}/{self.total} ({self.last - self.t0:.0f}s)")


def _prepare_fold(engine, options, fold: str, n: int, skip: set[str], progress: _Progress | None = None) -> list[dict]:
    """The first `n` games of `fold` (by seed) with a shortest solution (of solution_length, if set) whose
    fingerprint is not in `skip`, among its first max(64, 16 n) seeds (each costs a search)."""
    valid = {"train": engine.getValidSeedsTrain, "test": engine.getValidSeedsTest}[fold]()
    tried = valid[: max(64, 16 * n)]
    if options.game not in engine.getGameNames():
        raise ValueError(f"env.options.game: {options.game!r} is not a TextWorldExpress game "
                         f"({', '.join(engine.getGameNames())})")
    games, refused = [], ""
    for seed in tried:
        try:
            obs, infos = _reset(engine, options, fold, seed)
        except Exception as e:  # py4j's Py4JJavaError: the engine cannot make this seed's game with these params
            lines = str(e).splitlines() or [type(e).__name__]
            refused = refused or next((line.split("ERROR:")[-1].strip() for line in lines if "Exception" in line),
                                      lines[0])
            continue
        fingerprint = hashlib.sha256(f"{infos['taskDescription']}\n{obs}".encode()).hexdigest()[:16]
        if fingerprint in skip:
            continue
        path = shortest_path(engine, options, fold, seed)
        if path is None or (options.solution_length is not None and len(path) != options.solution_length):
            continue
        games.append({"fold": fold, "seed": seed, "fingerprint": fingerprint, "path": path})
        skip.add(fingerprint)
        if progress is not None:
            progress.add()
        if len(games) == n:
            return games
    if refused and not games:
        raise ValueError(f"env.options.game_params: the engine cannot make {options.game} games with "
                         f"{options.game_params!r}: {refused[:200]}")
    length = f" of {options.solution_length} commands" if options.solution_length else ""
    raise ValueError(f"env.options: among the first {len(tried)} games of the {fold} fold of {options.game} "
                     f"({options.game_params}) {len(games)} have a shortest solution{length} within max_search_states="
                     f"{options.max_search_states}; {n} are asked")


def prepare_games(options: TextWorldExpressOptions, log=_stderr) -> list[dict]:
    """Every game of these settings with its shortest path: from the cache, or searched (once per entry), with
    progress lines to `log` on a miss: every 30 s and at the end, none before the first 30 s, so settings the
    engine refuses stay a one-line error."""
    out = Path(options.cache_dir) / f"textworld-express-{_settings_key(options)}.json"
    if out.is_file():
        return json.loads(out.read_text())["games"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process preparing the same entry: wait, then read it
        if out.is_file():
            return json.loads(out.read_text())["games"]
        progress = _Progress(options.num_train_games + options.num_heldout_games, log)
        engine = _engine()
        try:
            train = _prepare_fold(engine, options, "train", options.num_train_games, set(), progress)
            heldout = _prepare_fold(engine, options, "test", options.num_heldout_games,
                                    {g["fingerprint"] for g in train}, progress)
        finally:
            _release(engine)
        log(f"prepared {progress.done} textworld-express games into {out} in {time.monotonic() - progress.t0:.0f}s")
        tmp = out.with_name(out.name + f".{os.getpid()}.partial")
        tmp.write_text(json.dumps({"settings": options.model_dump(), "games": train + heldout}))
        os.replace(tmp, out)
    return train + heldout


# ---------------------------------------------------------------- episodes


class TextWorldExpressEpisode:
    def __init__(self, options: TextWorldExpressOptions) -> None:
        self.options = options
        self.engine = None
        self.infos: dict = {}
        self.counts = {"invalid_commands": 0, "moves": 0}

    def reset(self, task: Task) -> list[Message]:
        self.engine = _engine()
        _, self.infos = _reset(self.engine, self.options, task.meta["fold"], task.meta["seed"])
        return [{"role": "user", "content": task.prompt}]

    def _match(self, action: str) -> str | None:
        said = re.sub(r"\s+", " ", action.strip()).lower()
        shown = commands(self.infos)[: self.options.max_commands]
        if said.isascii() and said.isdigit() and len(said) <= 3:  # "²" or 5000 digits: an invalid command
            return shown[int(said) - 1] if 1 <= int(said) <= len(shown) else None
        return next((c for c in self.infos["validActions"] if c.lower() == said), None)

    def step(self, action: str) -> StepResult:
        command = self._match(action)
        if command is None:
            self.counts["invalid_commands"] += 1
            return StepResult("(invalid) " + observe(self.infos["observation"], self.infos, self.options), 0.0, False,
                              {**self.counts, "won": 0.0})
        self.counts["moves"] += 1
        try:
            obs, _, _, self.infos = self.engine.step(command)
        except Exception:  # the engine (its JVM) failed: never back in the pool; the episode ends env_error
            engine, self.engine = self.engine, None
            _close(engine)
            raise
        won = bool(self.infos["tasksuccess"])
        info = {**self.counts, "won": float(won), "score": float(self.infos["score"])}
        if won or self.infos["taskfailure"]:
            return StepResult("", 1.0 if won else 0.0, True, info)
        return StepResult(observe(obs, self.infos, self.options), 0.0, False, info)

    def close(self) -> None:
        if self.engine is not None:
            _release(self.engine)
            self.engine = None


# ---------------------------------------------------------------- the environment


class TextWorldExpressEnvironment:
    """Registered as `textworld_express`. Held-out games (test fold) never train, nor SFT."""

    Options = TextWorldExpressOptions

    def __init__(self, options: TextWorldExpressOptions, seed: int = 0):
        self.options, self.seed = options, seed
        self._latency_rng = random.Random(seed)  # env.options.step_latency_s (sao/envs/latency.py)
        games = prepare_games(options)
        engine = _engine()
        try:
            tasks = [self._task(engine, g) for g in games]
        finally:
            _release(engine)
        self.train = [t for t in tasks if t.meta["fold"] == "train"]
        self.heldout = [t for t in tasks if t.meta["fold"] == "test"]

    def _task(self, engine, game: dict) -> Task:
        obs, infos = _reset(engine, self.options, game["fold"], game["seed"])
        prompt = f"{infos['taskDescription'].strip()}\n{observe(obs, infos, self.options)}"
        split = "train" if game["fold"] == "train" else "heldout"
        return Task(id=f"twx-{split}-{game['seed']}", prompt=prompt, answer=None,
                    meta={**game, "split": split})

    def eval_tasks(self, n: int) -> list[Task]:
        """The held-out games in order, repeated in turn up to n."""
        return in_turn(self.heldout, n)

    def train_tasks(self) -> Iterator[Task]:
        """Endless stream of training games, reshuffled every pass with the run's seed."""
        return reshuffled(self.train, self.seed)

    def new_episode(self, ctx: EpisodeContext) -> TextWorldExpressEpisode:
        return with_latency(TextWorldExpressEpisode(self.options), self.options, self._latency_rng)

    def demo(self, task: Task, rng: random.Random) -> list[Message]:
        """The shortest path with the observations and numbers this environment shows; training games only."""
        if task.meta["split"] != "train":
            raise ValueError(f"textworld_express: SFT demo asked for held-out game {task.id}")
        engine = _engine()
        try:
            obs, infos = _reset(engine, self.options, task.meta["fold"], task.meta["seed"])
            messages: list[Message] = [{"role": "user", "content": task.prompt}]
            path = task.meta["path"]
            for k, command in enumerate(path):
                shown = commands(infos)[: self.options.max_commands]
                messages.append({"role": "assistant",
                                 "content": str(shown.index(command) + 1) if command in shown else command})
                obs, _, _, infos = engine.step(command)
                if k < len(path) - 1:
                    messages.append({"role": "tool", "content": observe(obs, infos, self.options)})
        finally:
            _release(engine)
        return messages


register_environment("textworld_express", TextWorldExpressEnvironment)
