"""Weight-update latency per MB on this machine: trainer publish, torch engine load, vLLM update.

    python benchmarks/weight_update.py [--sizes 96x2 256x4 512x8 1024x8] [--repeats 5] [--no-vllm]
                                       [--out benchmarks/results/weight_update.json]

Each size is HIDDENxLAYERS of the built-in Llama architecture (head_dim 64, MLP 4x hidden, char
vocabulary, fp32), randomly initialized. Per size and repetition, a new version of the weights is:
  publish      copied by the trainer into the shared-memory buffer (SharedWeights.publish)
  torch load   pulled by a torch engine between decode steps (TorchEngine.update_weights)
  vllm update  pushed to a vLLM server sao started (VLLMEngine.update_weights: pause(keep), safetensors
               written to /dev/shm, reloaded in place with the tied head re-packed, version label, resume)
Reported: the median milliseconds and milliseconds per MB of fp32 weights. The vLLM server runs with
--enforce-eager; its start-up is not timed. Run it under `flock /tmp/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sao.config import EngineConfig
from sao.engine import make_engine
from sao.models.tiny import build_tiny_model, load_model
from sao.runtime.weight_sync import SharedWeights

ROOT = Path(__file__).resolve().parents[1]


def measure(hidden: int, layers: int, repeats: int, vllm_python: str | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="sao-wu-"))
    path = build_tiny_model(tmp / "m", hidden_size=hidden, num_layers=layers, num_heads=hidden // 64 or 1,
                            intermediate_size=4 * hidden, max_positions=512)
    trainer = load_model(path)
    params = list(trainer.parameters())
    numel = sum(p.numel() for p in params)
    mb = numel * 4 / 2**20
    weights = SharedWeights.for_model(trainer)
    engines = {"torch load": make_engine(EngineConfig(name="torch", device="cpu"), path, pad_id=0, max_batch=4, seed=0,
                                         weight_source=weights)}
    if vllm_python:
        engines["vllm update"] = make_engine(EngineConfig(name="vllm", python=vllm_python,
                                                          server_args=["--enforce-eager"]),
                                             path, pad_id=0, max_batch=4, seed=0, weight_source=weights)
    times: dict[str, list[float]] = {"publish": [], **{k: [] for k in engines}}
    try:
        for version in range(1, repeats + 1):
            with torch.no_grad():
                for p in params:
                    p.add_(1e-3 * torch.randn_like(p))
            times["publish"].append(weights.publish(params, version))
            for name, engine in engines.items():
                t0 = time.perf_counter()
                assert engine.update_weights(), f"{name}: no update for version {version}"
                times[name].append((time.perf_counter() - t0) * 1000)
    finally:
        for engine in engines.values():
            if hasattr(engine, "shutdown"):
                engine.shutdown()
    row = {"hidden": hidden, "layers": layers, "params_m": round(numel / 1e6, 2), "mb_fp32": round(mb, 1)}
    for name, ts in times.items():
        med = statistics.median(ts)
        row[f"{name} ms"] = round(med, 2)
        row[f"{name} ms/MB"] = round(med / mb, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["96x2", "256x4", "512x8", "1024x8"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--out", default="benchmarks/results/weight_update.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a rollout worker
    vllm_python = None if args.no_vllm or not Path(args.vllm_python).is_file() else args.vllm_python
    rows = []
    for size in args.sizes:
        hidden, layers = map(int, size.split("x"))
        rows.append(measure(hidden, layers, args.repeats, vllm_python))
        print(rows[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "threads": 1, "vllm": vllm_python is not None,
                                          "rows": rows}, indent=2) + "\n")
    cols = [c for c in rows[0] if c not in ("hidden", "layers")]
    print("| size | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 1))
    for r in rows:
        print(f"| {r['hidden']}x{r['layers']} | " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
