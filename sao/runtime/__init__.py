"""Orchestration, the one place that wires the rollout side to the trainer: the run's steps (train.py),
the run context (context.py), the loops (loop.py), pacing and the queues, checkpoints, the parity gate,
evaluation, threads, and the backends (local, ray, in-process). Map: docs/architecture.md §4."""
