"""`verifiers`: train on environments written for the `verifiers` package (its `verifiers.v1` API, 0.3.1 and 0.4).

    env.options.environment = "my_env"        a taskset id: an importable module (or package) exporting one
                                              `vf.Taskset` subclass in `__all__` (and, for a multi-turn
                                              environment, its `vf.Env` subclass); a Hub id owner/name@ver
                                              is installed as `name`
    env.options.args = {split: train, ...}    the taskset's config fields

The taskset gives the tasks (split into training and held-out ones by a hash of each task's key, like
every sao dataset); each episode runs one rollout of the environment's own loop (`Env.run`: single-turn,
or multi-turn with the environment answering each turn) whose every model call goes through sao's
per-episode endpoint (sao/rollout/agent_session.py), so the trajectory holds sao's sampled tokens and
log-probs, never verifiers' text; the task's own rewards (`@vf.reward`, weighted) score the trace and give
the episode's reward, its `@vf.metric`s become `agent/...` metrics. The model calls are made in process by
sao's harness (sao/envs/verifiers_harness.py) through verifiers' interception server, with a
`subprocess` runtime: nothing goes to a cloud sandbox, no program is installed at run time.

Not supported (refused at load, one line): tasks with tool servers (`Task.toolsets`), tasks that need a
container image. Judges that call another model API (`vf.Judge`) call it themselves; sao does not route them.
"""

from __future__ import annotations

import copy
import os
import secrets
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import Field

from sao.envs.agent import AgentEpisode, EndpointOptions
from sao.envs.base import EpisodeContext, register_environment
from sao.envs.splits import SplitOptions, is_heldout
from sao.types import Task

HARNESS_ID = "sao_verifiers_harness"  # the module name verifiers imports sao's harness by


class VerifiersOptions(SplitOptions, EndpointOptions):
    environment: str = Field(..., min_length=1, description=(
        "a verifiers taskset id: an importable module exporting one vf.Taskset subclass in __all__ (and its "
        "vf.Env subclass for a multi-turn environment)"))
    args: dict[str, Any] = Field(default_factory=dict, description="the taskset's config fields")
    max_tasks: int = Field(100_000, ge=1, description="tasks read from an unbounded taskset")


class VerifiersFailed(RuntimeError):
    """A verifiers rollout ended with an error (the environment's, not the model's)."""


def _load(options: VerifiersOptions):
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError("env.name=verifiers needs the verifiers package: pip install -e '.[verifiers]'") from None
    from sao.envs import verifiers_harness

    sys.modules.setdefault(HARNESS_ID, verifiers_harness)
    config = {"taskset": {"id": options.environment, **options.args},
              "agent": {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}}}
    try:
        return vf, vf.load_environment(vf.resolve_env_config(config))
    except Exception as exc:  # ModuleNotFoundError, pydantic's ValidationError, verifiers' own ValueError...
        first = " ".join(str(exc).split())[:300]
        raise ValueError(f"env.options.environment: cannot load verifiers environment {options.environment!r}: "
                         f"{type(exc).__name__}: {first}") from None


class VerifiersEnvironment:
    Options = VerifiersOptions

    def __init__(self, options: VerifiersOptions, seed: int = 0):
        self.options, self.seed = options, seed
        self.vf, self.env = _load(options)
        taskset = self.env.taskset
        if not getattr(taskset, "bounded", True):  # verifiers 0.4: an unbounded taskset is lazy
            taskset = taskset.take(options.max_tasks)
        tasks = list(taskset)
        if not tasks:
            raise ValueError(f"env.options.environment: verifiers taskset {options.environment!r} has no tasks "
                             "(its load() returned none; check env.options.args)")
        self.tasks: dict[str, Any] = {}
        self.train: list[Task] = []
        self.heldout: list[Task] = []
        for i, t in enumerate(tasks):
            if type(t).toolsets(t.config):
                raise ValueError(f"env.options.environment: task {i} of {options.environment!r} has tool servers "
                                 "(Task.toolsets); sao's verifiers adapter does not run them")
            if getattr(t.data, "image", None):
                raise ValueError(f"env.options.environment: task {i} of {options.environment!r} needs the container "
                                 f"image {t.data.image!r}; sao's verifiers adapter runs without containers")
            key = str(t.key)
            task = Task(id=f"{options.environment}-{i}", prompt=_prompt_text(t.data.prompt), meta={"key": key})
            self.tasks[task.id] = t
            (self.heldout if is_heldout(key, options.heldout_fraction, options.data_seed) else self.train).append(task)
        if not self.train or not self.heldout:
            side = "training" if not self.train else "held-out"
            raise ValueError(f"env.options.heldout_fraction: no {side} task among the {len(tasks)} tasks of "
                             f"{options.environment!r} (change heldout_fraction or data_seed)")

    def train_tasks(self) -> Iterator[Task]:
        import random

        rng, order = random.Random(self.seed), list(self.train)
        while True:
            rng.shuffle(order)
            yield from order

    def eval_tasks(self, n: int) -> list[Task]:
        return [self.heldout[i % len(self.heldout)] for i in range(n)]

    def new_episode(self, ctx: EpisodeContext) -> AgentEpisode:
        return AgentEpisode(self.options, self.rollout, None, ctx)

    async def rollout(self, row: dict, base_url: str, api_key: str) -> dict:
        """One rollout of the environment on the task, its model calls to `base_url`; its reward and metrics."""
        vf, task = self.vf, self.tasks[row["id"]]
        var = "SAO_VERIFIERS_KEY_" + secrets.token_hex(8)  # verifiers reads the key from a variable; one per episode
        os.environ[var] = api_key
        env = copy.copy(self.env)  # serving() keeps its interception server on the object: one per episode
        try:
            ctx = vf.ModelContext(model="sao", client=vf.EvalClientConfig(base_url=base_url, api_key_var=var))
            async with env.serving():
                episode = await env.run_episode(task, ctx)
        finally:
            os.environ.pop(var, None)
        errors = [e.message for e in episode.errors] + [e.message for tr in episode.traces for e in tr.errors]
        if not episode.ok or not episode.traces or errors:
            raise VerifiersFailed(" ".join(str(errors[0] if errors else "the rollout made no trace").split())[:300])
        trace = episode.traces[0]
        return {"reward": trace.reward, **{k: v for k, v in trace.metrics.items() if isinstance(v, (int, float))}}


def _prompt_text(prompt) -> str:
    """What sao shows as a task's prompt (logs, trajectories): the text, or the last message's."""
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    last = prompt[-1] if prompt else None
    content = getattr(last, "content", None) if last is not None else None
    return content if isinstance(content, str) else str(content or "")


register_environment("verifiers", VerifiersEnvironment)
