"""benchmarks/gpu_check.sh, the one GPU check, kept runnable on a machine without a GPU: `--device cpu` runs
every step of it on the CPU with small sizes, so only CUDA itself is left for a lent GPU to check."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_STEPS": "12",
           "GPU_CHECK_ROOT": str(tmp_path / "runs"), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    out = tmp_path / "out"
    train = json.loads((out / "train.json").read_text())
    assert [r["mode"] for r in train] == ["async", "sync"] and all(r["steps"] == 12 for r in train)
    assert all(r["training_tokens_per_s"] > 0 and r["generation_tokens_per_s"] > 0 for r in train)
    shapes = json.loads((out / "gpu_shapes.json").read_text())["shapes"]["tiny"]
    assert [r["algo"] for r in shapes["train"]] == ["sao", "grpo"] and len(shapes["engine"]) == 2
    assert shapes["train"][0]["critic_s_median"] > 0 and shapes["train"][1]["critic_s_median"] == 0
    assert json.loads((out / "critic_overlap.json").read_text())["repeats"] == 3
    assert 'tests="4"' in (out / "pytest.xml").read_text() and "3 passed, 1 skipped" in proc.stdout
