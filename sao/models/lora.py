"""LoRA adapters (peft) on the actor and the critic, and the merged weights engines receive.

With `model.lora.r > 0` the actor is a `peft` model: the base weights are frozen and only the
adapters train (the optimizer holds adapter states only). Engines never see adapters: they run the
plain architecture, and `engine_parameters(actor)` hands them `W + (alpha/r)·B·A` for every adapted
layer, in the order of the plain model's `parameters()`, so the weight transport, the rollout
process and the parity gate work unchanged (docs/architecture.md §5). With `critic.lora.r > 0` the
critic trains adapters plus its value head (`score`).

Checkpoints: a peft model's `save_pretrained` writes the adapter (`adapter_config.json`,
`adapter_model.safetensors`); `load_model` below loads such a folder onto its base model and merges
it, so `sao eval` takes adapter checkpoints too; `save_merged_model` writes a full HF folder on request.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from sao.config import LoraSettings


def lora_config(settings: LoraSettings, value_head: bool = False):
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        # the critic's value head is new and small: it trains in full and is saved with the adapter
        modules_to_save=["score"] if value_head else None,
        # never put an adapter on the output layers (lm_head for the actor, score for the critic)
        exclude_modules=["lm_head", "score"],
    )


def with_lora(model: torch.nn.Module, settings: LoraSettings, value_head: bool = False) -> torch.nn.Module:
    """`model` unchanged when `settings.r == 0`, else a peft model whose adapters alone train."""
    if settings.r == 0:
        return model
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config(settings, value_head))
    base = peft_model.peft_config["default"].base_model_name_or_path
    if base and Path(base).is_dir():  # an adapter checkpoint must find its base from any working directory
        peft_model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    return peft_model


def resume_lora(base: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """A checkpoint's adapter (and saved value head) on its base model, trainable again: the same
    modules in the same order as `with_lora` built them, so the optimizer state saved with it applies."""
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings():  # a base on the meta device (a trainer rank that receives weights) gets none
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
        return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)


def load_lora_critic(adapter_dir: str | Path, device=None, meta: bool = False) -> torch.nn.Module:
    """A LoRA critic saved by a run or by `sao pretrain-critic`: its base (given a value head), then the
    adapters and the trained value head on top, trainable. `meta`: its structure only, on the meta device."""
    from sao.models.critic import load_critic

    base = load_critic(adapter_base(adapter_dir), meta=meta)
    return resume_lora(base.to(device) if device is not None else base, adapter_dir)


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def engine_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights an engine loads, in the order of the plain architecture's `parameters()`.

    A plain model: its parameters. A peft model: every base parameter, with each adapted layer's
    weight merged (`W + delta`, computed without autograd); adapter tensors themselves are left out.
    """
    if not is_peft(model):
        return list(model.parameters())
    base = model.get_base_model()
    modules = dict(base.named_modules())
    out = []
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_" in name or ".modules_to_save." in name:
                continue
            if ".base_layer." in name and name.endswith(".weight"):
                layer = modules[name.rsplit(".base_layer.", 1)[0]]
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
                out.append(p + delta)
            else:
                out.append(p)
    return out


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def save_merged_model(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """Write a peft model's merged weights as a plain HF folder (the model in training is untouched)."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(out_dir)
    return Path(out_dir)


def adapter_base(path: str | Path) -> str | None:
    """The base model folder an adapter folder was trained on, or None for a plain model folder."""
    f = Path(path) / "adapter_config.json"
    return json.loads(f.read_text()).get("base_model_name_or_path") if f.is_file() else None


def load_adapter_merged(path: str | Path, loader) -> torch.nn.Module:
    """An adapter folder loaded onto its base model (`loader(base_path)`), merged into plain weights."""
    from peft import PeftModel

    base = loader(adapter_base(path))
    return PeftModel.from_pretrained(base, str(path)).merge_and_unload()
