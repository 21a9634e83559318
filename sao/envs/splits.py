"""Held-out splits shared by every environment: a hash of the prompt with a fixed data seed.

Which tasks are held out depends on the task and `data_seed` only, never on the run's `train.seed`.
Runs with different training seeds therefore share one held-out set, and the SFT warm start (cached
once, whatever `train.seed` the run that built it had) never trains on any run's held-out tasks.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterator

from pydantic import Field

from sao.envs.base import EnvOptions
from sao.types import Task


class SplitOptions(EnvOptions):
    """Options of an environment that generates its tasks and holds some out."""

    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="share of distinct prompts held out (hash split)")
    data_seed: int = Field(0, description="seed of the held-out split and of the held-out tasks drawn; not "
                                          "train.seed, so runs with different training seeds share one held-out set")


def is_heldout(key: str, fraction: float, seed: int) -> bool:
    """Hash split: uniform in [0, 1) from sha256(seed:key), held out below `fraction`."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split_side(draw: Callable[[], Task], heldout: bool, held: Callable[[str], bool], prefix: str,
               limit: int = 100_000) -> Iterator[Task]:
    """Endless stream of generated tasks on one side of the split, numbered `prefix-0, prefix-1, ...`.

    A small problem space with an extreme `heldout_fraction` (or an unlucky `data_seed`) can leave a
    side empty; after `limit` draws in a row on the other side this raises an error naming the option
    instead of looping forever."""
    misses = 0
    for i in itertools.count():
        while held((task := draw()).prompt) != heldout:
            misses += 1
            if misses >= limit:
                side = "held-out" if heldout else "training"
                raise ValueError(f"env.options.heldout_fraction: no {side} task in {limit} draws; the problem space "
                                 "is too small for this split (change heldout_fraction or data_seed)")
        misses = 0
        task.id = f"{prefix}-{i}"
        yield task


def distinct_tasks(stream: Iterator[Task], n: int, patience: int = 1000) -> list[Task]:
    """n held-out tasks with distinct prompts, in order of first appearance in `stream`.

    A generator may have fewer distinct held-out prompts than n (no new one in `patience` draws); then
    all of them are returned, repeated in turn up to n, so each one is evaluated equally often (the
    evaluation reports `distinct_tasks`)."""
    seen: dict[str, Task] = {}
    misses = 0
    while len(seen) < n and misses < patience:
        task = next(stream)
        if task.prompt in seen:
            misses += 1
        else:
            seen[task.prompt], misses = task, 0
    unique = list(seen.values())
    return [unique[i % len(unique)] for i in range(n)]


def in_turn(tasks: list[Task], n: int) -> list[Task]:
    """`tasks` in order, repeated in turn up to n (a fixed held-out set evaluated n times)."""
    return [tasks[i % len(tasks)] for i in range(n)]


def reshuffled(tasks: list[Task], seed: int) -> Iterator[Task]:
    """Endless stream of `tasks`, reshuffled every pass with `seed` (a fixed training set)."""
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order
