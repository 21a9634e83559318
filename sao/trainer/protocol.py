"""The trainer seam: what the runtime (sao/runtime/) may ask of a trainer, and nothing more.

    step(batch) -> metrics          one optimizer step on B finished trajectories (docs/algorithm.md §5);
                                    with batch.trace_rows > 0, metrics["trace"] holds the per-token
                                    records of those rows (sao/trainer/trace.py), gathered from every rank
    export_weights() -> tensors     full actor weights in the engines' parameter order, for publishing (a
                                    sequence of tensors; Ray trainer ranks: `RemoteWeights`, also a reference
                                    to the flat buffer in the object store that a Ray backend forwards)
    logprobs(batch)                 the current actor's log-probs of a batch (the parity gate)
    state_dict() / load_state_dict  optimizer states and counters, for checkpoints (weights travel as
                                    HF folders through save_pretrained)
    version                         the policy version (actor optimizer steps) engines and tokens carry
    looks_ahead / look_ahead(batch) a trainer whose critic runs on its own process takes the next batch
                                    early and starts its critic on it (sao/trainer/critic_ranks.py)
    close()                         stop the processes the trainer started (ranks, a critic); idempotent
    before_pass                     a hook the async loop may set, called before each model pass in this
                                    process (sao/runtime/threads.py); None by default

The one-process implementation is `sao.trainer.learner.Learner`; at trainer.ranks > 1 it is
`sao.trainer.ranks.RankDriver`, composed with the ranks it commands: `LocalRanks` (this process is rank 0,
the others follow) or, with runtime.backend=ray, `sao.trainer.ray_ranks.RayRanks` (every rank a Ray
actor). The runtime never reaches into
a trainer's models or optimizers, so the loop is the same at 1 and N ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from sao.trainer.batch import Batch


class Trainer(Protocol):
    before_pass: Callable[[], None] | None

    @property
    def version(self) -> int: ...

    def step(self, batch: Batch) -> dict[str, float]: ...

    def export_weights(self) -> list[torch.Tensor]: ...

    def logprobs(self, batch: Batch) -> torch.Tensor: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def save_pretrained(self, folder: Path, tokenizer, merged: bool = False) -> None: ...

    @property
    def looks_ahead(self) -> bool: ...

    def look_ahead(self, batch: Batch) -> None: ...

    def close(self) -> None: ...
