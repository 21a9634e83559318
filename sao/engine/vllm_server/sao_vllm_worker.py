"""A vLLM worker extension that sao's vLLM engine loads into the server (`--worker-extension-cls`).

This file runs inside the vLLM environment, not sao's: it imports only torch and vllm, and the server
finds it through PYTHONPATH (sao/engine/vllm_server/), not as part of the `sao` package.

Why it exists: vLLM's in-place `reload_weights` copies new weights into the model's parameters, but on
CPU a linear layer computes with a copy of its weight packed for the CPU GEMM kernels when the model
was loaded. A tied LM head shares its weight with the input embedding, which is reloaded, but the head
itself is not, so its packed copy keeps the OLD embedding: logits are off (0.3 on the built-in model,
7 after a large update) while everything else is new. `sao_reload` reloads, then re-ties and re-packs
every tied head from the reloaded embedding.
"""

from __future__ import annotations

import torch


def _tied_heads(model: torch.nn.Module):
    """(head, embedding) pairs for models whose LM head shares the input embedding's weight."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if not getattr(config, "tie_word_embeddings", False):
        return []
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None) or getattr(inner, "embed_in", None)
    if head is None or embed is None or not hasattr(head, "quant_method"):
        return []
    return [(head, embed)]


class SaoWorkerExtension:
    """Methods the server's workers gain; called through `/collective_rpc` (string arguments only)."""

    def sao_reload(self, weights_path: str) -> str:
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        fixed = 0
        with torch.no_grad():
            for head, embed in _tied_heads(model):
                head.weight = embed.weight
                head.quant_method.process_weights_after_loading(head)
                fixed += 1
        return f"reloaded {weights_path}; re-packed {fixed} tied head(s)"

    def sao_describe(self) -> str:
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        return repr((type(model).__name__, getattr(config, "tie_word_embeddings", None),
                     type(getattr(model, "lm_head", None)).__name__, len(_tied_heads(model))))

    def sao_checksum(self) -> str:
        """A cheap fingerprint of the served weights (tests compare it before/after an update)."""
        model = self.model_runner.get_model()
        return repr(float(sum(p.double().sum() for p in model.parameters() if p.numel())))
