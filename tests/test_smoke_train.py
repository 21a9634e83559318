"""Smoke tests that run the real `sao` entry points for a few steps and check what they leave."""

import json
import subprocess
import sys

import pytest
from conftest import TINY as BASE

TINY = [*BASE, "eval.num_tasks=8", "eval.every=2", "output.trajectories_every=1", "output.save_every=2",
        "model.cache_dir=cache"]  # its own cache: test_sync_mode_and_cached_sft_model counts the entries
pytestmark = pytest.mark.slow


def _sao(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "sao.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


REQUIRED = [
    "reward/mean", "dis/masked_low_frac", "dis/masked_high_frac", "critic/explained_variance", "critic/value_loss",
    "actor/grad_norm", "critic/grad_norm", "async/lag_mean", "async/lag_max", "async/queue_age_s",
    "async/trainer_idle_frac", "async/rollout_idle_frac", "perf/tokens_per_s", "perf/weight_sync_ms",
    "perf/padded_frac", "perf/trainer_all_cores_frac", "guard/skipped_updates",
]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("smoke")
    proc = _sao("train", *TINY, "output.name=smoke", "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, cwd / "runs" / "smoke", proc


def test_train_writes_a_complete_run_directory(async_run):
    cwd, run, proc = async_run
    assert "held-out accuracy:" in proc.stdout and str(run.relative_to(cwd)) in proc.stdout
    rows = _metrics(run)
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    keys = set().union(*steps)
    assert not [k for k in REQUIRED if k not in keys]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4]
    assert any("parity/max_abs_diff" in r and r["parity/max_abs_diff"] <= 1e-4 for r in rows)
    assert all(r["async/lag_max"] <= 1 for r in steps)  # runtime.max_lag=1
    assert list((run / "tb").glob("events.out.tfevents.*"))
    for part in ("actor", "critic"):
        assert (run / "checkpoints" / "final" / part / "config.json").is_file()
        assert (run / "checkpoints" / "final" / part / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step_000002" / "actor" / "model.safetensors").is_file()
    text = (run / "trajectories" / "step_000001.txt").read_text()
    assert "[PROMPT]" in text and "[ACTION v0]" in text
    assert (run / "trajectories" / "step_000001.jsonl").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0 and summary["steps"] == 4
    assert "train:\n  steps: 4" in (run / "config.yaml").read_text()
    audit_is_clean(run)


def audit_is_clean(run, steps=4, batch=4):
    """Every issued episode is trained once, dropped once, or still pending in the final checkpoint."""
    import torch

    events = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()]
    issued = {e["id"] for e in events if e["event"] == "issued"}
    trained = [e["id"] for e in events if e["event"] == "trained"]
    dropped = [e["id"] for e in events if e["event"] == "dropped"]
    assert len(trained) == steps * batch and len(set(trained)) == len(trained)
    assert not set(trained) & set(dropped) and len(set(dropped)) == len(dropped)
    state = torch.load(run / "checkpoints" / "final" / "trainer_state.pt", weights_only=False)
    pending = {a["id"] for a in state["scheduler"]["pending"]} | {json.loads(t)["id"] for t in state["queue"]["queued"]}
    assert issued == set(trained) | set(dropped) | pending  # nothing lost
    assert not pending & (set(trained) | set(dropped))
    return events, state


def test_eval_and_report_on_the_run(async_run):
    cwd, run, _ = async_run
    proc = _sao("eval", str(run), "eval.num_tasks=8", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n"] == 8 and 0.0 <= out["accuracy"] <= 1.0
    proc = _sao("report", str(run), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("reward", "eval_accuracy", "dis_masked", "value_loss", "lag", "idle"):
        png = run / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_mode_and_cached_sft_model(async_run):
    cwd, _, _ = async_run
    proc = _sao("train", *TINY, "train.steps=2", "eval.every=0", "output.name=sync", "--sync", "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(cwd / "runs" / "sync")
    assert [r["step"] for r in rows if "perf/gen_s" in r] == [1, 2]
    assert len([p for p in (cwd / "cache").iterdir() if p.is_dir()]) == 1  # the SFT model was reused, not rebuilt


def test_any_local_hf_model_folder_works_in_place_of_the_builtin(tmp_path):
    """model.path: a Qwen2-architecture folder from disk (no SFT, nothing downloaded)."""
    from sao.models.tiny import build_tiny_model
    from sao.models.tokenizer import load_tokenizer

    model_dir = build_tiny_model(tmp_path / "qwen2-model", arch="qwen2", hidden_size=32, num_layers=1, num_heads=2,
                                 intermediate_size=64)
    tok = load_tokenizer(model_dir)  # AutoTokenizer would drop spaces/newlines of this vocabulary
    assert tok.decode(tok.encode("a b\nc", add_special_tokens=False)) == "a b\nc"
    args = [a for a in TINY if not a.startswith(("model.", "sft."))]
    proc = _sao("train", *args, f"model.path={model_dir}", "train.steps=2", "eval.every=0", "output.name=q",
                "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / ".sao_cache").exists()  # no built-in model was built
    cfg = (tmp_path / "runs" / "q" / "checkpoints" / "final" / "actor" / "config.json").read_text()
    assert '"model_type": "qwen2"' in cfg


def test_pretrain_critic_then_train_from_it(async_run):
    cwd, _, _ = async_run
    proc = _sao("pretrain-critic", *TINY, "--steps", "3", "--out", "critics/c", "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3 and (cwd / "critics" / "c" / "model.safetensors").is_file()
    proc = _sao("train", *TINY, "train.steps=1", "eval.every=0", "critic.path=critics/c", "output.name=pre",
                "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_pretrain_a_lora_critic_then_train_from_its_adapter(async_run):
    """critic.lora in `sao pretrain-critic` trains adapters plus the value head and saves an adapter
    folder; `sao train critic.path=` trains on from it (tests/test_lora.py checks the weights come back)."""
    from safetensors.torch import load_file

    cwd, _, _ = async_run
    proc = _sao("pretrain-critic", *TINY, "critic.lora.r=2", "--steps", "3", "--out", "critics/lora", "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = cwd / "critics" / "lora"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2 and not (out / "model.safetensors").exists()
    assert any("score" in k for k in load_file(out / "adapter_model.safetensors"))  # the value head travels along
    proc = _sao("train", *TINY, "train.steps=1", "eval.every=0", "critic.path=critics/lora", "critic.lora.r=2",
                "output.name=prelora", "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (cwd / "runs" / "prelora" / "checkpoints" / "final" / "critic" / "adapter_config.json").is_file()
