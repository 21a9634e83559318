"""Orchestration: queue, staleness gate, weight sync, run directory; the `local` backend."""
