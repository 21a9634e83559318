"""Built-in tiny models: a Llama- or Qwen2-architecture `transformers` model from a small config,
with the project's own character tokenizer (or a BPE learned from an environment's demonstrations).
Randomly initialized here; `sao sft` warm-starts it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from sao.models.tokenizer import build_char_tokenizer


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 384,
    max_positions: int = 512,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a randomly initialized tiny model + tokenizer (the built-in character one unless given) to
    `out_dir` in HF layout."""
    tok = tokenizer if tokenizer is not None else build_char_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"model.arch: unknown architecture {arch!r} (llama or qwen2)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, meta: bool = False):
    """A causal LM from an HF folder; a LoRA adapter folder (sao/models/lora.py) loads onto its base, merged.
    `meta`: the same model on the meta device, no weight read (a trainer rank that receives them, docs/ranks.md §1)."""
    from sao.models.lora import adapter_base, load_adapter_merged

    if adapter_base(path) is not None:
        if meta:
            return load_model(adapter_base(path), dtype, meta)
        return load_adapter_merged(path, lambda base: load_model(base, dtype))
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
