"""`sao bench EXPERIMENT`: algorithms side by side on the same tasks, seeds and budget (docs/benchmarks.md)."""
