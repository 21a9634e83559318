"""The parity gate: engine and trainer log-probs agree on the same tokens and weights (step 2 of
sao/runtime/train.py), and the live check on the engine that actually samples (vLLM included).

Training on log-probs that drift from the sampler's is silently wrong (docs/algorithm.md §3), so
a run refuses to start, or to go on, when they differ by more than runtime.parity_tol.
"""

from __future__ import annotations

import collections
import itertools

from sao.config import Config
from sao.errors import RunStopped
from sao.runtime.episodes import PolicyCopy, generate_batch
from sao.trainer.batch import collate
from sao.types import SamplingParams


class ParityError(RunStopped):
    """Engine and trainer disagree on log-probs: training on such data would be silently wrong."""


def parity_check(trainer, engine, codec, environment, limits, tol: float, n: int = 16) -> float:
    """Max |engine log-prob - trainer log-prob| over n sampled episodes' action tokens; raises above `tol`.

    `engine` serves a separate model instance that received the trainer's weights as the flat buffer
    every backend publishes (sao/runtime/episodes.py PolicyCopy), so the check covers weight transfer
    as well as numerics.
    """
    tasks = itertools.cycle(environment.eval_tasks(n))  # a small held-out set may hold fewer than n
    every = generate_batch(engine, environment, codec, tasks, limits, n, SamplingParams())
    trajs = [t for t in every if t.num_action_tokens]
    if not trajs:  # e.g. a prompt longer than rollout.max_episode_tokens: nothing to compare, nothing to train
        why = collections.Counter(f"{t.status.value}: {t.status_reason}"[:120] for t in every).most_common(1)
        raise ParityError(f"parity gate: none of {len(every)} episodes sampled a token ({why[0][0] if why else 'none ran'})")
    batch = collate(trajs, codec.tokenizer.pad_token_id)
    logprobs = trainer.logprobs(batch).to(batch.behavior_logprobs.device)
    diff = float(((logprobs - batch.behavior_logprobs).abs() * batch.action_mask).max())
    if not diff <= tol:
        raise ParityError(f"parity gate: engine and trainer log-probs differ by {diff:.2e} "
                          f"> runtime.parity_tol={tol:g}; refusing to train")
    return diff


def gate(cfg: Config, trainer, policy: PolicyCopy, codec, environment, limits) -> float:
    """Step 2 of a run: the built-in engine, on a copy given the trainer's weights, against the trainer."""
    policy.load(trainer.export_weights())
    engine = policy.engine(codec.tokenizer.pad_token_id, max_batch=16, seed=cfg.train.seed)
    return parity_check(trainer, engine, codec, environment, limits, cfg.runtime.parity_tol)


class LiveParity:
    """The step-2 gate runs the torch engine; another engine (vLLM) is gated here instead, on the first
    batch holding tokens it sampled with the weights the trainer holds (usually step 1)."""

    def __init__(self, cfg: Config):
        self.engine, self.tol = cfg.engine.name, cfg.runtime.parity_tol
        self.checked = self.engine == "torch"

    def __call__(self, metrics: dict) -> None:
        diff = metrics.get("parity/live_max_abs_diff")
        if diff is None or self.checked:
            return
        self.checked = True
        if not diff <= self.tol:
            raise ParityError(f"parity gate: engine.name={self.engine} and trainer log-probs differ by {diff:.2e} "
                              f"on {int(metrics['parity/live_tokens'])} tokens of the same weights "
                              f"> runtime.parity_tol={self.tol:g}; refusing to train on")
