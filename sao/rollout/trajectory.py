"""One home for building a `Trajectory`: every driver of an episode appends through `TrajectoryBuilder`
(the turn loop of built-in and OpenEnv environments, and the agent endpoint, sao/rollout/agent_loop.py,
in every process: rollout workers, sync mode, evaluation, the parity gate), and every episode ends
through its one status ladder.

    context(ids)     tokens the model did not sample: the prompt (the first ones), observations, an
                     agent's new messages                                     action_mask 0
    sampled(gen)     the engine's tokens, with their behavior log-probs and versions; one turn
                                                                              action_mask 1
    segment(ids)     a new token sequence of the same episode: `ids` is its prompt (an agent's history
                     as its template re-renders it); the earlier tokens stay as sampled  action_mask 0
    fail(exc, why)   the status ladder: a timeout -> `timeout` (why), an engine failure -> `engine_error`,
                     any other exception -> `env_error` (its message kept); a cancellation -> `aborted`,
                     and it propagates
    done(limits)     the finished trajectory, checked against the episode limits: one with a sequence
                     (segment) over rollout.max_episode_tokens or a turn over rollout.max_action_tokens is
                     never trainable (`env_error`, whatever produced it)

Untrusted values are checked here, at the boundary every environment and agent crosses:
a reward must be a finite number (`reward(x)`; NaN, inf, "nan", a bool or a non-number end the episode
as `env_error`, so it is counted and never trained on).

Tokens are only ever appended: earlier ones are never re-tokenized (docs/algorithm.md §2).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

from sao.engine.base import EngineError
from sao.types import Generation, Status, Trajectory

CHARS_PER_TOKEN_BOUND = 64  # no tokenizer's token is longer: text past budget x this cannot fit


class BadReward(ValueError):
    """An environment or agent gave a reward that is not a finite number."""


def finite_reward(value) -> float:
    """`value` as a float if it is a finite real number (an int, a float, a numpy or one-element torch
    scalar; not a bool, not a string); else BadReward."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(type(value), "__float__"):
        raise BadReward(f"reward {str(value)[:60]!r} is not a number")
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):  # e.g. a tensor of several elements, a huge Decimal
        raise BadReward(f"reward {str(value)[:60]!r} is not one number") from None
    if not math.isfinite(value):
        raise BadReward(f"reward {value} is not finite")
    return value


class TrajectoryBuilder:
    def __init__(self, task_id: str, traj_id: str | None = None):
        self.traj = Trajectory(id=traj_id or uuid.uuid4().hex[:12], task_id=task_id, token_ids=[], action_mask=[],
                               behavior_logprobs=[], token_versions=[], prompt_len=0, started_at=time.time())

    @property
    def id(self) -> str:
        return self.traj.id

    @property
    def token_ids(self) -> list[int]:
        """The current sequence's tokens (the whole trajectory unless it was segmented)."""
        t = self.traj
        return t.token_ids[t.segment_starts[-1]:] if t.segment_starts else t.token_ids

    def segment(self, ids: list[int]) -> None:
        t = self.traj
        if t.token_ids:
            t.segment_starts.append(len(t.token_ids))
        self.context(ids)

    def context(self, ids: list[int]) -> None:
        t = self.traj
        t.token_ids += ids
        t.action_mask += [0] * len(ids)
        t.behavior_logprobs += [0.0] * len(ids)
        t.token_versions += [-1] * len(ids)
        if not t.prompt_len:
            t.prompt_len = len(t.token_ids)

    def sampled(self, gen: Generation) -> None:
        t = self.traj
        t.token_ids += gen.token_ids
        t.action_mask += [1] * len(gen.token_ids)
        t.behavior_logprobs += gen.logprobs
        t.token_versions += gen.versions
        t.turns += 1

    def end(self, status: Status, reason: str = "", reward: float | None = None) -> None:
        t = self.traj
        t.status, t.status_reason = status, reason
        if reward is not None:
            t.reward = finite_reward(reward)

    def fail(self, exc: BaseException, timeout: str) -> None:
        """End the episode by what was raised; a cancellation (the run stopping) and anything that is not
        an Exception (KeyboardInterrupt) are raised again after the status is set."""
        if isinstance(exc, asyncio.CancelledError):
            self.end(Status.ABORTED, "cancelled")
            raise exc
        if isinstance(exc, asyncio.TimeoutError):
            self.end(Status.TIMEOUT, timeout)
        elif isinstance(exc, EngineError):
            self.end(Status.ENGINE_ERROR, str(exc)[:500])
        elif isinstance(exc, Exception):  # the environment's or the agent's own bug ends this episode only
            self.end(Status.ENV_ERROR, f"{type(exc).__name__}: {exc}"[:500])
        else:
            raise exc

    def done(self, limits=None) -> Trajectory:
        t = self.traj
        t.finished_at = time.time()
        if limits is not None and t.status in (Status.OK, Status.TRUNCATED):
            turn, longest = 0, 0
            for m in t.action_mask:
                turn = turn + 1 if m else 0
                longest = max(longest, turn)
            longest_seq = max(b - a for a, b in t.segments())
            if longest_seq > limits.max_episode_tokens:
                self.end(Status.ENV_ERROR, f"{longest_seq} tokens, over rollout.max_episode_tokens="
                                           f"{limits.max_episode_tokens}")
            elif longest > limits.max_action_tokens:
                self.end(Status.ENV_ERROR, f"a turn of {longest} sampled tokens, over rollout.max_action_tokens="
                                           f"{limits.max_action_tokens}")
        return t
