"""Tokenizers, tiny-model builders, actor log-probs, the critic and checkpoint I/O."""
