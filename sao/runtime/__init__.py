"""Orchestration, the one place that wires the rollout side to the trainer: the run's steps (train.py),
the loops (loop.py) with their batch sources (source.py) and step sink (sink.py),
checkpoints (saver.py gathers, checkpoint.py writes), pacing and the queues, the parity gate,
evaluation, threads, and the backends (local, ray, in-process). Map: docs/architecture.md §4."""
