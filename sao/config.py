"""Typed, validated run configuration: YAML files plus dotted overrides (`algo.eps_high=3.0`).

One pydantic model per component; every field is documented and validated; unknown keys are
errors (with a "did you mean" suggestion). `load_config` turns any problem into a `ConfigError` whose
message is one line naming the field or file, which the CLI prints before exiting with code 2.
`sao config` lists every key (sao/config_help.py). A loaded config remembers where each value came
from (`value_sources`: default, file, override, or api for values set in Python), and `to_yaml`
writes that next to each value in the run's config.yaml.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator


class ConfigError(ValueError):
    """A bad config value, unknown key or missing file; the message is one line."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSettings(Section):
    r: int = Field(0, ge=0, description="LoRA rank; 0 = off (train every weight)")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (delta = alpha/r * B @ A)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (0 keeps the trainer's log-probs exact for DIS)")
    target_modules: list[str] | str = Field("all-linear", description=(
        "module names that get adapters (e.g. [q_proj, v_proj]), or all-linear"))
    save_merged: bool = Field(False, description="checkpoints also hold the merged model (actor_merged/)")


class ModelConfig(Section):
    path: str | None = Field(None, description="local HF model directory; empty = built-in tiny model")
    lora: LoraSettings = Field(default_factory=LoraSettings, description=(
        "train LoRA adapters on the actor (peft); the engine receives merged weights"))
    arch: Literal["llama", "qwen2"] = Field("llama", description="built-in tiny model architecture")
    hidden_size: int = Field(96, ge=8, description="built-in model width")
    num_layers: int = Field(2, ge=1, description="built-in model depth")
    num_heads: int = Field(3, ge=1, description=(
        "built-in model attention heads; head_dim = hidden_size / num_heads = 32 by default, a size vLLM's CPU "
        "attention accepts (it rejects e.g. 24), so the default model runs on both engines"))
    intermediate_size: int = Field(256, ge=8, description="built-in model MLP width")
    max_positions: int = Field(512, ge=32, description="built-in model context length")
    tokenizer: Literal["char", "bpe"] = Field("char", description=(
        "built-in model tokenizer: char (one token per character) or bpe (a byte-level BPE of bpe_vocab_size "
        "tokens learned from the environment's training demonstrations, words as one token each: episodes ~4x "
        "shorter)"))
    bpe_vocab_size: int = Field(1024, ge=384, le=65536, description=(
        "model.tokenizer=bpe: vocabulary size, the 256 bytes and special tokens included (fewer when the demonstrations repeat "
        "too little to learn more merges)"))
    cache_dir: str = Field(".sao_cache", description="where built and SFT-warm-started models are cached")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.tokenizer == "bpe" and self.arch == "qwen2":
            # AutoTokenizer rebuilds a Qwen2 folder's BPE with Qwen2's own pre-tokenizer: other tools (vLLM)
            # would split text into other tokens than sao does
            raise ValueError("tokenizer=bpe needs arch=llama (AutoTokenizer splits a qwen2 folder's BPE differently)")
        return self


class SFTConfig(Section):
    steps: int = Field(1500, ge=0, description="SFT optimizer steps on synthetic solved episodes")
    batch_size: int = Field(64, ge=1, description="episodes per SFT step")
    lr: float = Field(5e-3, gt=0, description="SFT peak learning rate (cosine decay, short warm-up)")
    seed: int = Field(0, description="seed of the demonstrations and of the model's initialization")
    pack: bool = Field(True, description=(
        "pack each step's examples into rows (several per row, attention kept within each): cost follows real "
        "tokens; false = one right-padded batch (same loss, slower)"))


class EnvConfig(Section):
    name: str = Field("calc", description="registered environment name, or module:Class")
    options: dict[str, Any] = Field(default_factory=dict, description="environment-specific options")


class RolloutConfig(Section):
    max_turns: int = Field(4, ge=1, description="assistant turns per episode before truncation")
    max_action_tokens: int = Field(24, ge=1, description="tokens per assistant turn")
    max_episode_tokens: int = Field(256, ge=8, description="total tokens per trajectory")
    step_timeout_s: float = Field(30.0, gt=0, description="limit on one environment step (async envs)")
    concurrency: int = Field(64, ge=1, description="episodes in flight in the rollout worker")
    temperature: float = Field(1.0, ge=0, description="must be 1 for training (DIS, docs/algorithm.md §3)")
    top_p: float = Field(1.0, gt=0, le=1, description="must be 1 for training")
    top_k: int = Field(0, ge=0, description="must be 0 (off) for training")

    @model_validator(mode="after")
    def _exact(self) -> RolloutConfig:
        if (self.temperature, self.top_p, self.top_k) != (1.0, 1.0, 0):
            raise ValueError(
                "training samples at temperature 1, top_p 1, top_k 0: DIS needs the log-prob of the "
                "distribution actually sampled from (docs/algorithm.md §3)"
            )
        return self


class AlgoConfig(Section):
    name: str = Field("sao", description="algorithm from the registry (sao, grpo, grpo_dis, vapo, ...)")
    eps_low: float = Field(0.3, gt=0, le=1, description="DIS keeps tokens with ratio > 1 - eps_low")
    eps_high: float = Field(5.0, gt=0, description="DIS keeps tokens with ratio < 1 + eps_high")
    ppo_eps_low: float = Field(0.2, gt=0, le=1, description="PPO clip, lower side (grpo, vapo)")
    ppo_eps_high: float = Field(0.28, gt=0, description="PPO clip-higher, upper side (grpo, vapo)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount")
    lam_alpha: float = Field(1.5, gt=0, description="length-adaptive lambda_policy = 1 - 1/(alpha*l)")
    whiten_advantages: bool = Field(True, description=(
        "batch-whiten critic-based (GAE) actor advantages over action tokens; group and running-mean "
        "advantages are always used as computed (whitening would turn a running mean into a batch mean)"))
    whiten_min_std: float = Field(0.05, ge=0, description=(
        "floor of the std that whitening divides by: a batch whose raw advantages spread less (e.g. every "
        "reward equal, only critic noise left) keeps its small scale instead of being blown up to unit "
        "scale; with rewards in [0, 1] healthy batches spread far more (docs/algorithm.md §4)"))
    skip_uniform_rewards: bool = Field(True, description=(
        "critic-based algorithms: no actor update on a batch whose rewards are all equal (the critic still "
        "learns): its advantages are only the critic's error, and Adam turns that noise into full-size "
        "steps; on a solved task they broke the policy within 3 steps (docs/algorithm.md §4)"))
    max_token_lag: int | None = Field(None, ge=0, description=(
        "per-token staleness bound, every algorithm: action tokens sampled more than this many policy versions "
        "before the one being trained get no policy gradient (their advantage is zeroed; they stay in the "
        "token-mean denominator, as DIS's masked tokens do), counted in lag/masked_token_frac; none: no bound "
        "(runtime.max_lag bounds whole trajectories)"))
    entropy_coef: float = Field(0.0, ge=0, description=(
        "entropy bonus on action tokens; the paper uses none (0). Opt-in for settings where a tiny policy "
        "saturates and can no longer explore, e.g. the style_shift online benchmark"))
    group_size: int = Field(8, ge=2, description=(
        "rollouts per prompt for group algorithms (grpo, grpo_dis); train.batch_size must be a multiple"))
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch for PPO-loss algorithms (grpo, vapo)")
    ppo_minibatches: int = Field(4, ge=1, description=(
        "actor updates per pass for PPO-loss algorithms; pi_old is computed once before them, so from the "
        "second update on the ratio moves away from 1 and the clip acts; must divide train.batch_size"))
    step_value: Literal["state", "mean", "last"] = Field("state", description=(
        "sao_step_gae: a turn's value is that of the state it starts from (state), the mean over its action "
        "tokens (mean), or the value before its last action token (last: has seen the action; no signal)"))
    running_mean_window: int = Field(8, ge=1, description="rewards averaged by the running-mean baseline")
    pact_weight_clip: float = Field(2.0, gt=0, description=(
        "pact: the critic's per-token importance weight pi_new / pi_rollout is clipped to at most this"))
    ntf_keep: float = Field(0.1, gt=0, le=1, description=(
        "crf_ntf: the share of a failed episode's action tokens (per row, those with the lowest rollout "
        "log-prob) that keep their negative advantage in the loss; the rest are filtered out"))
    running_mean_per_prompt: bool = Field(True, description=(
        "running mean per prompt, keyed by the prompt's tokens (else one global window of all rewards)"))


class CriticConfig(Section):
    lr: float = Field(1e-3, gt=0, description="critic learning rate")
    updates_per_step: int = Field(2, ge=1, description="K critic optimizer steps per actor step (TTUR)")
    warmup_steps: int = Field(10, ge=0, description="first optimizer steps update the critic only")
    freeze_attention: bool = Field(True, description="freeze the critic's attention projections")
    freeze_pattern: str = Field(r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.", description="regex of frozen params")
    grad_clip: float = Field(10.0, gt=0, description="critic gradient-norm clip (1.0 starves it)")
    value_clip: float | None = Field(None, gt=0, description="optional PPO-style value clipping")
    warn_low_ev_steps: int = Field(50, ge=0, description=(
        "warn once when critic/explained_variance stays below 0.05 for this many steps in a row with varying "
        "rewards after warm-up: the critic is then only a batch-mean baseline (docs/performance.md); 0 = never"))
    path: str | None = Field(None, description=(
        "start the critic from this folder: a pretrained critic (sao pretrain-critic) or another, e.g. smaller, "
        "causal LM with the actor's tokenizer (a zero value head is added)"))
    lora: LoraSettings = Field(default_factory=LoraSettings, description=(
        "train LoRA adapters (plus the value head) on the critic instead of every weight"))
    depth: float = Field(0.25, gt=0, le=1, description=(
        "build the critic from the actor's first ceil(depth x L) of its L decoder layers (at least 1; the others "
        "are not loaded): each critic pass costs about that share of an actor pass. 1 = the paper's critic, the "
        "actor's whole architecture; the default 0.25 departs from the paper for speed (docs/algorithm.md §5). "
        "A saved critic (a checkpoint's, or a pretrained one) keeps its depth"))
    num_layers: int | None = Field(None, ge=1, description=(
        "the critic's decoder layers as a count, instead of critic.depth (the actor's first N)"))
    placement: Literal["colocated", "separate"] = Field("colocated", description=(
        "colocated: the critic trains in the trainer's process, before each actor step (the paper's sequence); "
        "separate: on its own process, one batch ahead, so its K updates and v2 for batch n+1 overlap the "
        "actor's step on batch n (same math, lag one more; docs/ranks.md §2)"))
    threads: int = Field(1, ge=1, description="critic.placement=separate: torch threads of each critic process")
    ranks: int = Field(1, ge=1, description=(
        "critic.placement=separate: the critic's processes (with runtime.backend=ray: Ray actors placed like the "
        "trainer's rank actors); M > 1 shards it with FSDP2 over M data-parallel ranks of its own process group "
        "(gloo on CPU, NCCL on GPU; the math equals one process; docs/ranks.md §2)"))


class TrainConfig(Section):
    steps: int = Field(300, ge=1, description="optimizer steps (critic warm-up steps included)")
    batch_size: int = Field(32, ge=1, description="finished trajectories per optimizer step (B)")
    lr: float = Field(5e-4, gt=0, description="actor learning rate")
    grad_clip: float = Field(1.0, gt=0, description="actor gradient-norm clip")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay for actor and critic")
    seed: int = Field(0, description="seed of task order, sampling and training")
    pack: bool = Field(True, description=(
        "run the trainer's model passes on packed rows (several trajectories per row, attention kept "
        "within each): cost follows real tokens; false = right-padded batch (same numbers, slower)"))
    max_nonfinite_steps: int = Field(5, ge=1, description=(
        "stop the run after this many optimizer steps in a row skipped an update for a non-finite "
        "loss or gradient (each such update is skipped and counted in guard/skipped_updates)"))


class RuntimeConfig(Section):
    backend: Literal["local", "thread", "ray"] = Field("local", description=(
        "local: worker processes on this machine (shared memory); thread: workers as threads of the trainer's "
        "process (async with the least memory; they share its GIL); ray: workers and queue as Ray actors "
        "(pip install 'sao[ray]')"))
    mode: Literal["async", "sync"] = Field("async", description="async overlap, or sync: generate then train")
    rollout_workers: int = Field(1, ge=1, description="rollout workers, each with its own engine and episode slots")
    max_lag: int = Field(2, ge=0, description=(
        "staleness bound in policy versions: trajectories older than this are dropped at dequeue; pacing "
        "keeps at most (issue_ahead + 1) batches in flight, issue_ahead <= max_lag (sao/runtime/pacing.py)"))
    issue_ahead: int = Field(1, ge=0, description=(
        "batches the rollout side may run ahead of the trainer (capped by max_lag, at least sync_every - 1); "
        "when the trainer is the bottleneck every batch is this many versions stale, and one batch ahead "
        "already keeps it fed (docs/performance.md)"))
    sync_every: int = Field(1, ge=1, description="publish weights every this many actor steps (<= max_lag + 1)")
    rollout_threads: int = Field(1, ge=1, description="torch intra-op threads of each rollout worker")
    trainer_threads: int = Field(1, ge=1, description="torch intra-op threads of the trainer")
    adaptive_threads: bool = Field(True, description=(
        "local backend: the trainer also takes the rollout workers' threads while none of them has an "
        "episode in flight (they are paced or idle), and its own trainer_threads while one does"))
    rollout_only: bool = Field(False, description=(
        "benchmarks, async only: each batch of B finished trajectories is counted as a step and dropped, "
        "with no model pass and no update (the policy stays the starting one): the rollout side's own time "
        "for the same trajectories, the generation-only bound that async wall-clock is compared with"))
    parity_tol: float = Field(1e-4, gt=0, description="max |engine - trainer| log-prob at step 0")
    receive_timeout_s: float = Field(300.0, gt=0, description=(
        "stop the run with a message when no trajectory arrives for this long"))
    failure_window: int = Field(100, ge=10, description=(
        "the last this many finished episodes are watched: when more than half failed (any status but ok / "
        "truncated) the run warns once (sao/runtime/rollout_watch.py)"))
    max_failed_frac: float = Field(0.9, gt=0, le=1, description=(
        "stop the run in one line naming the top reason when more than this fraction of the last "
        "failure_window finished episodes failed (1 = never stop)"))
    ray_address: str | None = Field(None, description="ray: join this cluster (e.g. 'auto'); empty = start a local one")
    ray_connect_timeout_s: float = Field(30.0, gt=0, description=(
        "ray: a cluster must answer at ray_address within this long, else the run is refused before it starts"))
    ray_num_cpus: int | None = Field(None, ge=1, description="ray: CPUs of the local cluster (default: all)")
    ray_object_store_mb: int = Field(256, ge=64, description="ray: object store size of the local cluster in MiB")
    worker_num_cpus: float = Field(1.0, ge=0, description="ray: CPUs reserved per rollout worker actor")
    worker_num_gpus: float = Field(0.0, ge=0, description="ray: GPUs reserved per rollout worker actor")


class EngineConfig(Section):
    name: Literal["torch", "vllm"] = Field("torch", description=(
        "rollout engine: torch (built-in, in process) or vllm (a vLLM server, started by sao or at engine.url)"))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "where the torch engines run (rollout workers, evaluation, the parity gate): auto = CUDA when a GPU "
        "is visible, else CPU; the trainer's models go to trainer.device"))
    dtype: Literal["float32", "bfloat16"] = Field("float32", description=(
        "compute precision: bfloat16 = autocast with float32 master weights (trainer, torch engine; "
        "vllm: the server's --dtype)"))
    kv_reuse: bool = Field(True, description="torch engine: keep each episode's KV cache across its turns")
    recompute_after_swap: bool = Field(False, description=(
        "torch engine: re-prefill an episode whose kept KV cache was computed by older weights "
        "(default: reuse it; the cache then mixes versions, docs/engines.md)"))
    url: str | None = Field(None, description="vllm: an already running server (http://host:port); sao starts none")
    python: str = Field(".venv-vllm/bin/python", description=(
        "vllm: the Python of the vLLM environment that sao starts the server with (bash scripts/install.sh vllm)"))
    server_args: list[str] = Field(default_factory=list, description="vllm: extra arguments for the server sao starts")
    weight_transport: Literal["reload", "ipc"] = Field("reload", description=(
        "vllm: how new weights reach the server: reload (safetensors on /dev/shm, works on CPU) or ipc "
        "(CUDA IPC handles, a server on the trainer's GPU node); NCCL broadcast across nodes is not built yet"))
    startup_timeout_s: float = Field(300.0, gt=0, description="vllm: wait this long for a started server to be healthy")
    request_timeout_s: float = Field(600.0, gt=0, description="vllm: limit on one generate request")
    max_restarts: int = Field(3, ge=0, description="vllm: restarts of a dead server sao started before giving up")


class TrainerConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "where the trainer's actor and critic live: auto = CUDA when a GPU is visible, else CPU "
        "(the torch engines follow engine.device, so the two can differ)"))
    ranks: int = Field(1, ge=1, description=(
        "trainer processes: N > 1 shards actor and critic with FSDP2 over N data-parallel ranks that sao "
        "starts itself (gloo on CPU, NCCL on GPU; docs/ranks.md §1); the math equals one process"))
    timeout_s: float = Field(600.0, gt=0, description=(
        "trainer.ranks > 1: bound on every collective; a rank that hangs or dies stops the run within it "
        "(runtime.backend=ray: also the wait for the cluster to place the ranks)"))
    ray_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "runtime.backend=ray, trainer.ranks > 1 or a separate critic: Ray placement-group strategy of the rank "
        "actors (one bundle per rank; the critic's ranks are a group of their own): PACK = as few nodes as fit "
        "(fast intra-node collectives), STRICT_SPREAD = one node each"))
    rank_num_cpus: float = Field(1.0, ge=0, description=(
        "runtime.backend=ray: CPUs reserved per trainer rank actor (and per critic rank actor)"))
    rank_num_gpus: float = Field(0.0, ge=0, description=(
        "runtime.backend=ray: GPUs per trainer (and critic) rank actor (1 on a GPU cluster: the ranks then use NCCL)"))

    @model_validator(mode="after")
    def _bundle(self) -> TrainerConfig:
        if self.rank_num_gpus and (self.rank_num_gpus < 1 or self.rank_num_gpus % 1):
            raise ValueError("rank_num_gpus must be 0 or a whole number of GPUs (NCCL needs a GPU per rank)")
        if not self.rank_num_cpus and not self.rank_num_gpus:
            raise ValueError("rank_num_cpus and rank_num_gpus are both 0: a rank actor must reserve something")
        return self


class EvalConfig(Section):
    every: int = Field(50, ge=0, description="evaluate every this many steps (0: only start and end)")
    num_tasks: int = Field(200, ge=1, description="held-out tasks per evaluation")
    greedy: bool = Field(False, description="greedy decoding (default: sample at temperature 1, seeded)")


class OutputConfig(Section):
    root: str = Field("runs", description="parent directory of run directories")
    name: str | None = Field(None, description="run directory name (default: algo-env-timestamp)")
    save_every: int = Field(50, ge=0, description=(
        "checkpoint every this many steps, so a SIGKILL, OOM or reboot loses at most this many "
        "(0: only at the end and on Ctrl-C/SIGTERM)"))
    keep_checkpoints: int = Field(2, ge=0, description=(
        "periodic checkpoints kept (the newest; older step_N are deleted once a newer one is complete); "
        "checkpoints/final is always kept; 0: keep all"))
    trajectories_every: int = Field(10, ge=1, description="write sample trajectories every this many steps")
    trajectories_per_dump: int = Field(4, ge=1, description="trajectories written per dump")
    trace_trajectories: int = Field(2, ge=0, description=(
        "of each dump's trajectories, how many also get what the trainer computed per action token "
        "(log-prob, ratio, DIS mask, V before/after the critic's update, return, advantage) in "
        "traces/step_N.jsonl, read by `sao view` (0: none)"))
    progress: bool = Field(True, description="show a live progress bar")
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"], description=(
            "trackers that receive the metrics.jsonl rows (same names): tensorboard, wandb, trackio"))
    project: str = Field("sao", description="wandb / trackio project name (the run name is the run directory's)")
    wandb_mode: Literal["offline", "online"] = Field("offline", description=(
        "wandb writes RUN/wandb/ offline (wandb sync uploads it later); online needs a network and a login"))


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    # dotted key -> "file" or "override", filled by load_config; see value_sources
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)
    _file: str | None = PrivateAttr(None)


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the configuration, e.g. `algo.eps_high`, `model.lora.r`."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out += config_keys(field.annotation, key + ".") if _is_section(field.annotation) else [key]
    return out


def did_you_mean(key: str, known: list[str]) -> str:
    """'; did you mean x?' for the closest known spelling, or '' when nothing is close."""
    tail = key.rpartition(".")[2]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    close = close or [k for k in known if difflib.get_close_matches(tail, [k.rpartition(".")[2]], cutoff=0.8)][:1]
    return f"; did you mean {close[0]}?" if close else ""


def _first_error(exc: ValidationError, prefix: str = "") -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
        if not prefix:
            msg += did_you_mean(loc, config_keys() if "." in loc else list(Config.model_fields))
    where = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "config"
    return f"{where}: {msg}"


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {key!r}: empty key segment")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. algo.eps_high=3.0 (keys: sao config)")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | dict | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file (or a dict of sections, from Python) <- dotted overrides; raises ConfigError
    with a one-line message."""
    tree: dict = {}
    origin = "file"
    if isinstance(path, dict):
        tree, origin, path = path, "api", None
    elif path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r}: not found")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", None)
            where = f" at line {line + 1}" if line is not None else ""
            raise ConfigError(f"config file {str(p)!r}: invalid YAML{where}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping")
    extra = parse_overrides(overrides or [])
    sources = {**dict.fromkeys(_leaves(tree), origin), **dict.fromkeys(_leaves(extra), "override")}
    try:
        cfg = Config(**_deep_merge(tree, extra))
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None
    cfg._sources, cfg._file = sources, (str(path) if path is not None else None)
    return cfg


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out += _leaves(v, key + ".") if isinstance(v, dict) and v else [key]
    return out


def value_sources(cfg: Config) -> dict[str, str]:
    """Dotted key -> where its value came from: default, file, override, or api (set in Python).

    Keys of `env.options` appear one by one (`env.options.max_digits`); an empty options dict is
    `env.options`."""
    return _section_sources(cfg, "", cfg._sources)


def _section_sources(section: BaseModel, prefix: str, given: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in type(section).model_fields:
        dotted, value = f"{prefix}{key}", getattr(section, key)
        below = {k: v for k, v in given.items() if k.startswith(dotted + ".")}
        if isinstance(value, BaseModel):
            out.update(_section_sources(value, dotted + ".", given))
        elif below and isinstance(value, dict):
            out.update(below)
        elif dotted in given or below:
            out[dotted] = given.get(dotted) or next(iter(below.values()))
        else:
            out[dotted] = "api" if key in section.model_fields_set else "default"
    return out


def _flow(value: Any) -> str:
    """One value as single-line YAML (flow style)."""
    return yaml.safe_dump([value], default_flow_style=True, width=1 << 30).strip()[1:-1]


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML that load_config reads back, each value followed by its source."""
    where = f" ({cfg._file})" if cfg._file else ""
    lines = [f"# resolved configuration; after each value, where it came from: default, file{where}, "
             "override (command line) or api (set in Python)"]
    return "\n".join(lines + _yaml_lines(cfg.model_dump(mode="json"), "", value_sources(cfg), 0)) + "\n"


def _yaml_lines(tree: dict, prefix: str, sources: dict[str, str], depth: int) -> list[str]:
    lines, pad = [], "  " * depth
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and (depth == 0 or dotted not in sources):
            lines.append(f"{pad}{_flow(key)}:")
            lines += _yaml_lines(value, dotted + ".", sources, depth + 1)
        else:
            origin = sources.get(dotted) or next((v for k, v in sources.items() if dotted.startswith(k + ".")), "api")
            lines.append(f"{pad}{_flow(key)}: {_flow(value)}  # {origin}")
    return lines
