"""Thread counts and the OpenMP wait policy of every phase, decided here and nowhere else
(docs/performance.md).

On a few cores, decoding a small model is overhead-bound (one thread decodes as fast as two) while
training nearly doubles with a second thread. So:

    phase                       torch intra-op threads
    setup (SFT, building)       trainer_threads + rollout_threads   nothing else runs yet
    sync: generate              rollout_threads                     decoding
    sync: train                 trainer_threads + rollout_threads   nothing else runs
    async: train                trainer_threads, or every core while no local worker has an episode in
                                flight (`AdaptiveThreads`; it reads the workers' shared counters, never
                                receives)
    evaluate                    max(trainer_threads, rollout_threads)
    rollout worker              rollout_threads                     (sao/runtime/worker_host.py)

OpenMP wait policy: GNU OpenMP threads spin ~300k iterations after a parallel region by default. That
is fastest when nothing else wants the core, and it takes CPU from the rollout workers when the
trainer shares cores with them. `wait_policy` picks PASSIVE only for async runs (trainer and workers
share the machine) and leaves OpenMP's default (active spinning) elsewhere: `--sync`, `sao sft`, eval.
It is read once, when torch loads OpenMP, so `set_wait_policy` runs before torch is imported; a user's
own OMP_WAIT_POLICY always wins. An async run that has to build its SFT model first does it in a
spawned child that spins (`spinning_env`): nothing else runs yet, and spinning SFT is ~1.3x faster.
"""

from __future__ import annotations

import os
import time

from sao.config import RuntimeConfig


def _set(n: int) -> None:
    import torch  # here, not at the top: set_wait_policy must run before torch is first imported

    torch.set_num_threads(n)


def wait_policy(mode: str) -> str | None:
    """PASSIVE where the trainer shares cores with rollout work (async), else None (OpenMP's default)."""
    return "PASSIVE" if mode == "async" else None


_SET_HERE: str | None = None  # the policy set_wait_policy put into os.environ (not the user's own)


def set_wait_policy(mode: str) -> None:
    global _SET_HERE
    policy = wait_policy(mode)
    if policy is not None and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = _SET_HERE = policy


def spinning_env() -> dict[str, str] | None:
    """The environment of a child process that trains alone before the run starts (the SFT build,
    sao/runtime/model_setup.py): this process's, without the PASSIVE policy set_wait_policy chose for
    the async trainer, which makes SFT ~1.3x slower. None when this process spins already (sync, sao sft)
    or the policy is the user's own."""
    if _SET_HERE is None or os.environ.get("OMP_WAIT_POLICY") != _SET_HERE:
        return None
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


class ThreadPlan:
    def __init__(self, r: RuntimeConfig):
        self.trainer, self.rollout = r.trainer_threads, r.rollout_threads
        self.all = r.trainer_threads + r.rollout_threads

    def setup(self) -> None:
        _set(self.all)

    def generate(self) -> None:
        _set(self.rollout)

    def train_alone(self) -> None:
        """Training while nothing else runs (sync mode, critic pretraining)."""
        _set(self.all)

    def train(self) -> None:
        """Training beside the rollout workers (async)."""
        _set(self.trainer)

    def evaluate(self) -> None:
        _set(max(self.trainer, self.rollout))


class AdaptiveThreads:
    """Called before each model pass of an async step: the trainer takes the local workers' cores while
    none of them has an episode in flight (they are paced or idle), and its own threads while one does.
    `end_step()` once per step: back to the trainer's own threads, and the share of time at max."""

    def __init__(self, backend, own: int, idle: int):
        import torch

        self.backend, self.own, self.idle = backend, own, idle
        self.current = torch.get_num_threads()
        self.since = time.perf_counter()
        self.time_at = {own: 0.0, idle: 0.0}

    def _set(self, n: int) -> None:
        now = time.perf_counter()
        self.time_at[self.current] = self.time_at.get(self.current, 0.0) + now - self.since
        self.since = now
        if n != self.current:
            _set(n)
            self.current = n

    def __call__(self) -> None:
        self._set(self.own if self.backend.in_flight() else self.idle)

    def end_step(self) -> dict[str, float]:
        self._set(self.own)
        total = sum(self.time_at.values()) or 1.0
        out = {"perf/trainer_all_cores_frac": self.time_at.get(self.idle, 0.0) / total}
        self.time_at = {self.own: 0.0, self.idle: 0.0}
        return out


def adaptive_threads(r: RuntimeConfig, backend, log) -> AdaptiveThreads | None:
    """The policy for a backend whose workers share this machine's cores and report what is in flight."""
    if not r.adaptive_threads or not callable(getattr(backend, "in_flight", None)):
        return None
    idle = r.trainer_threads + r.rollout_threads * r.rollout_workers
    log(f"adaptive threads: trainer {r.trainer_threads} ({idle} with no episode in flight), "
        f"workers {r.rollout_threads} each")  # under 80 columns: rich would wrap it mid-sentence
    return AdaptiveThreads(backend, r.trainer_threads, idle)
