"""`verifiers`: train on environments written for the `verifiers` package (its `verifiers.v1` API, 0.3.1 and 0.4).

    env.options.environment = "my_env"        a taskset id: an importable module (or package) exporting one
                                              `vf.Taskset` subclass in `__all__` (and, for a multi-turn
                                              environment, its `vf.Env` subclass); a Hub id owner/name@ver
                                              is installed as `name`
    env.options.environment = "my_env:load_environment"
                                              verifiers' older API (verifiers < 0.4): a function returning an
                                              `Environment` (SingleTurnEnv, MultiTurnEnv...) whose dataset gives
                                              the training tasks, its eval_dataset the held-out ones (else a
                                              hash split), its rubric the reward; `run_rollout` runs its loop
                                              with an OpenAI client on the episode's endpoint
    env.options.args = {split: train, ...}    the taskset's config fields (the function's keyword arguments)

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

import contextlib
import copy
import json
import os
import secrets
import signal
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import Field

from sao.envs.agent import AgentEpisode, EndpointOptions
from sao.envs.base import EpisodeContext, import_path, register_environment
from sao.envs.splits import SplitOptions, is_heldout
from sao.types import Task

HARNESS_ID = "sao_verifiers_harness"  # the module name verifiers imports sao's harness by


class VerifiersOptions(SplitOptions, EndpointOptions):
    environment: str = Field(..., min_length=1, description=(
        "a verifiers taskset id: an importable module exporting one vf.Taskset subclass in __all__ (and its "
        "vf.Env subclass for a multi-turn environment); or module:load_environment, verifiers' older API"))
    args: dict[str, Any] = Field(default_factory=dict, description=(
        "the taskset's config fields, or load_environment's keyword arguments"))
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
        self.tasks: dict[str, Any] = {}  # sao task id -> a v1 Task, or a legacy dataset row
        self.train: list[Task] = []
        self.heldout: list[Task] = []
        self.legacy = ":" in options.environment
        if self.legacy:
            self._load_legacy(options)
        else:
            self._load_taskset(options)

    def _load_taskset(self, options: VerifiersOptions) -> None:
        self.vf, self.env = _load(options)
        taskset = self.env.taskset
        if not getattr(taskset, "bounded", True):  # verifiers 0.4: an unbounded taskset is lazy
            taskset = taskset.take(options.max_tasks)
        tasks = list(taskset)
        if not tasks:
            raise ValueError(f"env.options.environment: verifiers taskset {options.environment!r} has no tasks "
                             "(its load() returned none; check env.options.args)")
        for i, t in enumerate(tasks):
            if type(t).toolsets(t.config):
                raise ValueError(f"env.options.environment: task {i} of {options.environment!r} has tool servers "
                                 "(Task.toolsets); sao's verifiers adapter does not run them")
            if getattr(t.data, "image", None):
                raise ValueError(f"env.options.environment: task {i} of {options.environment!r} needs the container "
                                 f"image {t.data.image!r}; sao's verifiers adapter runs without containers")
            self._add(f"{options.environment}-{i}", _prompt_text(t.data.prompt), str(t.key), t, None)
        self._check_split(len(tasks))

    def _load_legacy(self, options: VerifiersOptions) -> None:
        """`module:load_environment` (verifiers' older API: an Environment with a dataset and a rubric)."""
        try:
            import verifiers as vf

            base = vf.Environment  # verifiers 0.4 has no legacy API
        except (ImportError, AttributeError):
            raise ValueError("env.options.environment: module:function environments (verifiers' older API) need "
                             "verifiers < 0.4: pip install -e '.[verifiers]'") from None
        self.vf = vf
        with contextlib.suppress(ImportError):  # dataset.map()'s bars on every load: one line per error instead
            import datasets

            datasets.disable_progress_bars()
        load = import_path(options.environment, "environment", need_callable=True)
        try:
            with _signals_kept():  # an Environment installs its own SIGINT/SIGTERM handlers (main thread only)
                env = load(**options.args)
        except Exception as exc:  # its "Either dataset or eval_dataset must be provided", a bad argument...
            first = " ".join(str(exc).split())[:300]
            raise ValueError(f"env.options.environment: {options.environment} failed: {type(exc).__name__}: {first}") \
                from None
        if not isinstance(env, base):
            raise ValueError(f"env.options.environment: {options.environment} returned {type(env).__name__}, not a "
                             "verifiers Environment")
        if getattr(env, "requires_group_rollouts", False):
            raise ValueError(f"env.options.environment: {options.environment} scores groups of rollouts (group "
                             "reward functions); sao runs one rollout per task")
        try:
            train = env.get_dataset().to_list()
        except ValueError:
            raise ValueError(f"env.options.environment: {options.environment} has no dataset (only an eval_dataset): "
                             "sao trains on its dataset") from None
        held = env.eval_dataset.to_list() if getattr(env, "eval_dataset", None) is not None else None
        self.env = env
        name = options.environment.partition(":")[0]
        for split, rows in (("train", train), ("test", held or [])):
            for i, row in enumerate(rows):
                key = json.dumps([row.get("prompt"), row.get("answer")], default=str, sort_keys=True)
                side = (split == "test") if held else None
                self._add(f"{name}-{split}-{i}", _prompt_text(row.get("prompt")), key, row, side)
        self._check_split(len(train) + len(held or []))

    def _add(self, task_id: str, prompt: str, key: str, task, heldout: bool | None) -> None:
        """One task; `heldout` None: by the hash split of its key."""
        o = self.options
        self.tasks[task_id] = task
        if heldout is None:
            heldout = is_heldout(key, o.heldout_fraction, o.data_seed)
        (self.heldout if heldout else self.train).append(Task(id=task_id, prompt=prompt, meta={"key": key[:200]}))

    def _check_split(self, n: int) -> None:
        if not self.train or not self.heldout:
            side = "training" if not self.train else "held-out"
            raise ValueError(f"env.options.heldout_fraction: no {side} task among the {n} tasks of "
                             f"{self.options.environment!r} (change heldout_fraction or data_seed)")

    def train_tasks(self) -> Iterator[Task]:
        import random

        rng, order = random.Random(self.seed), list(self.train)
        while True:
            rng.shuffle(order)
            yield from order

    def eval_tasks(self, n: int) -> list[Task]:
        return [self.heldout[i % len(self.heldout)] for i in range(n)]

    def new_episode(self, ctx: EpisodeContext) -> AgentEpisode:
        return AgentEpisode(self.options, self.rollout_legacy if self.legacy else self.rollout, None, ctx)

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

    async def rollout_legacy(self, row: dict, base_url: str, api_key: str) -> dict:
        """A legacy Environment's `run_rollout` on the dataset row, with an OpenAI client on the episode's endpoint;
        its rubric's reward and metrics."""
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            out = await self.env.run_rollout(dict(self.tasks[row["id"]]), self.vf.OpenAIChatCompletionsClient(client),
                                             "sao", {})
        finally:
            await client.close()
        if out.get("error"):
            error = out["error"]
            text = error.get("error_chain_repr") or error.get("error") if isinstance(error, dict) else error
            raise VerifiersFailed(" ".join(str(text).split())[:300])
        metrics = out.get("metrics") or {}
        return {"reward": out["reward"], **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}


@contextlib.contextmanager
def _signals_kept():
    """Building a legacy Environment calls signal.signal for SIGINT and SIGTERM (and fails off the main thread):
    sao's handlers (the graceful stop) stay, and it builds on any thread."""
    real = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)
    try:
        yield
    finally:
        signal.signal = real


def _prompt_text(prompt) -> str:
    """What sao shows as a task's prompt (logs, trajectories): the text, or the last message's."""
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    last = prompt[-1] if prompt else None
    content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
    return content if isinstance(content, str) else str(content or "")


register_environment("verifiers", VerifiersEnvironment)
