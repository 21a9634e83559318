"""`sao train trainer.ranks=2` on the real CLI: the trainer on two FSDP2 ranks (gloo) that sao starts
itself, sharded checkpoints that resume at another rank count, (a killed rank: tests/test_faults.py; the math
across ranks: tests/test_distributed.py)."""

import subprocess
import sys

import pytest
import torch
from conftest import TINY
from faults import audit_of
from faults import rows as _rows

pytestmark = pytest.mark.slow


def test_two_ranks_train_checkpoint_and_resume_on_one(tmp_path):
    args = [*TINY, "trainer.ranks=2", "eval.every=2", "output.save_every=2", "output.name=r"]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "r"
    rows = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["train/actor_version"] == 3
    assert any(r.get("parity/max_abs_diff", 1) <= 1e-4 for r in _rows(run))  # the gate ran against 2 ranks
    final = run / "checkpoints" / "final"
    assert (final / "trainer" / ".metadata").is_file()  # DCP shards of models and optimizers
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(final / "actor")  # the plain HF export
    ev = subprocess.run([sys.executable, "-m", "sao.cli", "eval", str(run), "eval.num_tasks=4"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    res = subprocess.run([sys.executable, "-m", "sao.cli", "train", "--resume", str(run), "trainer.ranks=1",
                          "train.steps=6", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["train/actor_version"] for r in rows] == [0, 1, 2, 3, 4, 5]  # counters came back from the shards
    state = torch.load(final / "trainer_state.pt", weights_only=False)["trainer"]
    assert state["actor_opt"]["state"][0]["step"] == state["actor_version"] == 5  # Adam's state restored, not new


def test_ranks_survive_batches_slower_than_the_collective_timeout(tmp_path):
    """Followers wait for rank 0's next command outside any collective: every environment step takes 3 s,
    so rank 0 is away far longer than trainer.timeout_s=1 before the parity gate and between steps (on
    the old code the followers died in the gate's broadcast and the run ended with a gloo traceback)."""
    args = [*TINY, "trainer.ranks=2", "trainer.timeout_s=1", "env.options.step_latency_s=3",
            "env.options.step_latency_sigma=0", "train.steps=2", "output.name=idle"]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _rows(tmp_path / "runs" / "idle") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "Traceback" not in proc.stderr


def test_a_one_rank_run_resumes_on_two_ranks(tmp_path, sao_cli):
    """1 -> 2 on the real CLI: a one-rank run's checkpoint (HF folders, plain AdamW states) continues on two
    FSDP2 ranks with its optimizer states and counters, and the audit shows no episode trained twice.
    A batch too small to give every rank rows is still refused in one line."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    proc = sao_cli("train", *TINY, "trainer.ranks=8", cwd=tmp_path)
    assert proc.returncode == 2 and "trainer.ranks: 8 ranks need at least 8 trajectories" in proc.stderr
    run = tmp_path / "runs" / "one"
    one = subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "train.steps=2", "output.save_every=2",
                          "output.name=one", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert not (run / "checkpoints" / "final" / "trainer").exists()  # one rank: plain states, no shards
    res = subprocess.run([sys.executable, "-m", "sao.cli", "train", "--resume", str(run), "trainer.ranks=2",
                          "train.steps=4", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["train/actor_version"] for r in rows] == [0, 1, 2, 3]  # counters came from trainer_state.pt
    final = run / "checkpoints" / "final"
    dcp_to_torch_save(final / "trainer", tmp_path / "final.pt")  # the shards the two ranks wrote
    state = torch.load(tmp_path / "final.pt")
    actor_steps = {int(s["step"]) for s in state["actor_opt"]["state"].values()}
    critic_steps = {int(s["step"]) for s in state["critic_opt"]["state"].values()}
    assert actor_steps == {3} and critic_steps == {8}  # AdamW went on from the one-rank run's state, not anew
    audit_of(run)  # every issued episode trained, dropped or pending; none trained twice


def test_a_one_rank_checkpoint_is_refused_on_ray_ranks(tmp_path):
    """What 1 -> N does not cover yet: Ray rank actors (the optimizer states travel through the local
    driver only). One line naming the field."""
    from sao.config import ConfigError, load_config
    from sao.runtime.preflight import check_ranks

    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    cfg = load_config(None, ["trainer.ranks=2", "train.batch_size=4", "runtime.backend=ray"])
    with pytest.raises(ConfigError, match="runtime.backend: .* was saved by one trainer rank"):
        check_ranks(cfg, tmp_path)
    check_ranks(load_config(None, ["trainer.ranks=2", "train.batch_size=4"]), tmp_path)  # local ranks: fine
    (ckpt / "trainer").mkdir()
    check_ranks(cfg, tmp_path)  # shards: fine on ray too
