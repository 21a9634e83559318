"""Sharded trainer checkpoints with torch.distributed.checkpoint (DCP), loadable at another rank count.

    save_sharded(learner, dir)   every rank writes its shards of actor, critic and both AdamW states;
                                 rank 0 adds `trainer.json` (step counters, guard, running-mean window).
                                 Written under `dir.tmp`, renamed into place once all ranks are done
                                 (a crash leaves the previous checkpoint whole)
    load_sharded(learner, dir)   reads them back into a learner of any rank count (1 -> 2, 2 -> 1):
                                 DCP reshards by fully qualified names, which FSDP2 leaves unchanged
    by_name / by_position        a one-process AdamW state (keyed by position) to names and back
    load_one_process(learner, state)
                                 a one-rank run's checkpoint (`Learner.state_dict()`: plain AdamW states
                                 keyed by position, no shards) into N ranks (1 -> N): only rank 0 holds the
                                 file's state; it broadcasts the counters, then each AdamW tensor in turn,
                                 of which every rank keeps its shard. The weights come from the HF folders

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
    set_optimizer_state_dict,
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


def by_name(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> dict:
    """A plain `opt.state_dict()` of a one-process model (parameters numbered in the optimizer's order)
    keyed instead by the names `get_optimizer_state_dict` uses: `model`'s parameter names (first name of
    a tied weight), which FSDP2 leaves unchanged, so a one-process state fits a sharded optimizer."""
    names = {p: n for n, p in model.named_parameters()}
    order = [names[p] for g in opt.param_groups for p in g["params"]]
    if len(order) != sum(len(g["params"]) for g in state["param_groups"]):
        from sao.config import ConfigError

        raise ConfigError(f"--resume: the checkpoint's optimizer has {sum(len(g['params']) for g in state['param_groups'])} "
                          f"trained parameters, this model {len(order)} (other model or LoRA settings than the run's)")
    return {"state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def by_position(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> dict:
    """The inverse of `by_name`: a name-keyed optimizer state (`get_optimizer_state_dict`, whole tensors)
    as a one-process `opt.state_dict()` keyed by position, which any placement and rank count loads."""
    names = {p: n for n, p in model.named_parameters()}
    index = {names[p]: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def load_one_process(learner, state: dict | None = None) -> None:
    """Restore a one-process `Learner.state_dict()` into a `DistributedLearner` (1 -> N resume); a
    collective. Rank 0 passes the state (read from trainer_state.pt), every other rank None: nothing
    but rank 0 reads the file, and no rank holds more than one whole tensor beyond its shards."""
    box = [None if state is None else {k: v for k, v in state.items() if not k.endswith("_opt")}]
    dist.broadcast_object_list(box, src=0)  # the counters: a few numbers
    small = box[0]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for name, (model, opt) in _pairs(learner).items():
        full = by_name(model, opt, state[f"{name}_opt"]) if state is not None else {}
        set_optimizer_state_dict(model, opt, full, options=options)
    learner.actor_version, learner.critic_version = small["actor_version"], small["critic_version"]
    learner.steps_done = small["steps_done"]
    learner.load_guard_state(small.get("guard", {}))
    if learner.running_mean is not None and small.get("running_mean"):
        learner.running_mean.load_state_dict(small["running_mean"])
