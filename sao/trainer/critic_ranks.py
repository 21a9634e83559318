"""The critic on its own process (critic.placement=separate): steps 1-3 one batch ahead of the actor.

The paper's order per batch n is v0 -> K critic updates -> v2 -> actor step on GAE(v2) (docs/algorithm.md
§5). The critic never reads the actor, so while the actor steps on batch n the critic can already run
steps 1-3 of batch n+1: a step then costs max(actor, critic) instead of their sum, with the same math
for the same batches (tests/test_critic_ranks.py compares weights and metrics with the colocated
schedule). The cost: the runtime dequeues batch n+1 one actor step early (its lag can be one more,
visible in async/lag_max and covered by DIS).

    start_critic_rank(build, args, threads)   spawn the critic's process; it builds its critic-only
                                              `Learner` with build(*args) (a module-level function)
    CriticGroup.submit(batch)                 send a batch; the critic starts on it as soon as it is free
    CriticGroup.expect(batch) / result()      the actor's side of step n: the oldest batch's advantages
                                              (before whitening), critic metrics and skipped updates
    state_dict / load_state_dict / save_pretrained / close
                                              the critic's optimizer state and counter, its HF folder

Messages are pickled over one pipe, in order; the critic answers each in turn. A critic process that
dies fails the next call with `RankFailed` naming it (one line, no traceback); one that raises sends its
error back, which is raised here. The process dies with its parent (PR_SET_PDEATHSIG) and ignores Ctrl-C
(the trainer checkpoints, then closes it). Written for one critic process; a critic sharded over M
FSDP2 ranks is the next step (docs/ranks.md §2).
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from sao.trainer.batch import Batch
from sao.trainer.launch import RankFailed, never_outlive_parent

POLL_S = 0.5  # how often a wait for the critic checks that its process is alive


def _serve(learner, conn: Connection) -> None:
    """The critic process's loop: one answer per message, in order, until "close" or end of file."""
    while True:
        try:
            name, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if name == "close":
            return
        try:
            if name == "advance":
                out = learner.critic_phase(*args)
            elif name == "state":
                out = learner.critic_state()
            elif name == "load":
                out = learner.load_critic_state(*args)
            elif name == "save":
                out = learner.critic.save_pretrained(*args)
            else:
                raise ValueError(f"unknown critic command {name!r}")
            reply = ("ok", out)
        except Exception as e:  # the trainer raises it (e.g. a full disk while saving): one report, there
            reply = ("error", (e, traceback.format_exc()))
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle: its text
            payload = pickle.dumps(("error", (RuntimeError(str(reply[1][0])), reply[1][1])))
        conn.send_bytes(payload)


def _critic_main(conn: Connection, build: Callable, args: tuple, threads: int) -> None:
    import os

    import torch

    never_outlive_parent()
    torch.set_num_threads(threads)
    try:
        learner = build(*args)
    except Exception as e:
        conn.send_bytes(pickle.dumps(("error", (RuntimeError(f"{type(e).__name__}: {e}"), traceback.format_exc()))))
        os._exit(1)
    conn.send_bytes(pickle.dumps(("ok", None)))  # built: the trainer may go on
    _serve(learner, conn)


class CriticGroup:
    """The trainer's handle on the critic's process. Batches are answered in the order submitted."""

    def __init__(self, process, conn: Connection) -> None:
        self.process, self.conn = process, conn
        self.pending: list[Batch] = []  # submitted, answer not read yet, oldest first

    def _send(self, name: str, *args) -> None:
        try:
            self.conn.send_bytes(pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._lost(name)

    def _receive(self, name: str):
        while not self.conn.poll(POLL_S):
            if not self.process.is_alive():
                self._lost(name)
        try:
            status, out = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self._lost(name)
        if status == "error":
            error, text = out
            raise error from RuntimeError(f"in the critic's process:\n{text}")
        return out

    def _lost(self, name: str):
        self.process.join(timeout=2)
        code = self.process.exitcode
        self.close(abort=True)
        raise RankFailed(f"{name}: the critic's process (pid {self.process.pid}) "
                         f"{'exited with code ' + str(code) if code is not None else 'stopped answering'}")

    def _call(self, name: str, *args):
        if self.pending:  # a look-ahead batch is in flight: its answer comes first
            raise RuntimeError(f"critic {name}: {len(self.pending)} batch(es) handed over early are not trained yet")
        self._send(name, *args)
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
        self._call("load", state)

    def save_pretrained(self, folder) -> None:
        self._call("save", str(folder))

    def close(self, abort: bool = False) -> None:
        """Stop the critic's process (politely, or by SIGKILL after a failure). Idempotent."""
        if self.conn is None:
            return
        if not abort:
            try:
                self.conn.send_bytes(pickle.dumps(("close", ())))
            except OSError:
                pass
        self.conn.close()
        self.conn = None
        self.process.join(timeout=0 if abort else 30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_critic_rank(build: Callable, args: tuple, threads: int = 1) -> CriticGroup:
    """Spawn the critic's process; returns once it has built its critic (or raises its error)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_critic_main, args=(theirs, build, args, threads), daemon=True)
    process.start()
    theirs.close()
    group = CriticGroup(process, ours)
    group._receive("start")
    return group
