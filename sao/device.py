"""Where tensors live and at what precision: `device: auto|cpu|cuda`, `dtype: float32|bfloat16`.

Master weights always stay float32 (the optimizer state and the weights the engines receive);
`bfloat16` means autocast: matmuls run in bf16, log-softmax and losses in float32. The same code runs on
CPU (where the tests exercise it) and on CUDA; nothing requires a GPU.
"""

from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` is CUDA when a GPU is visible, else CPU; `cuda` without a GPU is an error (one line)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is visible (use device=auto or cpu)")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on `device` (CPU or CUDA); a no-op context for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def to_device(record, device: torch.device):
    """A dataclass record (e.g. a training Batch) with its tensor fields on `device` (non-tensors kept)."""
    import dataclasses

    if device is None:
        return record
    changes = {f.name: getattr(record, f.name).to(device, non_blocking=True) for f in dataclasses.fields(record)
               if isinstance(getattr(record, f.name), torch.Tensor) and getattr(record, f.name).device != device}
    return dataclasses.replace(record, **changes) if changes else record
