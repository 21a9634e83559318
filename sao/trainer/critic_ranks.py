"""The critic on its own processes (critic.placement=separate): steps 1-3 one batch ahead of the actor.

The paper's order per batch n is v0 -> K critic updates -> v2 -> actor step on GAE(v2) (docs/algorithm.md
§5). The critic never reads the actor, so while the actor steps on batch n the critic can already run
steps 1-3 of batch n+1: a step then costs max(actor, critic) instead of their sum, with the same math
for the same batches (tests/test_critic_ranks.py compares weights and metrics with the colocated
schedule). The cost: the runtime dequeues batch n+1 one actor step early (its lag can be one more,
visible in async/lag_max and covered by DIS).

With critic.ranks=M > 1 the critic is M processes joined in a process group of their own (gloo on CPU,
NCCL on GPU; the actor's side is not in it): an FSDP2-sharded critic, each rank training its rows of
the batch (sao/trainer/distributed.py, the same math as one process); critic rank 0 returns the whole
batch's advantages.

    start_critic_rank(build, args, threads, ranks, timeout_s)
                                              spawn the critic's M processes; each builds its critic-only
                                              learner with build(*args) (a module-level function)
    CriticGroup.submit(batch)                 send a batch; the critic starts on it as soon as it is free
    CriticGroup.expect(batch) / result()      the actor's side of step n: the oldest batch's advantages
                                              (before whitening), critic metrics and skipped updates
    state_dict / load_state_dict / save_pretrained / close
                                              the critic's optimizer state and counter, its HF folder

Messages are pickled over one pipe per critic rank, in order; every rank answers each in turn (rank 0
with the result). A critic process that dies fails the next call with `RankFailed` naming it (one line,
no traceback); one that raises sends its error back, which is raised here. The processes die with their
parent (PR_SET_PDEATHSIG) and ignore Ctrl-C (the trainer checkpoints, then closes them). With
runtime.backend=ray the critic ranks are Ray actors instead (`RayCriticGroup`, sao/trainer/ray_ranks.py:
the same messages as remote calls, placed on the cluster like the trainer's rank actors).
"""

from __future__ import annotations

import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from sao.trainer.batch import Batch
from sao.trainer.launch import RankFailed, never_outlive_parent

POLL_S = 0.5  # how often a wait for the critic checks that its process is alive


CRITIC_COMMANDS: dict[str, Callable] = {  # what a critic rank runs, whatever carries the message (pipe or Ray)
    "advance": lambda learner, batch: learner.critic_phase(batch),  # steps 1-3 of a batch
    "state": lambda learner: learner.critic_state(),
    "load": lambda learner, state: learner.load_critic_state(state),
    "save": lambda learner, folder: learner.save_critic(folder),
}


def _serve(learner, conn: Connection) -> None:
    """A critic process's loop: one answer per message, in order, until "close" or end of file."""
    while True:
        try:
            name, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if name == "close":
            return
        try:
            if name not in CRITIC_COMMANDS:
                raise ValueError(f"unknown critic command {name!r}")
            reply = ("ok", CRITIC_COMMANDS[name](learner, *args))
        except Exception as e:  # the trainer raises it (e.g. a full disk while saving): one report, there
            reply = ("error", (e, traceback.format_exc()))
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle: its text
            payload = pickle.dumps(("error", (RuntimeError(str(reply[1][0])), reply[1][1])))
        conn.send_bytes(payload)


def _critic_main(conn: Connection, rank: int, world: int, port: int, timeout_s: float, build: Callable,
                 args: tuple, threads: int) -> None:
    import os

    import torch

    never_outlive_parent()
    torch.set_num_threads(threads)
    try:
        if world > 1:
            from sao.trainer.distributed import init_ranks

            init_ranks(rank, world, port, timeout_s)
        learner = build(*args)
    except Exception as e:
        conn.send_bytes(pickle.dumps(("error", (RuntimeError(f"{type(e).__name__}: {e}"), traceback.format_exc()))))
        os._exit(1)
    conn.send_bytes(pickle.dumps(("ok", None)))  # built: the trainer may go on
    _serve(learner, conn)


class CriticGroup:
    """The trainer's handle on the critic's processes. Batches are answered in the order submitted."""

    def __init__(self, processes: list, conns: list[Connection]) -> None:
        self.processes, self.conns = processes, conns
        self.pending: list[Batch] = []  # submitted, answer not read yet, oldest first

    @property
    def process(self):
        """Critic rank 0's process (the only one at critic.ranks=1)."""
        return self.processes[0]

    @property
    def ranks(self) -> int:
        return len(self.conns)

    def _send(self, name: str, *args, per_rank: list | None = None) -> None:
        """`name` with `args` to every critic rank; `per_rank`: each rank's own arguments instead."""
        try:
            payload = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
            for rank, conn in enumerate(self.conns):
                conn.send_bytes(payload if per_rank is None else
                                pickle.dumps((name, per_rank[rank]), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._lost(name)

    def _receive(self, name: str):
        """Every rank's answer, in rank order; rank 0's result."""
        import torch.distributed as dist

        answers = []
        for rank, conn in enumerate(self.conns):
            while not conn.poll(POLL_S):
                if not all(p.is_alive() for p in self.processes):
                    self._lost(name)
            try:
                status, out = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._lost(name)
            if status == "error":
                error, text = out
                # another rank died: this one's collective broke because of it (its sockets close first)
                if [r for r in self._dead(2.0 if isinstance(error, dist.DistError) else 0.0) if r != rank]:
                    self._lost(name)
                if rank + 1 < len(self.conns):
                    self.close(abort=True)  # the ranks after it may wait for it inside a collective
                raise error from RuntimeError(f"in the critic's process:\n{text}")
            answers.append(out)
        return answers[0]

    def _dead(self, grace_s: float = 0.0) -> list:
        """The critic ranks whose process exited. A killed rank's sockets close before its exit can be
        reaped, so a rank may report the broken collective first: wait up to `grace_s` for a death."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _lost(self, name: str):
        dead = self._dead(grace_s=2.0)
        for p in self.processes:
            p.join(timeout=0.1)
        who = []
        for rank in dead or [0]:
            p, code = self.processes[rank], self.processes[rank].exitcode
            label = "the critic's process" if len(self.processes) == 1 else f"critic rank {rank}'s process"
            who.append(f"{label} (pid {p.pid}) "
                       f"{'exited with code ' + str(code) if code is not None else 'stopped answering'}"
                       f"{self._last_words(rank)}")
        self.close(abort=True)
        raise RankFailed(f"{name}: {', '.join(who)}")

    def _last_words(self, rank: int) -> str:
        """The error a dead rank sent before it exited (a critic that failed to build), as ": Type: message"."""
        conn = self.conns[rank] if rank < len(self.conns) else None
        try:
            while conn is not None and conn.poll(0):
                status, out = pickle.loads(conn.recv_bytes())
                if status == "error":
                    return f": {out[0]}"
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        return ""

    def _call(self, name: str, *args, per_rank: list | None = None):
        if self.pending:  # a look-ahead batch is in flight: its answer comes first
            raise RuntimeError(f"critic {name}: {len(self.pending)} batch(es) handed over early are not trained yet")
        self._send(name, *args, per_rank=per_rank)
        return self._receive(name)

    def submit(self, batch: Batch) -> None:
        self._send("advance", batch)
        self.pending.append(batch)

    def expect(self, batch: Batch) -> None:
        """The actor is about to step on `batch`: it must be the oldest submitted one, or is sent now."""
        if not self.pending:
            self.submit(batch)
        elif self.pending[0] is not batch:
            raise RuntimeError("Learner.step: the batch is not the one handed over first (look_ahead order)")

    def result(self):
        out = self._receive("step")
        self.pending.pop(0)
        return out

    def state_dict(self) -> dict:
        return self._call("state")

    def load_state_dict(self, state: dict) -> None:
        """Rank 0 receives the state; the others receive their shards of it from rank 0."""
        self._call("load", per_rank=[(state,)] + [(None,)] * (self.ranks - 1))

    def save_pretrained(self, folder) -> None:
        self._call("save", str(folder))

    def close(self, abort: bool = False) -> None:
        """Stop the critic's processes (politely, or by SIGKILL after a failure). Idempotent."""
        if not self.conns:
            return
        if not abort:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("close", ())))
                except OSError:
                    pass
        for conn in self.conns:
            conn.close()
        self.conns = []
        for p in self.processes:
            p.join(timeout=0 if abort else 30)
            if p.is_alive():
                p.kill()
                p.join()


def start_critic_rank(build: Callable, args: tuple, threads: int = 1, ranks: int = 1,
                      timeout_s: float = 600.0) -> CriticGroup:
    """Spawn the critic's `ranks` processes; returns once every one has built its critic (or raises the
    first error). `timeout_s` bounds each collective of the critic's group (critic.ranks > 1)."""
    import torch.multiprocessing as mp

    from sao.trainer.launch import free_port

    ctx = mp.get_context("spawn")
    port = free_port() if ranks > 1 else 0
    processes, conns = [], []
    for rank in range(ranks):
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(target=_critic_main, args=(theirs, rank, ranks, port, timeout_s, build, args, threads),
                              daemon=True)
        process.start()
        theirs.close()
        processes.append(process)
        conns.append(ours)
    group = CriticGroup(processes, conns)
    group._receive("start")
    return group
