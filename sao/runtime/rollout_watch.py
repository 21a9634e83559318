"""`RolloutWatch`: warns once when the rollouts themselves say the run trains on nothing useful.

    all truncated   every trajectory of `TRUNCATED_STEPS` trained batches in a row was truncated (no episode
                    ended by itself): rewards are the environment's partial credit at best, 0 for most tasks.
                    Seen with rollout.max_action_tokens one token short of the environment's action format:
                    every action was cut, every episode ran into the turn limit, 20 steps of reward 0, silently
    mostly failed   more than half of the episodes that finished over the last `WINDOW` steps failed (an
                    environment error, a timeout, an agent that exits): they are not trained on, and held-out
                    accuracy counts them as 0

Each warning prints once per run (the counts start again on resume). Stopping a run on failures is not
done here.
"""

from __future__ import annotations

from collections import Counter, deque

TRUNCATED_STEPS = 5
WINDOW = 10


class RolloutWatch:
    def __init__(self) -> None:
        self.truncated_steps = 0
        self.window: deque[tuple[Counter, int]] = deque(maxlen=WINDOW)  # (failed by status, trained) per step
        self.failed_before: Counter = Counter()  # the queue's failure counts at the last step
        self.warned: set[str] = set()

    def update(self, batch: list, failed_by_status: dict[str, int], step: int) -> list[str]:
        """Count this step's batch and the failures since the last step; the warnings due now."""
        out = []
        truncated = [t for t in batch if t.status.value == "truncated"]
        self.truncated_steps = self.truncated_steps + 1 if batch and len(truncated) == len(batch) else 0
        if self.truncated_steps >= TRUNCATED_STEPS and "truncated" not in self.warned:
            self.warned.add("truncated")
            reasons = Counter(t.status_reason or "truncated" for t in truncated).most_common(1)[0][0]
            out.append(f"sao: warning: every trajectory of the last {self.truncated_steps} steps was truncated "
                       f"({reasons}; step {step}): no episode ends by itself, so the rewards are 0 or partial. "
                       "Check rollout.max_turns and rollout.max_action_tokens (an action cut at its token budget "
                       "can miss the environment's format every time)")
        now = Counter(failed_by_status)
        self.window.append((now - self.failed_before, len(batch)))  # failures by status since the last step
        self.failed_before = now
        by_status = sum((c for c, _ in self.window), Counter())
        failed, trained = sum(by_status.values()), sum(n for _, n in self.window)
        if failed > trained and len(self.window) == WINDOW and "failed" not in self.warned:
            self.warned.add("failed")
            top = ", ".join(f"{k}: {v}" for k, v in by_status.most_common(3))
            out.append(f"sao: warning: {failed} of {failed + trained} episodes that finished in the last {WINDOW} "
                       f"steps failed ({top}; step {step}); failed episodes are not trained on and count as 0 in "
                       "held-out accuracy. audit.jsonl names each one's reason")
        return out
