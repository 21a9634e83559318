"""`sao train trainer.ranks=2 runtime.backend=ray` on the real CLI: the trainer ranks as Ray actors in a
placement group (sao/trainer/ray_ranks.py), on the suite's one-node Ray and on a two-node Ray cluster
started here (`ray start --head` + `ray start --address`); checkpoints that resume, a SIGKILLed rank
actor that stops the run in one line with nothing left behind, and a hung one bounded by
trainer.timeout_s (the local launch: tests/test_trainer_ranks.py)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY
from faults import alive as _alive
from faults import audit_of
from faults import communicate_or_dump as _communicate_or_dump
from faults import descendants as _descendants
from faults import popen as _popen
from faults import rows as _rows
from faults import wait_for_step as _wait_for_step

pytestmark = pytest.mark.ray

RAY = [*TINY, "trainer.ranks=2", "runtime.backend=ray"]


def _ray_actors(name: str, root: int) -> list[int]:
    return [p for p, args in _descendants(root) if f"ray::{name}" in args and _alive(p)]


def _placement(ckpt: Path) -> list[dict]:
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)["trainer"]["placement"]


def _latest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _cli(args, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_ray_ranks_train_checkpoint_and_resume(tmp_path, ray_address):
    run = tmp_path / "runs" / "r"
    proc = _cli([*RAY, f"runtime.ray_address={ray_address}", "output.save_every=2", "output.name=r"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["train/actor_version"] == 3
    assert any(r.get("parity/max_abs_diff", 1) <= 1e-4 for r in _rows(run))  # the gate ran against the actors
    final = run / "checkpoints" / "final"
    assert (final / "trainer" / ".metadata").is_file() and len(list((final / "trainer").glob("*.distcp"))) == 2
    placement = _placement(final)
    assert [p["rank"] for p in placement] == [0, 1] and len({p["pid"] for p in placement}) == 2
    _wait(lambda: not _ray_actors("TrainerRank", os.getpid()), 15, None)  # Ray removes killed actors asynchronously
    assert not _ray_actors("TrainerRank", os.getpid())  # gone with the run
    res = _cli(["--resume", str(run), "runtime.backend=ray", f"runtime.ray_address={ray_address}", "train.steps=6"],
               tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["train/actor_version"] for r in rows] == [0, 1, 2, 3, 4, 5]  # counters came back from the shards
    assert {p["pid"] for p in _placement(final)}.isdisjoint({p["pid"] for p in placement})  # new actors
    assert not _ray_actors("TrainerRank", os.getpid())
    audit_of(run)


def test_a_cluster_it_cannot_place_the_ranks_on_is_refused_in_one_line(tmp_path, ray_address, sao_cli):
    proc = sao_cli("train", *RAY, f"runtime.ray_address={ray_address}", "trainer.ray_placement=STRICT_SPREAD",
                   "trainer.timeout_s=3", "--quiet", cwd=tmp_path)  # one node: STRICT_SPREAD cannot place 2
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "trainer.ranks=2: the Ray cluster could not place 2 bundles" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ports() -> list[str]:
    """Ports of their own for one node (two nodes share this machine; other Ray users may run here too)."""
    names = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent",
             "metrics-export")
    return [f"--{n}-port={_free_port()}" for n in names]


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes on this machine, each with a custom resource naming it (node_a, node_b),
    in a temp dir and on ports of its own; yields (address, {node id: name}). Each `ray start --block`
    ends its own node's processes on SIGTERM (`ray stop` would end every Ray on the machine)."""
    pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="saoray", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    ray_bin = str(Path(sys.executable).with_name("ray"))
    common = ["--block", "--disable-usage-stats", f"--object-store-memory={80 * 2**20}"]
    starts = [[ray_bin, "start", "--head", f"--port={port}", f"--temp-dir={tmp}", "--include-dashboard=false",
               f"--ray-client-server-port={_free_port()}", "--num-cpus=2", '--resources={"node_a": 1}'],
              [ray_bin, "start", f"--address={address}", "--num-cpus=1", '--resources={"node_b": 1}']]
    nodes: list[subprocess.Popen] = []
    try:
        for i, args in enumerate(starts):
            nodes.append(subprocess.Popen([*args, *common, *_node_ports()], env=env, start_new_session=True,
                                          stdout=open(f"{tmp}/node{i}.log", "w"), stderr=subprocess.STDOUT))
            if i == 0:  # the head must be up before a node can join it
                _wait(lambda: subprocess.run([ray_bin, "health-check", f"--address={address}"], env=env,
                                             capture_output=True).returncode == 0, 120, "the head node")
        names = subprocess.run([sys.executable, "-c", _LIST_NODES, address], env=env, capture_output=True,
                               text=True, timeout=180)
        assert names.returncode == 0, names.stderr[-2000:]
        yield address, json.loads(names.stdout.strip().splitlines()[-1])
    finally:
        mine = [p for n in nodes for p, _ in [(n.pid, "")] + _descendants(n.pid)]
        for n in nodes[::-1]:
            n.send_signal(signal.SIGTERM)
        for n in nodes[::-1]:
            try:
                n.wait(60)
            except subprocess.TimeoutExpired:
                n.kill()
        _wait(lambda: not any(_alive(p) for p in mine), 30, None)
        for p in mine:  # only this cluster's own processes, if any is still there
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


_LIST_NODES = """
import json, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
deadline = time.time() + 150
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
    time.sleep(0.5)
print(json.dumps({n["NodeID"]: next(k for k in ("node_a", "node_b") if k in n["Resources"])
                  for n in ray.nodes() if n["Alive"]}))
"""


def _wait(cond, timeout: float, what: str | None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.5)
    assert what is None, f"{what} did not come up in {timeout}s"


def test_ranks_spread_over_two_nodes(tmp_path, two_nodes):
    address, names = two_nodes
    assert sorted(names.values()) == ["node_a", "node_b"]
    proc = _cli([*RAY, f"runtime.ray_address={address}", "trainer.ray_placement=STRICT_SPREAD", "train.steps=2",
                 "output.name=n"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "n"
    assert [r["step"] for r in _rows(run) if "reward/mean" in r] == [1, 2]
    placement = _placement(run / "checkpoints" / "final")
    assert sorted(names[p["node_id"]] for p in placement) == ["node_a", "node_b"]  # one rank on each node
    _wait(lambda: not any(_alive(p["pid"]) for p in placement), 15, None)
    assert not any(_alive(p["pid"]) for p in placement)


def test_a_hung_rank_actor_is_bounded_by_the_collective_timeout(tmp_path, ray_address):
    run = tmp_path / "runs" / "h"
    proc = _popen([*RAY, f"runtime.ray_address={ray_address}", "train.steps=12", "output.save_every=1",
                   "trainer.timeout_s=10", "output.name=h"], tmp_path)
    _wait_for_step(proc, run, 2)
    hung = _placement(_latest(run))[1]["pid"]
    os.kill(hung, signal.SIGSTOP)
    try:
        t0 = time.time()
        out, err = _communicate_or_dump(proc, 180)
        assert proc.returncode == 1 and time.time() - t0 < 90, err[-3000:]
        line = err.strip().splitlines()[-1]
        print(f"stopped {time.time() - t0:.1f} s after the SIGSTOP: {line}")  # shown with pytest -s
        assert f"trainer rank 1 (Ray actor, pid {hung}" in line and "did not answer" in line, err[-3000:]
        _wait(lambda: not _alive(hung), 15, None)
        assert not _alive(hung) and not _ray_actors("TrainerRank", os.getpid())
    finally:
        if _alive(hung):
            os.kill(hung, signal.SIGKILL)


def test_one_command_starts_its_own_ray_and_ctrl_c_checkpoints_and_leaves_nothing(tmp_path):
    """No runtime.ray_address: the run starts a local Ray for its rollout workers and rank actors. Ctrl-C
    (SIGINT to the terminal's whole process group) writes a checkpoint with every rank's shards, then
    everything the run started is gone."""
    run = tmp_path / "runs" / "c"
    proc = subprocess.Popen([sys.executable, "-m", "sao.cli", "train", *RAY, "train.steps=20", "output.name=c",
                             "--quiet"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_for_step(proc, run, 1)
    started = [p for p, _ in _descendants(proc.pid)]
    assert len(_ray_actors("TrainerRank", proc.pid)) == 2
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130 and "checkpoint" in err and "Traceback" not in err, err[-3000:]
    assert len(list((_latest(run) / "trainer").glob("*.distcp"))) == 2
    _wait(lambda: not any(_alive(p) for p in started), 30, None)
    assert not any(_alive(p) for p in started), "a process outlived the run"


def test_tensors_travel_from_rank_0_as_numpy_bytes_and_come_back_equal():
    from sao.trainer.ray_ranks import Packed

    for t in (torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.tensor(2.5), torch.zeros(0, 4),
              torch.arange(6).view(2, 3).t()):  # the last one is not contiguous
        back = Packed(t).tensor()
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        back += 1  # a plain writable tensor, not a view of the object store's read-only bytes


def test_exported_weights_reach_the_ray_backend_as_rank_0s_reference(ray_address):
    """Rank 0 puts the flat buffer in the object store; the Ray rollout backend publishes that very reference
    (the driver never fetches the bytes), and the driver can still read the tensors when it needs them."""
    import ray

    from sao.runtime.ray_backend import _weights_ref
    from sao.trainer.ray_ranks import RemoteWeights

    @ray.remote
    def rank0():  # as TrainerRank.call does for export_weights: put in its own process, return the reference
        flat = torch.cat([torch.arange(6.0), torch.ones(4)]).numpy()
        return [ray.put(flat)]

    ref = ray.get(rank0.remote())[0]
    weights = RemoteWeights(ref, [(2, 3), (4,)])
    assert _weights_ref(weights) is ref  # forwarded as it is, not put again
    assert len(weights) == 2 and torch.equal(weights[0], torch.arange(6.0).view(2, 3))
    assert torch.equal(weights[1], torch.ones(4))
    first = weights[0]
    first += 1  # plain writable tensors, not the store's read-only bytes
    plain = [torch.zeros(2)]
    assert _weights_ref(plain) != ref and ray.get(_weights_ref(plain)).tolist() == [0.0, 0.0]


def test_a_rank_that_stops_answering_after_the_others_answered_is_bounded(ray_address, monkeypatch):
    """Rank 0 answered; rank 1 went quiet after the call's last collective (CI's SIGSTOP once landed there
    and the driver waited for it forever): it is named as hung trainer.timeout_s + GRACE_S after the answer."""
    import ray

    from sao.trainer import ray_ranks
    from sao.trainer.launch import RankFailed

    monkeypatch.setattr(ray_ranks, "GRACE_S", 0.5)

    @ray.remote(num_cpus=0)
    class Rank:
        def call(self, delay: float) -> str:
            time.sleep(delay)
            return "done"

    actors = [Rank.remote(), Rank.remote()]
    ranks = ray_ranks.RayRanks(actors, None, timeout_s=1.0)
    ranks.placement = [{"pid": 1, "ip": "a"}, {"pid": 2, "ip": "b"}]
    assert ranks._gather("step", [a.call.remote(0.0) for a in actors]) == ["done", "done"]
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"step: trainer rank 1 \(Ray actor, pid 2 on b\) did not answer"):
        ranks._gather("step", [actors[0].call.remote(0.0), actors[1].call.remote(600.0)])
    assert time.monotonic() - t0 < 10
    assert ranks.actors == []  # every rank actor was ended with the failure
