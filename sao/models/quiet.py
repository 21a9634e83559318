"""transformers without its chatter: offline, no progress bars, errors only. Called once per process
that loads models (the CLI's commands, the trainer, every rollout worker, the benchmarks)."""

from __future__ import annotations

import os


def quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
