"""The pacing invariant, in one place: what may be issued, what is consumed, what is dropped.

    in play  = issued - refunded             episodes handed to workers and not dropped since
    room     = (consumed + ahead + 1) * B - in play                     (docs/algorithm.md §6)
    consumed = batches whose following weights are published (or that left the policy unchanged:
               a critic warm-up step), so room only grows when engines can sample the new policy
    refunded = episodes dropped at dequeue (stale, failed, empty): each frees one place in play
    ahead    = runtime.issue_ahead, at least sync_every - 1, at most max_lag (`batches_ahead`)

When the trainer is the bottleneck every batch is `ahead` versions stale (docs/performance.md §6).
Pacing bounds the work in flight, not the lag of each episode: episodes finish out of order, so a
long one can still end up more than `max_lag` versions old; the drop at dequeue
(sao/runtime/queue.py) bounds what is trained. The scheduler (sao/runtime/scheduler.py) issues
within `room()`; the async loop (sao/runtime/loop.py) reports each step with `step_done`.
"""

from __future__ import annotations

from sao.config import RuntimeConfig


def batches_ahead(r: RuntimeConfig) -> int:
    """Batches the rollout side may run ahead of the trainer: runtime.issue_ahead, within max_lag, and
    at least sync_every - 1 (room only grows when weights are published)."""
    return min(r.max_lag, max(r.issue_ahead, r.sync_every - 1))


class Pacing:
    def __init__(self, batch_size: int, ahead: int, sync_every: int = 1):
        self.batch_size, self.ahead, self.sync_every = batch_size, ahead, sync_every
        self.issued = 0  # fresh assignments ever issued (re-issues of lost ones not counted)
        self.consumed = 0  # batches whose following weights are published
        self.refunded = 0  # assignments dropped at dequeue: their replacements may start
        self.unpublished = 0  # batches trained since the last publish

    def room(self) -> int:
        return (self.consumed + self.ahead + 1) * self.batch_size - (self.issued - self.refunded)

    def step_done(self, version_before: int, version: int) -> bool:
        """One batch trained, taking the policy from `version_before` to `version`; True when the new
        weights must be published now (every `sync_every` versions). A step that left the policy
        unchanged (critic warm-up) is consumed at once: engines already hold that policy."""
        self.unpublished += 1
        publish = version != version_before and version % self.sync_every == 0
        if publish or version == version_before:
            self.consumed += self.unpublished
            self.unpublished = 0
        return publish

    def state_dict(self) -> dict:
        return {"issued": self.issued, "consumed": self.consumed, "refunded": self.refunded,
                "unpublished": self.unpublished}

    def load_state_dict(self, state: dict) -> None:
        for key in ("issued", "consumed", "refunded", "unpublished"):
            setattr(self, key, state.get(key, 0))
