"""The pacing invariant (sao/runtime/pacing.py), checked on the real async loop (`run_async`) over an
in-process backend (sao/runtime/inprocess.py): real worker hosts, engines and environment, no mocks.

What the loop must keep, whatever the timing:
  - episodes in play (issued and not dropped) <= (batches consumed + ahead + 1) * B at every submit
  - no trained trajectory is more than max_lag versions stale
  - every issued episode is trained, dropped or still pending at the end; none is trained twice
"""

import json

import pytest

from sao.config import RuntimeConfig, load_config
from sao.runtime.pacing import Pacing, batches_ahead


def test_batches_ahead_is_issue_ahead_within_max_lag_and_at_least_sync_every_minus_one():
    assert batches_ahead(RuntimeConfig(max_lag=2, issue_ahead=1)) == 1
    assert batches_ahead(RuntimeConfig(max_lag=1, issue_ahead=3)) == 1
    assert batches_ahead(RuntimeConfig(max_lag=3, issue_ahead=0, sync_every=3)) == 2


def test_room_grows_only_when_a_batch_is_consumed():
    p = Pacing(batch_size=2, ahead=1, sync_every=2)
    assert p.room() == 4  # (0 consumed + 1 ahead + 1) * 2
    p.issued = 4
    assert p.step_done(0, 0) is False and p.consumed == 1  # critic warm-up: consumed at once, nothing to publish
    assert p.step_done(0, 1) is False and p.consumed == 1 and p.unpublished == 1  # version 1: sync_every=2
    assert p.step_done(1, 2) is True and p.consumed == 3 and p.unpublished == 0
    assert p.room() == 2 * (3 + 1 + 1) - 4
    p.refunded += 1  # a dropped episode frees its place
    assert p.room() == 7


class Observed:
    """Wraps a real backend and checks, at each submit, what is in play against the bound, from what it
    sees itself: ids submitted, drops in the audit, publishes, the trainer's warm-up steps."""

    def __init__(self, backend, cfg, trainer, run_path):
        self.backend, self.cfg, self.trainer, self.run_path = backend, cfg, trainer, run_path
        self.workers = backend.workers
        self.fresh: set[str] = set()
        self.published = 0
        self.violations: list[tuple[int, int]] = []

    def bound(self) -> int:
        cfg, trainer = self.cfg, self.trainer
        warmup_done = trainer.steps_done - trainer.version  # steps that left the policy unchanged
        consumed = self.published * cfg.runtime.sync_every + warmup_done
        return (consumed + batches_ahead(cfg.runtime) + 1) * cfg.train.batch_size

    def dropped(self) -> int:
        audit = self.run_path / "audit.jsonl"
        return sum(json.loads(line)["event"] == "dropped" for line in open(audit)) if audit.exists() else 0

    def start(self, params, version):
        self.backend.start(params, version)

    def submit(self, worker, items):
        self.fresh |= {a.id for a in items}
        in_play, bound = len(self.fresh) - self.dropped(), self.bound()
        if in_play > bound:
            self.violations.append((in_play, bound))
        self.backend.submit(worker, items)

    def receive(self, timeout):
        return self.backend.receive(timeout)

    def publish(self, params, version):
        self.published += 1
        return self.backend.publish(params, version)

    def stop(self):
        self.backend.stop()


@pytest.mark.parametrize("max_lag,issue_ahead,sync_every,warmup", [(1, 1, 1, 0), (2, 0, 2, 2)])
def test_run_async_keeps_the_pacing_invariant(tmp_path, monkeypatch, max_lag, issue_ahead, sync_every, warmup):
    """The whole `sao train` (sao/runtime/train.py) with its rollout workers in this process, the backend
    observed from outside."""
    from pathlib import Path

    from sao.runtime import train as train_module
    from sao.runtime.backend import worker_specs
    from sao.runtime.inprocess import InProcessBackend
    from sao.runtime.progress import RunProgress

    monkeypatch.chdir(tmp_path)
    steps, b = 6, 4
    cfg = load_config(None, [
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
        "sft.steps=0", f"train.steps={steps}", f"train.batch_size={b}", f"critic.warmup_steps={warmup}",
        "rollout.concurrency=4", "rollout.max_turns=2", "rollout.max_action_tokens=8", "eval.every=0",
        "eval.num_tasks=4", f"runtime.max_lag={max_lag}", f"runtime.issue_ahead={issue_ahead}",
        f"runtime.sync_every={sync_every}", "output.save_every=0", "output.name=p", "model.cache_dir=cache",
        "algo.skip_uniform_rewards=false"])  # every step an actor step: the invariant counts them (conftest.TINY)
    run_path = tmp_path / "runs" / "p"
    built, observed = [], []
    real_build = train_module.build_trainer
    monkeypatch.setattr(train_module, "build_trainer", lambda *a: built.append(real_build(*a)) or built[-1])
    monkeypatch.setattr(train_module, "make_backend", lambda cfg, model_path, limits: observed.append(
        Observed(InProcessBackend(worker_specs(cfg, model_path, limits)), cfg, built[0], run_path)) or observed[-1])
    result = train_module.train(cfg, RunProgress(enabled=False))
    backend, trainer = observed[0], built[0]
    assert result.steps == steps and Path(result.run_dir).resolve() == run_path and not backend.violations
    rows = [json.loads(line) for line in open(run_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "async/lag_max" in r] == list(range(1, steps + 1))
    assert max(r["async/lag_max"] for r in rows if "async/lag_max" in r) <= max_lag
    actor_steps = steps - warmup
    assert trainer.version == actor_steps and backend.published == actor_steps // sync_every
    events: dict[str, list[str]] = {}
    for line in open(run_path / "audit.jsonl"):
        e = json.loads(line)
        events.setdefault(e["event"], []).append(e.get("id"))
    trained = events["trained"]
    assert len(trained) == len(set(trained)) == steps * b  # none twice
    # what the final checkpoint carries over is in the audit too: nothing issued is unaccounted for
    settled = set(trained) | set(events.get("dropped", [])) | set(events.get("unfinished_at_exit", []))
    settled |= set(events.get("queued_at_exit", []))
    assert set(events["issued"]) <= settled
