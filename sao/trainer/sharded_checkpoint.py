"""Sharded trainer checkpoints with torch.distributed.checkpoint (DCP), loadable at another rank count.

    save_sharded(learner, dir)   every rank writes its shards of actor, critic and both AdamW states;
                                 rank 0 adds `trainer.json` (step counters, guard, running-mean window).
                                 Written under `dir.tmp`, renamed into place once all ranks are done
                                 (a crash leaves the previous checkpoint whole)
    load_sharded(learner, dir)   reads them back into a learner of any rank count (1 -> 2, 2 -> 1):
                                 DCP reshards by fully qualified names, which FSDP2 leaves unchanged

Works for the one-process `Learner` (no process group) and the `DistributedLearner` alike. `full_state`
gathers whole tensors on rank 0 (e.g. for a plain HF export at the end of a run, or a test).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.utils._pytree import tree_map_only

COUNTERS = ("steps_done", "actor_version", "critic_version", "skipped_total", "consecutive_skipped")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


@contextlib.contextmanager
def _quiet():
    """DCP warns at every save/load without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _pairs(learner) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    pairs = {"actor": (learner.actor, learner.actor_opt)}
    if learner.critic_opt is not None:
        pairs["critic"] = (learner.critic, learner.critic_opt)
    return pairs


def model_state(learner) -> dict:
    """{"actor": ..., "actor_opt": ..., "critic": ..., "critic_opt": ...}: this rank's shards (DTensors
    under FSDP2), keyed by parameter names, as DCP saves and loads them."""
    state = {}
    for name, (model, opt) in _pairs(learner).items():
        state[name], state[f"{name}_opt"] = get_state_dict(model, opt)
    return state


def counters(learner) -> dict:
    out = {k: getattr(learner, k) for k in COUNTERS}
    if learner.running_mean is not None:
        out["running_mean"] = learner.running_mean.state_dict()
    return out


def save_sharded(learner, path: str | Path) -> Path:
    """Write `learner`'s models, optimizers and counters to `path` (a folder); a collective."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    with _quiet():
        dcp.save(model_state(learner), checkpoint_id=str(tmp))
    if _rank() == 0:
        (tmp / "trainer.json").write_text(json.dumps(counters(learner)))
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def load_sharded(learner, path: str | Path) -> None:
    """Restore a checkpoint written by `save_sharded` at any number of ranks; a collective."""
    path = Path(path)
    state = model_state(learner)  # this learner's layout: DCP reads each rank's part into it
    with _quiet():
        dcp.load(state, checkpoint_id=str(path))
    for name, (model, opt) in _pairs(learner).items():
        set_state_dict(model, opt, model_state_dict=state[name], optim_state_dict=state[f"{name}_opt"])
    saved = json.loads((path / "trainer.json").read_text())
    for k in COUNTERS:
        setattr(learner, k, int(saved[k]))
    if learner.running_mean is not None:
        learner.running_mean.load_state_dict(saved.get("running_mean", {}))


def full_state(learner) -> dict:
    """`model_state` with whole tensors, on rank 0 (CPU; empty dicts on the others); a collective.
    A snapshot: copies, never the optimizer's own tensors (AdamW's `step` counters would move on)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {}
    for name, (model, opt) in _pairs(learner).items():
        state[name], state[f"{name}_opt"] = get_state_dict(model, opt, options=options)
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)
