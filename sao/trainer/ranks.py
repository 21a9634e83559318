"""Rank 0 drives, ranks 1..N-1 follow: the runtime holds one trainer object, whatever N is.

    start_trainer_ranks(world, build, args)   this process becomes rank 0; ranks 1..N-1 are spawned
                                              children; every rank builds its learner with build(*args)
    RankDriver(ranks).step / export_weights / save / load / load_state_dict
                                              the trainer seam, written once over the ranks it commands:
                                              `LocalRanks` here, Ray rank actors (`RayRanks`,
                                              sao/trainer/ray_ranks.py) with runtime.backend=ray
    LocalRanks.call(name, *args)              send the command (and the batch) to the followers, then run
                                              it here: every rank runs the same collectives
    follow(learner, inbox)                    a follower's loop: receive a command, run it, until close

Commands travel over a pipe from rank 0 to each follower, not through a collective: a follower waits for
the next one as long as rank 0 is away (a batch of long agent episodes, an evaluation, an export), and
`trainer.timeout_s` bounds the collectives inside a command only. A follower notices a dead rank 0 at
once (the pipe's end-of-file; the kernel's parent-death signal besides). A follower that dies (or hangs
in a collective past the timeout) fails rank 0's next command with `RankFailed` naming the rank;
`close()` stops every follower (none is left behind).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch.distributed as dist

from sao.trainer.launch import RankFailed, free_port, never_outlive_parent
from sao.trainer.sharded_checkpoint import load_one_process, load_sharded, save_sharded

COMMANDS: dict[str, Callable] = {
    "step": lambda learner, batch, critic=None: learner.step(batch, critic),  # critic: the critic ranks' results
    "export_weights": lambda learner: learner.export_weights(),
    "logprobs": lambda learner, batch: learner.logprobs(batch),
    "save": save_sharded,
    "load": load_sharded,
    "load_one_process": load_one_process,  # rank 0 adds the state; the followers receive it tensor by tensor
}


def follow(learner, inbox: Connection) -> None:
    """Run rank 0's commands on this rank until it sends "close" (or is gone: end of file on the pipe).
    The wait for a command has no timeout; the command's collectives have trainer.timeout_s."""
    while True:
        try:
            name, args = pickle.loads(inbox.recv_bytes())
        except EOFError:
            return
        if name == "close":
            return
        COMMANDS[name](learner, *args)


LEARNER_ERROR = 3  # a follower's exit code when its learner raised (rank 0 raised the same and reports it)


def _follower(rank: int, world: int, port: int, timeout_s: float, build: Callable, args: tuple,
              inbox: Connection) -> None:
    import os

    from sao.trainer.distributed import init_ranks

    never_outlive_parent()
    init_ranks(rank, world, port, timeout_s)
    try:
        follow(build(*args), inbox)
    except Exception:  # the math is global: rank 0 raised it too and says it once, without N tracebacks
        os._exit(LEARNER_ERROR)
    dist.destroy_process_group()


class LocalRanks:
    """The ranks a `RankDriver` commands when they are local processes: rank 0 is this process (its learner
    runs the command here), ranks 1..N-1 are spawned followers that read each command from a pipe."""

    def __init__(self, learner, followers: list, outboxes: list[Connection] = ()):
        self.learner, self.followers = learner, followers
        self.outboxes = list(outboxes)  # rank 0's ends of the command pipes, one per follower
        self.world = len(followers) + 1

    @property
    def version(self) -> int:
        return self.learner.actor_version

    def state(self) -> dict:
        return {}

    def call(self, name: str, *args, rank0_only: tuple = ()):
        """Run command `name` on every rank; `rank0_only` arguments are not sent (the command shares them)."""
        try:
            self._send(name, args)
            return COMMANDS[name](self.learner, *args, *rank0_only)
        except Exception as e:
            dead = self._dead()
            self.close(abort=True)  # the followers failed alike (the math is global) or are stuck: stop them
            alike = all(code == LEARNER_ERROR for _, code in dead)
            if alike and not isinstance(e, dist.DistError):
                raise  # the learner's own error (e.g. NonFiniteError), raised on every rank
            who = ", ".join(f"trainer rank {r} exited with code {c}" for r, c in dead) or f"a collective failed: {e}"
            raise RankFailed(f"{name}: {who}") from None

    def _send(self, name: str, args: tuple) -> None:
        """The command to every follower (pickled once; a dead follower's pipe raises BrokenPipeError)."""
        payload = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
        for out in self.outboxes:
            out.send_bytes(payload)

    def _dead(self, grace_s: float = 2.0) -> list[tuple[int, int | None]]:
        """(rank, exit code) of the followers that exited. A killed rank's sockets close before its exit
        can be reaped, so rank 0 may see the broken collective first: wait up to `grace_s` for a death."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [(i + 1, p.exitcode) for i, p in enumerate(self.followers) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def close(self, abort: bool = False) -> None:
        """Stop the followers (politely, or by SIGKILL after a failure) and leave the process group."""
        if not abort:
            try:
                self._send("close", ())
            except OSError:  # a follower already gone
                pass
        for out in self.outboxes:
            out.close()  # end of file: a follower still waiting for a command returns
        self.outboxes = []
        for p in self.followers:
            p.join(timeout=0 if abort else 30)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()


class RankDriver:
    """The trainer seam on the driver (sao/trainer/protocol.py): the same calls as a one-process `Learner`,
    run on every rank of `ranks` (`LocalRanks`, or Ray rank actors: sao/trainer/ray_ranks.py `RayRanks`),
    the answer rank 0's.

    Checkpoints: `save_pretrained` writes every rank's shards with DCP into `folder/trainer/` (loadable at
    any rank count, sao/trainer/sharded_checkpoint.py) and a plain HF folder `folder/actor/` with the full
    (merged, for LoRA) weights, which `sao eval`, the engines and AutoModelForCausalLM load. `state_dict`
    holds only what says so: the optimizer states are in the shards.

    `critic`: the critic's own ranks (critic.placement=separate; a `CriticGroup`, sao/trainer/critic_ranks.py,
    or Ray's `RayCriticGroup`), one batch ahead: the driver takes each batch's critic results from them and
    sends them with the step command, each trainer rank keeping its rows. The critic then checkpoints as one
    process does (an HF folder `folder/critic/` and its optimizer state in `state_dict`)."""

    def __init__(self, ranks, model_path=None, critic=None):
        self.ranks, self.model_path, self.critic = ranks, model_path, critic
        self.before_pass = None  # the one-process thread hook (sao/runtime/threads.py) has no use here

    @property
    def looks_ahead(self) -> bool:
        return self.critic is not None  # colocated, the critic trains inside the ranks' step

    @property
    def version(self) -> int:
        return self.ranks.version

    def look_ahead(self, batch) -> None:
        if self.critic is None:
            raise NotImplementedError("trainer ranks take no batch early (critic.placement=colocated)")
        self.critic.submit(batch)

    def _call(self, name: str, *args, rank0_only: tuple = ()):
        return self.ranks.call(name, *args, rank0_only=rank0_only)

    def step(self, batch) -> dict[str, float]:
        if self.critic is None:
            return self._call("step", batch)
        self.critic.expect(batch)  # handed over early, or sent now
        t = time.perf_counter()
        advantages, metrics, skipped = self.critic.result()
        metrics["perf/critic_wait_s"] = time.perf_counter() - t  # what of the critic's time was not hidden
        return self._call("step", batch, (advantages, metrics, skipped))

    def export_weights(self) -> list:
        return self._call("export_weights")

    def logprobs(self, batch):
        return self._call("logprobs", batch)

    def state_dict(self) -> dict:
        critic = self.critic.state_dict() if self.critic is not None else {}  # critic_version, critic_opt
        return {"sharded": "trainer", "ranks": self.ranks.world, **self.ranks.state(), **critic}

    def load_state_dict(self, state: dict) -> None:
        """A sharded checkpoint: nothing here, every rank loaded its shards when it was built
        (sao/runtime/saver.py). A one-rank run's `Learner.state_dict()`: optimizer states and counters
        from this rank to all (1 -> N; the weights came from the checkpoint's HF folders)."""
        if "sharded" not in state:
            self._call("load_one_process", rank0_only=(state,))
        if self.critic is not None and "critic_opt" in state:  # preflight: only a checkpoint saved like this
            self.critic.load_state_dict({"critic_version": state["critic_version"], "critic_opt": state["critic_opt"]})

    def save_pretrained(self, folder, tokenizer, merged: bool = False) -> None:
        from pathlib import Path

        import torch

        from sao.models.tiny import load_model

        folder = Path(folder)
        self.save(folder / "trainer")
        weights = self.export_weights()  # whole tensors on this rank only
        model = load_model(self.model_path)
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w.to(p.device, p.dtype).view_as(p))
        model.save_pretrained(folder / "actor")
        tokenizer.save_pretrained(folder / "actor")
        if self.critic is not None:
            self.critic.save_pretrained(folder / "critic")
            tokenizer.save_pretrained(folder / "critic")  # as the one-process Learner: each folder loads alone

    def save(self, path) -> None:
        self._call("save", str(path))

    def load(self, path) -> None:
        self._call("load", str(path))

    def close(self, abort: bool = False) -> None:
        """Stop every rank, the critic's too (politely, or at once after a failure). Idempotent."""
        self.ranks.close(abort)
        if self.critic is not None:
            self.critic.close(abort)


def start_trainer_ranks(world: int, build: Callable, args: tuple, timeout_s: float = 600.0,
                        model_path=None) -> RankDriver:
    """Make this process rank 0 of `world` trainer ranks and spawn the others; `build(*args)` (a module-level
    function: it travels to the children by reference) returns each rank's learner."""
    import torch.multiprocessing as mp

    from sao.trainer.distributed import init_ranks

    port, ctx = free_port(), mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]  # (follower's end, rank 0's end)
    followers = [ctx.Process(target=_follower, args=(r, world, port, timeout_s, build, args, pipes[r - 1][0]),
                             daemon=True) for r in range(1, world)]
    for p in followers:
        p.start()
    for inbox, _ in pipes:
        inbox.close()  # the child holds it now: when rank 0 exits, the follower reads end of file
    init_ranks(0, world, port, timeout_s)
    return RankDriver(LocalRanks(build(*args), followers, [out for _, out in pipes]), model_path)
