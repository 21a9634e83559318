"""The learner on N data-parallel ranks with FSDP2 (docs/ranks.md §1).

    ranks     one process each, joined by torch.distributed (gloo on CPU, NCCL on GPU), with a
              collective timeout (`init_ranks`)
    models    actor and critic each wrapped with `fully_shard` (FSDP2): every decoder layer is a shard
              group, the rest (embeddings, tied lm_head, value head) the root group; parameters,
              gradients and AdamW states are 1/N per rank. bf16 params / fp32 reduce on GPU, fp32 on CPU.
              With `from_rank0`, ranks 1..N-1 build them on the meta device and receive their shards
              from rank 0 one whole tensor at a time (`send_weights`, `receive_weights`): only rank 0 holds a
              whole model
    data      every rank receives the whole batch and keeps its rows (`shard_rows`): contiguous,
              balanced by real tokens, GRPO groups whole; uneven token counts are expected
    math      the same as one process: token-mean losses are local sums over the GLOBAL action-token
              count and FSDP sums gradients instead of averaging them (divide factor 1), so the summed
              gradient is the one-process gradient; every statistic and metric goes through the
              `DistReducer` (sao/trainer/reduce.py); PPO minibatches are the one-process split of the
              global batch, a rank holding no row of one still joins its collectives with a masked row
    weights   `export_buckets()` gathers full tensors bucket by bucket (`DTensor.full_tensor()`); only
              rank 0 keeps them, in the order of `engine_parameters(actor)` (merged for a LoRA actor)

The one-process `Learner` (sao/trainer/learner.py) runs the algorithm; this subclass only decides
which rows a rank holds and makes its sums global.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from sao.algo.registry import Algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.device import to_device
from sao.models.critic import freeze_parameters
from sao.models.lora import engine_parameters
from sao.trainer.batch import Batch
from sao.trainer.learner import Learner, per_row
from sao.trainer.reduce import DistReducer

DEFAULT_BUCKET_BYTES = 256 * 2**20


STARTUP_S = 300.0  # the rendezvous: ranks start (spawn, imports, Ray placement) at their own pace


def init_ranks(rank: int, world: int, port: int, timeout_s: float = 600.0, host: str = "127.0.0.1",
               backend: str | None = None, startup_s: float = STARTUP_S) -> str:
    """Join the process group of `world` trainer ranks (rank 0 listens on host:port); returns the backend.
    `timeout_s` bounds every collective: a rank that hangs or dies in one stops the others within it.
    Joining is bounded by `startup_s` instead (a process that is still importing torch is not hung), and
    waiting for the next command is bounded by neither (sao/trainer/ranks.py `follow`)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore(host, port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=max(startup_s, timeout_s)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def shard_rows(token_counts: list[int], group_ids: list[str] | None, world: int) -> list[list[int]]:
    """Row indices per rank: contiguous runs of units (a row, or a whole group when `group_ids` is
    given) with about 1/world of the real tokens each; every rank gets at least one unit."""
    if group_ids is None:
        units = [[i] for i in range(len(token_counts))]
    else:
        by_group: dict[str, list[int]] = {}
        for i, g in enumerate(group_ids):
            by_group.setdefault(g, []).append(i)
        units = list(by_group.values())
    if len(units) < world:
        raise ValueError(f"a batch of {len(units)} {'groups or episodes' if group_ids else 'trajectories'} cannot "
                         f"be split over {world} trainer ranks")
    total, acc, r = sum(token_counts), 0, 0
    out: list[list[int]] = [[] for _ in range(world)]
    for k, unit in enumerate(units):
        must_move = len(units) - k <= world - 1 - r  # the ranks after r need the units left
        if r < world - 1 and out[r] and (acc >= total * (r + 1) / world or must_move):
            r += 1
        out[r].extend(unit)
        acc += sum(token_counts[i] for i in unit)
    return out


def shard_model(model: torch.nn.Module, mesh, mixed_precision: bool) -> torch.nn.Module:
    """`fully_shard` every decoder layer, then the root; gradients summed over ranks, not averaged
    (the losses already divide by the global token count). The shards move to the mesh's device (a
    CUDA mesh puts only 1/N of the model on each GPU); the whole model passes through host memory once."""
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
          else MixedPrecisionPolicy())
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    # the root too reshards after forward: FSDP2 keeps a root unsharded until the backward, and a
    # no-grad pass (pi_old, the critic's v2) has none, which would leave whole weights on every rank
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    for m in [*layers, model]:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def send_weights(model: torch.nn.Module) -> None:
    """Rank 0, before sharding its whole `model`: broadcast every weight, one whole tensor at a time, to
    the ranks in `receive_weights` (its own tensors are loaded back into themselves). A collective."""
    set_model_state_dict(model, dict(model.state_dict()), options=FROM_RANK0)


def receive_weights(model: torch.nn.Module, device: torch.device) -> None:
    """Ranks 1..N-1, a `model` sharded on the meta device: storage for its shards only (`to_empty`), then
    each whole tensor from rank 0's `send_weights` in turn, of which this rank keeps its part. A collective."""
    model.to_empty(device=device)
    set_model_state_dict(model, {}, options=FROM_RANK0)


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Every rank, after sharding: rank 0's buffers (e.g. rotary frequencies, in no state dict; small)."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


class DistributedLearner(Learner):
    """`Learner` on this rank's rows of each batch, with FSDP2-sharded actor and critic.

    Every rank constructs it with the same (full) models, or with `from_rank0` rank 0 with full models and
    the others with the same models on the meta device; every rank calls `step` with the same full batch;
    metrics are global and the same on every rank."""

    def __init__(self, actor, critic, algo: Algorithm, algo_cfg: AlgoConfig, critic_cfg: CriticConfig,
                 train_cfg: TrainConfig, mixed_precision: bool | None = None, from_rank0: bool = False,
                 critic_elsewhere: bool = False):
        # our models' outputs are never modified in place (sao/models/critic.py returns a view): FSDP2's
        # warning about that would print on every rank at every pass
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = dist.get_backend() == "nccl"
        mixed_precision = cuda if mixed_precision is None else mixed_precision
        mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

        def shard(model):
            if from_rank0 and self.rank == 0:  # before sharding: fully_shard then frees the whole tensors as it goes
                send_weights(model)
            model = shard_model(model, mesh, mixed_precision)
            if from_rank0 and self.rank != 0:
                receive_weights(model, device)
            if from_rank0:
                broadcast_buffers(model)
            return model

        if algo.uses_critic and critic is not None:
            # frozen before sharding, so FSDP sees which parameters train (Learner freezes the same ones again)
            freeze = critic_cfg.freeze_attention if algo.freeze_attention is None else algo.freeze_attention
            if freeze:
                freeze_parameters(critic, critic_cfg.freeze_pattern)
            critic = shard(critic)
        # FSDP casts to bf16 itself: the base learner's autocast stays off (dtype float32). No actor: a critic
        # rank (critic.placement=separate, critic.ranks > 1), whose group holds the critic alone
        super().__init__(shard(actor) if actor is not None else None, critic, algo, algo_cfg, critic_cfg, train_cfg,
                         critic_elsewhere=critic_elsewhere)
        self.reduce = DistReducer()
        self._rows: list[int] = []
        self._global_size = 0
        self._local: Batch | None = None
        self._running_adv: torch.Tensor | None = None
        self._given: tuple | None = None  # this step's critic results from critic ranks (critic_elsewhere)
        # a critic rank: builds a whole critic on the meta device to save the gathered weights (build.py)
        self.rebuild_critic: Callable[[], torch.nn.Module] | None = None

    def _shard(self, batch: Batch) -> None:
        tokens = batch.attention_mask.sum(1).tolist()
        units = batch.group_ids if self.algo.grouped else batch.unit_keys()  # a group, an episode's rows: one rank
        self._rows = shard_rows(tokens, units, self.world)[self.rank]
        self._global_size = batch.size

    def _slowest(self, metrics: dict) -> None:
        timed = sorted(k for k in metrics if k.startswith("perf/") and k.endswith("_s"))
        metrics.update(zip(timed, self.reduce.max_values([metrics[k] for k in timed])))  # the slowest rank

    def critic_phase(self, batch: Batch) -> tuple[torch.Tensor | None, dict[str, float], int]:
        """Steps 1-3 on this critic rank's rows of the whole `batch` (the same on every rank); rank 0
        returns the whole batch's advantages (None elsewhere) and the traced rows of every rank."""
        self._shard(batch)
        advantages, metrics, skipped = super().critic_phase(batch.rows(torch.tensor(self._rows)))
        self._slowest(metrics)
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (self._rows, advantages, metrics.pop("trace", None)))
        if self.rank != 0:
            return None, metrics, skipped
        whole = torch.zeros(batch.size, advantages.shape[1])
        traced: list[tuple[int, dict]] = []
        for rows, part, trace in parts:
            whole[torch.tensor(rows)] = part
            if trace is not None:  # per name, one entry per traced row of that rank, in row order
                traced += [(g, {k: v[i] for k, v in trace.items()})
                           for i, g in enumerate(g for g in rows if g < batch.trace_rows)]
        if traced:
            traced.sort(key=lambda item: item[0])
            metrics["trace"] = {k: [t[k] for _, t in traced] for k in traced[0][1]}
        return whole, metrics, skipped

    def critic_state(self) -> dict:
        """The critic's counter and its AdamW state as one process keeps it (positions, whole tensors), on
        rank 0 (a collective): a checkpoint moves between critic.ranks and placements."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from sao.trainer.sharded_checkpoint import by_position

        full = get_optimizer_state_dict(self.critic, self.critic_opt,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"critic_version": self.critic_version,
                "critic_opt": by_position(self.critic, self.critic_opt, full) if self.rank == 0 else None}

    def load_critic_state(self, state: dict | None) -> None:
        """`critic_state()`'s layout (or a one-process learner's), given to rank 0 (None elsewhere): each
        AdamW tensor is broadcast whole in turn, of which every rank keeps its shard. A collective."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from sao.trainer.sharded_checkpoint import by_name

        box = [None if state is None else (state["critic_version"], state["critic_opt"] is not None)]
        dist.broadcast_object_list(box, src=0)
        self.critic_version, has_optimizer = box[0]
        if not has_optimizer:  # a state without the critic's AdamW moments: the counter only, as one process does
            return
        full = by_name(self.critic, self.critic_opt, state["critic_opt"]) if state is not None else {}
        set_optimizer_state_dict(self.critic, self.critic_opt, full, options=FROM_RANK0)

    def save_critic(self, folder) -> None:
        """The critic's whole weights gathered on rank 0 and saved there as an HF folder (a collective)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(self.critic, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            model = self.rebuild_critic()
            model.load_state_dict(full, strict=False, assign=True)
            model.save_pretrained(folder)
        dist.barrier()

    def step(self, batch: Batch, critic: tuple | None = None) -> dict[str, float]:
        """One optimizer step on the whole `batch` (the same on every rank); this rank trains its rows.
        `critic`: steps 1-3 of the batch as the critic's ranks returned them (the whole batch's advantages,
        the critic's metrics, its skipped updates), sent by the driver to every rank with the command."""
        self._shard(batch)
        if self.running_mean is not None:  # a stateful baseline: every rank replays the whole batch in order
            heads = batch.heads.nonzero().flatten().tolist()
            self._running_adv = per_row(torch.tensor(self.running_mean.advantages(
                batch.scalar_rewards[heads].tolist(), [batch.prompt_keys[i] for i in heads])), batch)[self._rows]
        self._local = batch.rows(torch.tensor(self._rows))
        self._given = critic
        try:
            metrics = self._train(self._local)
        finally:
            self._given = None
        self._slowest(metrics)
        return metrics

    def _critic_advantages(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """Steps 1-3 here (colocated), or this rank's rows of what the critic's ranks computed."""
        if self._given is None:
            return super()._critic_advantages(batch, metrics)
        whole, critic_metrics, skipped = self._given
        critic_metrics = dict(critic_metrics)
        part = critic_metrics.pop("trace", None)  # per name, one entry per traced row of the whole batch
        if self.trace is not None and part:
            self.trace.merge({name: [values[g] for g in self.trace.global_rows] for name, values in part.items()})
        metrics.update(critic_metrics)
        self.skipped_in_step += skipped
        return whole[torch.tensor(self._rows)].to(self.device)

    def _trace_rows(self, batch: Batch) -> list[int]:
        return [i for i, g in enumerate(self._rows) if g < batch.trace_rows]

    def _global_rows(self, local: list[int]) -> list[int]:
        return [self._rows[i] for i in local]

    def _trace_records(self, actor: str) -> list[dict]:
        """Every rank's traced rows, gathered onto each (a collective: every rank traces the same step)."""
        parts: list = [None] * self.world
        dist.all_gather_object(parts, self.trace.records(actor))
        return sorted((r for part in parts for r in part), key=lambda r: r["row"])

    def _baseline_advantages(self, batch: Batch) -> torch.Tensor:
        if self._running_adv is None:
            return super()._baseline_advantages(batch)  # GRPO: whole groups on this rank
        return self._running_adv.to(batch.action_mask.device)[:, None] * batch.action_mask

    def _minibatches(self, batch: Batch, gen: torch.Generator) -> list[torch.Tensor]:
        """The one-process split of the global batch, restricted to this rank's rows (may be empty)."""
        local = {g: i for i, g in enumerate(self._rows)}
        chunks = torch.randperm(self._global_size, generator=gen).chunk(self.algo_cfg.ppo_minibatches)
        return [torch.tensor([local[g] for g in c.tolist() if g in local], dtype=torch.long) for c in chunks]

    def _update(self, batch: Batch, advantages: torch.Tensor, old_logprobs: torch.Tensor | None, loss_mask: torch.Tensor):
        if batch.size == 0:  # no row of this minibatch here: join the collectives with a row of no action token
            row = self._local.rows(torch.tensor([0]))
            batch = to_device(dataclasses.replace(row, action_mask=torch.zeros_like(row.action_mask)), self.device)
            advantages = torch.zeros_like(batch.action_mask)
            old_logprobs = None if old_logprobs is None else torch.zeros_like(batch.action_mask)
            loss_mask = batch.action_mask
        return super()._update(batch, advantages, old_logprobs, loss_mask)

    def export_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[torch.Tensor]]:
        """Full actor weights for the engines, in `engine_parameters` order, `bucket_bytes` at a time.
        Every rank must drain this iterator (each tensor is an all-gather); rank 0 receives the
        buckets, the others empty lists. A LoRA actor's adapted weights arrive merged."""
        bucket: list[torch.Tensor] = []
        size = 0
        with torch.no_grad():
            for p in engine_parameters(self.actor):
                full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                size += full.numel() * full.element_size()
                if self.rank == 0:
                    bucket.append(full)
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
        if size:
            yield bucket

    def export_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[torch.Tensor]:
        """All full weights on rank 0 (an empty list elsewhere); a collective: every rank calls it."""
        return [t for bucket in self.export_buckets(bucket_bytes) for t in bucket]


def timed_export(learner: DistributedLearner, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[float, int]:
    """(seconds, bytes) for one full export drained on every rank (benchmarks/fsdp_memory.py)."""
    t, n = time.perf_counter(), 0
    for bucket in learner.export_buckets(bucket_bytes):
        n += sum(x.numel() * x.element_size() for x in bucket)
    return time.perf_counter() - t, n
