"""The records that cross process boundaries: tasks, sampling parameters, generations, trajectories.

This module is the only contract between rollout workers and the trainer (docs/architecture.md §3). Every
record is a plain dataclass of Python scalars and lists, so it pickles cheaply through a
`multiprocessing` queue and serializes to one JSON line; never put torch tensors here (a tensor
sent from a process that later exits crashes the receiver; docs/architecture.md §7).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """How an episode ended. Only `ok` and `truncated` episodes are trained on."""

    OK = "ok"  # the environment said done
    TRUNCATED = "truncated"  # turn limit or token budget reached before done
    ENV_ERROR = "env_error"  # the environment raised; the reason holds the message
    ENGINE_ERROR = "engine_error"  # the engine failed (forward pass, dead server); the worker re-runs it
    TIMEOUT = "timeout"  # the environment or sandbox ran past its time limit
    ABORTED = "aborted"  # the run stopped while the episode was in flight


TRAINABLE = (Status.OK, Status.TRUNCATED)


@dataclass
class Task:
    """One problem an environment can be reset with."""

    id: str
    prompt: str  # the user's message
    answer: Any = None  # what the environment checks against; never shown to the model
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    """How the engine samples one action. Training requires temperature 1, top_p 1, top_k 0
    (docs/algorithm.md §3: the behavior log-prob must be the log-prob of the distribution sampled from)."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    @property
    def is_exact(self) -> bool:
        """True when the sampled distribution is the model's own softmax (DIS-safe)."""
        return self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == 0


@dataclass
class Generation:
    """What the engine returns for one `generate` call."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the distribution sampled from
    versions: list[int]  # policy version of the weights that produced each token
    finish_reason: str  # "stop" (a stop token was sampled) or "length"


@dataclass
class Trajectory:
    """`[prompt, a_0, o_0, a_1, ..., a_n]` as token ids, exactly as sampled (docs/algorithm.md §2).

    One episode may be several token sequences (segments): an agent whose chat template re-renders its
    history (env.options.on_rewrite=segment) or one sample per call (env.options.sample_unit=turn)
    continues on a new prompt. `segment_starts` holds where each segment after the first begins in
    `token_ids` (its first tokens are its prompt, action_mask 0); the trainer makes each segment a row of
    its batch and carries the episode's return across them (docs/algorithm.md §2)."""

    id: str
    task_id: str
    token_ids: list[int]
    action_mask: list[int]  # 1 on model-sampled tokens only
    behavior_logprobs: list[float]  # 0.0 where action_mask is 0
    token_versions: list[int]  # -1 where action_mask is 0
    prompt_len: int
    reward: float = 0.0
    status: Status = Status.OK
    status_reason: str = ""
    turns: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    segment_starts: list[int] = field(default_factory=list)

    def segments(self) -> list[tuple[int, int]]:
        """(start, end) of each token sequence in `token_ids`: one unless the episode was segmented."""
        bounds = [0, *self.segment_starts, len(self.token_ids)]
        return list(zip(bounds[:-1], bounds[1:]))

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def oldest_version(self) -> int:
        versions = [v for v, m in zip(self.token_versions, self.action_mask) if m]
        return min(versions) if versions else 0

    @property
    def eval_score(self) -> float | None:
        """What a held-out evaluation counts: the reward of a finished episode, 0 for a truncated one, None
        for a failed one (it says nothing about the policy and is counted apart)."""
        if self.status not in TRAINABLE:
            return None
        return self.reward if self.status == Status.OK else 0.0

    def lag(self, current_version: int) -> int:
        """Staleness: trainer version minus the oldest policy version in this trajectory."""
        return current_version - self.oldest_version

    def to_json(self) -> str:
        row = dataclasses.asdict(self)
        row["status"] = self.status.value
        return json.dumps(row)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        row = json.loads(line)
        row["status"] = Status(row["status"])
        return cls(**row)


def segment_rows(trajectories: list[Trajectory]) -> list[tuple[int, int, int]]:
    """The rows a batch of trajectories becomes, in order: (trajectory index, start, end), one per segment
    that holds an action token (a segment without one gives the trainer nothing)."""
    return [(i, a, b) for i, t in enumerate(trajectories) for a, b in t.segments() if any(t.action_mask[a:b])]


# -- records between the trainer and its rollout workers (runtime backends) -----------------------
# Versions: `version` is always a policy version = actor optimizer steps taken. The trainer's
# version is what it trains next; an engine's version is what its weights are; a token's version
# is the engine version that sampled it (Trajectory.token_versions).


@dataclass
class Assignment:
    """One episode the trainer issues to a worker; `id` is unique in the run (audit key, trajectory id)."""

    id: str
    task: Task
    trainer_step: int = 0  # optimizer steps the trainer had taken when it issued this (EpisodeContext)


@dataclass
class Finished:
    """A worker finished an assignment (any status)."""

    worker: int
    trajectory: Trajectory


@dataclass
class WorkerStats:
    """A worker's counters since it started (sent about once a second)."""

    worker: int
    version: int  # engine version
    tokens: int = 0
    busy_s: float = 0.0  # engine time spent in forward passes
    wall_s: float = 0.0
    hung_steps: int = 0  # environment steps that ran past step_timeout_s and never returned
    engine_errors: int = 0
    engine_restarts: int = 0  # inference servers this worker's engine restarted after they died (vllm)


@dataclass
class WorkerLost:
    """A worker died; the backend restarted it. Its unfinished assignments must be issued again."""

    worker: int
    reason: str


Record = Finished | WorkerStats | WorkerLost
