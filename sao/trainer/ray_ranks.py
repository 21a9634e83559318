"""The trainer ranks as Ray actors (trainer.ranks > 1 with runtime.backend=ray), placed on a cluster.

    start_ray_ranks(cfg, world, build, args, model_path)
        a placement group of `world` bundles, one per rank ({CPU: trainer.rank_num_cpus, GPU:
        trainer.rank_num_gpus}, strategy trainer.ray_placement), one `TrainerRank` actor in each; rank
        0's node chooses the rendezvous (its IP from ray.util.get_node_ip_address, a free port there),
        every rank joins with `init_ranks` (gloo on CPU, NCCL when its bundle has a GPU: the same code)
        and builds its learner with build(*args)
    RayRanks
        what the driver process's `RankDriver` (the seam, sao/trainer/protocol.py) commands: every call goes
        to every rank actor at once (the batch is put in the object store once), the answer is rank 0's
    start_ray_critic(cfg, ranks, threads, build, args) -> RayCriticGroup
        the separate critic's ranks (critic.placement=separate) as the same actors in a placement group
        of their own: `CriticGroup`'s messages (sao/trainer/critic_ranks.py) as remote calls

Every rank, rank 0 included, is an actor with a bundle of its own, so the driver (the runtime's process)
needs no GPU. Weights for the engines do not pass through the driver: rank 0 puts the full weights in Ray's
object store as the one flat float32 buffer every backend publishes, and `export_weights` returns
`RemoteWeights`, whose `object_ref` the Ray rollout backend hands its workers as it is (the driver holds a
reference, not the bytes); whatever needs the tensors in the driver (evaluation, the parity gate, an HF
export) fetches them once, on first use.

Faults: a rank actor that dies (its process SIGKILLed, its node lost) fails the call in progress, or
the next one, with one line naming the rank; the other ranks are killed with it. A hung collective
ends within trainer.timeout_s on the ranks that wait in it; a rank that has not answered GRACE_S after
the first failure, or trainer.timeout_s + GRACE_S after the first answer, is named as hung. Ray ends a
job's actors when its driver exits, even by SIGKILL, so no rank outlives `sao train`.
"""

from __future__ import annotations

import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence

import ray
import torch
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.utils._pytree import tree_map_only

from sao.config import ConfigError, TrainerConfig
from sao.trainer.critic_ranks import CRITIC_COMMANDS, CriticGroup
from sao.trainer.launch import RankFailed, free_port
from sao.trainer.ranks import COMMANDS, RankDriver

GRACE_S = 10.0  # after one rank failed: how long the others may take to fail too (or be found dead)


class Packed:
    """A tensor on its way from rank 0 to the driver: its bytes as a numpy array, which Ray moves
    without pickling (a pickled torch tensor crawls: 5x slower for a 128 MB export,
    benchmarks/ray_ranks.py); `tensor()` is a plain, writable copy on the driver."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()

    def tensor(self) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the object store's array is read-only; it is only copied
            out = torch.empty(self.shape, dtype=self.dtype)
            out.view(-1).view(torch.uint8).copy_(torch.from_numpy(self.data))
            return out


class RemoteWeights(Sequence):
    """Full actor weights in Ray's object store (`object_ref`: one flat float32 numpy buffer, in the engines'
    parameter order, shaped by `shapes`): a list of tensors to whoever reads them (fetched and split once),
    a reference a Ray backend forwards to its engines without fetching (sao/runtime/ray_backend.py)."""

    def __init__(self, object_ref, shapes: list[tuple[int, ...]]):
        self.object_ref, self.shapes, self._tensors = object_ref, shapes, None

    def tensors(self) -> list[torch.Tensor]:
        if self._tensors is None:
            flat = torch.from_numpy(ray.get(self.object_ref).copy())  # the store's array is read-only
            self._tensors = list(flat.split([math.prod(s) for s in self.shapes]))
            self._tensors = [t.view(s) for t, s in zip(self._tensors, self.shapes)]
        return self._tensors

    def __getitem__(self, i):
        return self.tensors()[i]

    def __len__(self) -> int:
        return len(self.shapes)


@ray.remote(max_restarts=0)
class TrainerRank:
    """One trainer rank: a `DistributedLearner` (built by `build`) in its own Ray worker process."""

    def __init__(self, rank: int, world: int, cwd: str, role: str = "trainer", threads: int = 0) -> None:
        self.rank, self.world, self.learner, self.cwd, self.role = rank, world, None, cwd, role
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the driver checkpoints, then closes the ranks
        if threads:  # a critic rank's intra-op threads (critic.threads), as its local process sets them
            torch.set_num_threads(threads)
        if os.path.isdir(cwd):  # the driver's relative paths (run directory, critic.path) mean the same here
            os.chdir(cwd)

    def where(self) -> dict:
        """Where this rank runs; rank 0 also picks the rendezvous port on its node."""
        ip = ray.util.get_node_ip_address()
        out = {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "pid": os.getpid(),
               "sees_cwd": os.path.isdir(self.cwd)}
        if self.rank == 0:
            out["port"] = free_port(ip)
        return out

    def start(self, host: str, port: int, timeout_s: float, build: Callable, args: tuple) -> int:
        from sao.trainer.distributed import init_ranks

        if self.world > 1:  # one critic rank has no process group of its own
            init_ranks(self.rank, self.world, port, timeout_s, host=host)
        self.learner = build(*args)
        return self.learner.actor_version

    def call(self, name: str, args: tuple):
        """Run one command (sao/trainer/ranks.py COMMANDS; a critic rank's: critic_ranks.CRITIC_COMMANDS); only
        rank 0's result travels back (on CPU, `Packed`; exported weights as a reference to the flat buffer
        rank 0 put in the object store)."""
        if self.role == "critic":
            out = CRITIC_COMMANDS[name](self.learner, *args)
            return (tree_map_only(torch.Tensor, Packed, out) if self.rank == 0 else None), 0
        out = COMMANDS[name](self.learner, *args)
        if name == "export_weights" and self.rank == 0:
            with torch.no_grad():
                flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in out]).numpy()
            return ("remote", [ray.put(flat)], [tuple(t.shape) for t in out]), self.learner.actor_version
        out = tree_map_only(torch.Tensor, Packed, out) if self.rank == 0 else None
        return out, self.learner.actor_version

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RayRanks:
    """The ranks a `RankDriver` commands when they are Ray actors: each call goes to every rank actor at once
    (its arguments put in the object store once) and the answer is rank 0's. `placement` says where each
    rank runs; it is kept in checkpoints."""

    def __init__(self, actors: list, group, timeout_s: float) -> None:
        self.actors, self.group, self.placement, self.timeout_s = actors, group, [], timeout_s
        self.world, self._version = len(actors), 0

    @property
    def version(self) -> int:
        return self._version

    def state(self) -> dict:
        return {"placement": self.placement}  # where the ranks ran (node ids, pids)

    def call(self, name: str, *args, rank0_only: tuple = ()):
        """Run command `name` on every rank; `rank0_only` arguments go to rank 0 alone (the command shares them
        with the others itself)."""
        ref = ray.put(args)  # once, whatever the number of ranks
        first = ray.put(args + rank0_only) if rank0_only else ref
        out, self._version = self._gather(name, [a.call.remote(name, first if r == 0 else ref)
                                                 for r, a in enumerate(self.actors)])[0]
        if isinstance(out, tuple) and out[:1] == ("remote",):  # export_weights: a reference, not the bytes
            return RemoteWeights(out[1][0], out[2])
        return tree_map_only(Packed, Packed.tensor, out)

    def _gather(self, name: str, calls: list) -> list:
        """Every rank's answer, in rank order; on a failure every rank is stopped (`gather`)."""
        return gather(name, calls, self.timeout_s, self._who, lambda: self.close(abort=True))

    def _who(self, r: int) -> str:
        p = self.placement[r] if r < len(self.placement) else {}
        return f"trainer rank {r} (Ray actor, pid {p.get('pid', '?')} on {p.get('ip', '?')})"

    def close(self, abort: bool = False) -> None:
        """Leave the process group (politely) and end every rank actor and the placement group."""
        _end(self.actors, self.group, abort)
        self.actors, self.group = [], None


def gather(name: str, calls: list, timeout_s: float, who: Callable[[int], str], stop: Callable[[], None]) -> list:
    """Every rank's answer to call `name`, in rank order; on a failure `stop()` ends every rank and the error
    names the rank that died or hung (`who(rank)`), or is the learner's own (e.g. NonFiniteError, raised on
    every rank)."""
    pending = {ref: r for r, ref in enumerate(calls)}
    results: list = [None] * len(calls)
    error, deadline = None, None
    while pending:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
        if not done:
            break  # past the grace: the ranks still pending hang
        r = pending.pop(done[0])
        # one rank answered: every collective of the call is behind it, so the others answer within a
        # collective's bound (rank 0's own work after the last collective, a save's metadata, included);
        # a rank stopped after the call's last collective would otherwise be waited for forever
        deadline = deadline or time.monotonic() + timeout_s + GRACE_S
        try:
            results[r] = ray.get(done[0])
        except RayActorError:
            stop()
            _drain(list(pending))
            raise RankFailed(f"{name}: {who(r)} died") from None
        except RayTaskError as e:
            error = error or e.cause
            deadline = min(deadline, time.monotonic() + GRACE_S)
    if error is None and not pending:
        return results
    stop()
    _drain(list(pending))
    if pending:
        hung = ", ".join(who(r) for r in sorted(pending.values()))
        raise RankFailed(f"{name}: {hung} did not answer (trainer.timeout_s={timeout_s:g} bounds a collective)")
    if not isinstance(error, dist.DistError):
        raise error
    raise RankFailed(f"{name}: a collective failed: {str(error).splitlines()[0] if str(error) else error!r}")


def _end(actors: list, group, abort: bool) -> None:
    """Rank actors leave their process group (unless `abort`: after a failure it may hang), are killed, and
    their placement group is removed."""
    if actors and not abort:
        try:
            ray.get([a.close.remote() for a in actors], timeout=30)
        except (RayActorError, RayTaskError, GetTimeoutError):
            pass
    for a in actors:
        ray.kill(a)
    if group is not None:
        remove_placement_group(group)


def _drain(refs: list, timeout_s: float = 5.0) -> None:
    """Fetch and drop the answers of ranks that were killed mid-call: an error Ray holds for a result
    nobody fetched is printed with its traceback when the reference goes (after the run's one line)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception:  # noqa: BLE001 - the rank's failure is already reported in one line
            pass


def _place(cfg: TrainerConfig, world: int, what: str, role: str = "trainer", threads: int = 0):
    """`world` rank actors in a placement group on the connected Ray cluster (one bundle each:
    trainer.rank_num_cpus, trainer.rank_num_gpus; strategy trainer.ray_placement): (actors, group)."""
    bundle = {"CPU": cfg.rank_num_cpus, **({"GPU": cfg.rank_num_gpus} if cfg.rank_num_gpus else {})}
    group = placement_group([dict(bundle) for _ in range(world)], strategy=cfg.ray_placement)
    try:
        ray.get(group.ready(), timeout=cfg.timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        have = ray.cluster_resources()
        nodes = len([n for n in ray.nodes() if n["Alive"]])
        raise ConfigError(f"{what}={world}: the Ray cluster could not place {world} bundles of {bundle} "
                          f"({cfg.ray_placement}) within trainer.timeout_s={cfg.timeout_s:g}s; it has {nodes} "
                          f"node(s), {have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs") from None
    actors = [TrainerRank.options(num_cpus=cfg.rank_num_cpus, num_gpus=cfg.rank_num_gpus,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(group, r))
              .remote(r, world, os.getcwd(), role, threads) for r in range(world)]
    return actors, group


def _build(holder, what: str, timeout_s: float, build: Callable, args: tuple) -> list:
    """Where each rank runs (`holder.placement`), then every rank joined and built; each rank's version."""
    holder.placement = holder._gather("start", [a.where.remote() for a in holder.actors])
    blind = [p for p in holder.placement if not p.pop("sees_cwd")]
    if blind:  # its shards would land in Ray's worker directory: a checkpoint that looks whole but is not
        holder.close(abort=True)
        raise ConfigError(f"{what}: rank {blind[0]['rank']} runs on node {blind[0]['ip']}, which does not "
                          f"see {os.getcwd()}; the run directory must be on a filesystem every node sees")
    host, port = holder.placement[0]["ip"], holder.placement[0]["port"]
    return holder._gather("start", [a.start.remote(host, port, timeout_s, build, args) for a in holder.actors])


def start_ray_ranks(cfg: TrainerConfig, build: Callable, args: tuple, model_path=None) -> RankDriver:
    """`cfg.ranks` rank actors in a placement group on the connected Ray cluster, joined and built, behind a
    `RankDriver`; `build(*args)` (a module-level function: it travels by reference) returns each rank's learner."""
    actors, group = _place(cfg, cfg.ranks, "trainer.ranks")
    ranks = RayRanks(actors, group, cfg.timeout_s)
    ranks._version = _build(ranks, "trainer.ranks", cfg.timeout_s, build, args)[0]
    return RankDriver(ranks, model_path)


class RayCriticGroup(CriticGroup):
    """The critic's ranks as Ray actors (critic.placement=separate with runtime.backend=ray): the messages of
    `CriticGroup` (advance one batch ahead, state, load, save) as remote calls, answered in the order sent
    (an actor runs its calls one at a time); a rank that dies or hangs fails the call in one line."""

    def __init__(self, actors: list, group, timeout_s: float) -> None:
        super().__init__([], [])
        self.actors, self.group, self.placement, self.timeout_s = actors, group, [], timeout_s
        self.calls: list[list] = []  # every rank's answer reference per message sent, oldest first

    @property
    def ranks(self) -> int:
        return len(self.actors)

    def _who(self, r: int) -> str:
        p = self.placement[r] if r < len(self.placement) else {}
        label = "the critic" if len(self.placement) == 1 else f"critic rank {r}"  # placement outlives close
        return f"{label} (Ray actor, pid {p.get('pid', '?')} on {p.get('ip', '?')})"

    def _gather(self, name: str, calls: list) -> list:
        return gather(name, calls, self.timeout_s, self._who, lambda: self.close(abort=True))

    def _send(self, name: str, *args, per_rank: list | None = None) -> None:
        if not self.actors:
            raise RankFailed(f"{name}: the critic's Ray actors are gone")
        shared = ray.put(args) if per_rank is None else None  # a batch goes to the object store once
        self.calls.append([a.call.remote(name, shared if per_rank is None else per_rank[r])
                           for r, a in enumerate(self.actors)])

    def _receive(self, name: str):
        if not self.actors or not self.calls:  # ended after an earlier failure
            raise RankFailed(f"{name}: the critic's Ray actors are gone")
        out, _ = self._gather(name, self.calls.pop(0))[0]
        return tree_map_only(Packed, Packed.tensor, out)

    def close(self, abort: bool = False) -> None:
        """Leave the critic's process group and end its actors and placement group. Idempotent."""
        _end(self.actors, self.group, abort)
        self.actors, self.group, self.calls = [], None, []


def start_ray_critic(cfg: TrainerConfig, ranks: int, threads: int, build: Callable, args: tuple) -> RayCriticGroup:
    """The critic's `ranks` actors on the connected Ray cluster (bundles as the trainer ranks'), each
    building its critic-only learner with `build(*args)` (sao/trainer/build.py critic_learner)."""
    actors, group = _place(cfg, ranks, "critic.ranks", role="critic", threads=threads)
    critic = RayCriticGroup(actors, group, cfg.timeout_s)
    _build(critic, "critic.ranks", cfg.timeout_s, build, args)
    return critic
