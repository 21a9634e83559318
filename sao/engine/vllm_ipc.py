"""The GPU weight transport of `engine.name=vllm`: vLLM's `ipc` weight-transfer backend over HTTP.

The engine's copy of each parameter is placed on the GPU and shared as a CUDA IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`), keyed by the GPU's UUID as vLLM's
`IPCWeightTransferEngine.receive_weights` expects; the server maps the same memory and loads it with
`model.load_weights`, so the weights cross no host memory or disk. It needs the server on the same
GPU and `VLLM_ALLOW_INSECURE_SERIALIZATION=1` on the server (the handles travel pickled in JSON);
sao sets both when it starts the server (engine.weight_transport=ipc). Requires CUDA: never used on CPU.
"""

from __future__ import annotations

import base64
import pickle

import torch


def ipc_update_info(model: torch.nn.Module) -> tuple[list[torch.Tensor], dict]:
    """(GPU tensors to keep alive until the server has loaded them, the `update_info` JSON body)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not torch.cuda.is_available():
        raise ValueError("engine.weight_transport=ipc: needs a CUDA GPU (use reload on CPU)")
    index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    names, dtypes, shapes, handles, refs = [], [], [], [], []
    for name, param in model.named_parameters():
        weight = param.detach().to(f"cuda:{index}", non_blocking=True).contiguous()
        refs.append(weight)
        names.append(name)
        dtypes.append(str(weight.dtype).split(".")[-1])
        shapes.append(list(weight.shape))
        handles.append({uuid: reduce_tensor(weight)[1]})
    torch.cuda.synchronize(index)
    info = {"names": names, "dtype_names": dtypes, "shapes": shapes,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}
    return refs, info
