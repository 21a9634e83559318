"""LoRA (peft): adapters train, engines receive merged weights, the parity gate holds, checkpoints
hold the adapter (and the merged model on request), and the critic may be a smaller model with LoRA."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY as BASE
from safetensors.torch import load_file

from sao.config import LoraSettings
from sao.models.critic import build_critic, critic_values
from sao.models.lora import engine_parameters, trainable_parameters, with_lora
from sao.models.tiny import build_tiny_model, load_model

TINY = [*BASE, "train.steps=3", "eval.num_tasks=8", "model.cache_dir=cache", "train.lr=1e-2",
        "algo.entropy_coef=0.1"]  # a gradient even when a 20-step SFT model earns no reward (zero advantages)
pytestmark = pytest.mark.slow


def test_engine_parameters_are_the_merged_weights_in_plain_order(tiny_model_dir):
    actor = with_lora(load_model(tiny_model_dir), LoraSettings(r=4))
    torch.manual_seed(0)
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # B starts at 0 (no change); make the adapter matter
    total = sum(p.numel() for p in actor.parameters())
    assert 0 < trainable_parameters(actor) < total / 4  # only adapters train
    plain = load_model(tiny_model_dir)
    weights = engine_parameters(actor)
    assert [tuple(w.shape) for w in weights] == [tuple(p.shape) for p in plain.parameters()]
    with torch.no_grad():
        for p, w in zip(plain.parameters(), weights):
            p.copy_(w)
        ids = torch.randint(0, 100, (2, 24))
        assert (actor(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max() < 1e-5


def test_critic_with_lora_trains_adapters_and_the_value_head_only(tiny_model_dir):
    critic = with_lora(build_critic(tiny_model_dir), LoraSettings(r=4), value_head=True)
    trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable) and all("lora_" in n or "score" in n for n in trainable)
    ids = torch.randint(0, 100, (2, 10))
    assert critic_values(critic, ids, torch.ones_like(ids)).abs().max() == 0  # zero head: V starts at 0


def test_lora_run_with_a_smaller_lora_critic_keeps_the_parity_gate(tmp_path):
    critic_dir = build_tiny_model(tmp_path / "small_critic", hidden_size=16, num_layers=1, num_heads=2,
                                  intermediate_size=32, seed=1)
    args = [*TINY, "model.lora.r=4", "model.lora.save_merged=true", f"critic.path={critic_dir}", "critic.lora.r=2",
            "output.name=lora", "--quiet"]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "lora"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("parity/max_abs_diff" in r and r["parity/max_abs_diff"] <= 1e-4 for r in rows)
    assert [r["train/actor_version"] for r in rows if "reward/mean" in r] == [0, 1, 2]  # one warm-up step
    final = run / "checkpoints" / "final"
    adapter = json.loads((final / "actor" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and not (final / "actor" / "model.safetensors").exists()  # the adapter, not the model
    assert (final / "critic" / "adapter_config.json").is_file()
    # the merged model is a plain HF folder whose weights moved away from the base by the adapter's training
    merged = load_file(final / "actor_merged" / "model.safetensors")
    base = load_file(next((tmp_path / "cache").glob("tiny-*/model.safetensors")))  # not the entry's .lock file
    key = "model.layers.0.self_attn.q_proj.weight"
    assert merged[key].shape == base[key].shape and not torch.equal(merged[key], base[key])
    ev = subprocess.run([sys.executable, "-m", "sao.cli", "eval", str(run), "eval.num_tasks=4"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert 0.0 <= json.loads(ev.stdout.strip().splitlines()[-1])["accuracy"] <= 1.0
    # --resume: adapters, value head and optimizer states come back on the same base model; 2 more steps
    res = subprocess.run([sys.executable, "-m", "sao.cli", "train", "--resume", str(run), "train.steps=5", "--quiet"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/actor_version"] for r in rows if "reward/mean" in r] == [0, 1, 2, 3, 4]
    state = torch.load(final / "trainer_state.pt", weights_only=False)["trainer"]
    # Adam's step count runs over the whole run: restored, not rebuilt (a new optimizer would say 2)
    assert state["actor_opt"]["state"][0]["step"] == state["actor_version"] == 4
    assert state["critic_opt"]["state"][0]["step"] == state["critic_version"]
    assert json.loads((final / "actor" / "adapter_config.json").read_text())["r"] == 4


def test_a_saved_lora_critic_comes_back_with_its_adapters_and_value_head(tiny_model_dir, tmp_path):
    """What `sao pretrain-critic critic.lora.r=...` saves and `critic.path=` (or --resume) loads: the same
    adapter and value-head weights, trainable, on the base model the adapter names."""
    from sao.config import LoraSettings
    from sao.models.critic import build_critic
    from sao.models.lora import load_lora_critic, with_lora

    critic = with_lora(build_critic(tiny_model_dir), LoraSettings(r=2), value_head=True)
    with torch.no_grad():
        for p in critic.parameters():
            if p.requires_grad:  # adapters and the value head's trainable copy: give them non-trivial values
                p.add_(torch.randn_like(p))
    critic.save_pretrained(tmp_path / "critic")
    back = load_lora_critic(tmp_path / "critic")
    want = {n: p for n, p in critic.named_parameters() if p.requires_grad}
    got = {n: p for n, p in back.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and any("score" in n for n in got)
    assert all(torch.equal(want[n], got[n]) for n in want)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(critic(input_ids=ids).logits, back(input_ids=ids).logits)
