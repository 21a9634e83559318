"""A curriculum: `env.options` that change over training steps, for any environment.

    env:
      name: textworld
      options:
        rewards: sparse
        curriculum:                                  # stages; each overrides env.options from `start` on
          - {start: 0, quest_length: 2, world_size: 2}
          - {start: 10, quest_length: 5, world_size: 4}
          - {start: 20, quest_length: 10, world_size: 6}

`make_environment` sees the `curriculum` key and builds one environment per stage (the options without
`curriculum`, overridden by the stage's keys; each validated, so a bad key names its stage). Which stage a
training task comes from is a function of its draw number, not of the clock: draw n belongs to training step
n // tasks_per_step (what one batch takes: `train.batch_size`, or batch_size / group_size distinct prompts
for group algorithms; the runtime sets it), so a resumed run draws the same tasks in the same order (its
cursor) and a step's batch holds one stage's tasks (issued-ahead and retried episodes may carry the stage
before). Each task carries its stage (`Task.meta["curriculum_stage"]`) and episodes open on that stage's
environment (`environment_for`), whatever the step when they run. SFT, which sets no tasks_per_step, draws
demonstrations from every stage in turn, so the warm start covers every length. Held-out evaluation uses the
last stage (the length the curriculum leads to).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from sao.envs.base import EnvOptions
from sao.types import Task

STAGE = "curriculum_stage"


def parse_stages(options: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[int, dict[str, Any]]]]:
    """(the options without `curriculum`, [(start step, overrides)] in order); ValueError naming the key."""
    base = {k: v for k, v in options.items() if k != "curriculum"}
    stages = options["curriculum"]
    if not isinstance(stages, list) or not stages:
        raise ValueError("env.options.curriculum: expected a non-empty list of stages ({start: step, option: value})")
    out: list[tuple[int, dict[str, Any]]] = []
    for i, stage in enumerate(stages):
        where = f"env.options.curriculum[{i}]"
        if not isinstance(stage, dict) or not isinstance(stage.get("start"), int) or isinstance(stage["start"], bool):
            raise ValueError(f"{where}.start: each stage needs an integer start (its first training step)")
        start = stage["start"]
        if (i == 0 and start != 0) or (i > 0 and start <= out[-1][0]):
            raise ValueError(f"{where}.start: stages start at step 0 and at increasing steps (got {start})")
        if "curriculum" in stage:
            raise ValueError(f"{where}.curriculum: a stage cannot hold a curriculum")
        out.append((start, {k: v for k, v in stage.items() if k != "start"}))
    return base, out


class Curriculum:
    """One environment per stage, drawn from by step (see the module docstring)."""

    Options = EnvOptions

    def __init__(self, environments: list, starts: list[int]):
        self.environments, self.starts = environments, starts
        self.tasks_per_step: int | None = None  # set by the runtime before training draws (None: SFT's rotation)

    def stage_at(self, step: int) -> int:
        return max(i for i, s in enumerate(self.starts) if s <= step)

    def _tag(self, task: Task, stage: int) -> Task:
        return dataclasses.replace(task, meta={**task.meta, STAGE: stage})

    def train_tasks(self) -> Iterator[Task]:
        streams = [iter(e.train_tasks()) for e in self.environments]
        n = 0
        while True:
            if self.tasks_per_step:
                stage = self.stage_at(n // self.tasks_per_step)
            else:
                stage = n % len(streams)
            yield self._tag(next(streams[stage]), stage)
            n += 1

    def eval_tasks(self, n: int) -> list[Task]:
        last = len(self.environments) - 1
        return [self._tag(t, last) for t in self.environments[last].eval_tasks(n)]

    def environment_for(self, task: Task):
        """The stage environment `task` was drawn from (the last stage for a task without one)."""
        return self.environments[task.meta.get(STAGE, len(self.environments) - 1)]

    def new_episode(self, ctx):
        return self.environments[-1].new_episode(ctx)

    def __getattr__(self, name: str):
        """An environment's own extras: `demo(task, rng)` from the task's stage, `check_start()` on every stage,
        anything else from the last stage."""
        # demo_tasks: a curriculum's SFT demonstrations follow its own stream (train_tasks), not the last stage's
        if name.startswith("_") or name in ("environments", "starts", "tasks_per_step", "demo_tasks"):
            raise AttributeError(name)
        last = getattr(self.environments[-1], name)  # AttributeError when the environment has none
        if name == "demo":
            return lambda task, rng: self.environment_for(task).demo(task, rng)
        if name == "check_start":
            return lambda: [e.check_start() for e in self.environments][-1]
        return last
