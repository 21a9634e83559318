"""Weight export from 2 trainer ranks into the runtime's process: local ranks vs Ray rank actors.

    PYTHONPATH=$PWD python benchmarks/ray_ranks.py [--sizes 512x8,1024x8] [--repeats 5]

`export_weights()` is what the runtime calls before every publish (sao/runtime/loop.py). Local ranks
(`RankDriver`, sao/trainer/ranks.py): this process is rank 0 and receives the all-gathered buckets
itself. Ray rank actors (`RayRankDriver`, sao/trainer/ray_ranks.py): rank 0 is an actor, and the full
weights travel rank 0 -> Ray object store -> this process (the extra hop a cluster layout pays). Both
trainers are up at once, and their exports alternate (A, B, A, B, ...), so a shared machine's load
falls on both alike. Each size is HIDDENxLAYERS of the built-in Llama architecture with a critic of
the same size (512x8 ~34M, 1024x8 ~134M parameters each), randomly initialized; fp32 on CPU.
Reports the median seconds per export and per MB of weights. Writes benchmarks/results/ray_ranks.json.

Since the Ray rollout backend takes rank 0's reference (sao/runtime/ray_backend.py `_weights_ref`), a publish
from Ray ranks also gets two arms, each what the driver spends before the rollout actors can read the new
weights: `ray_via_driver` (the route before: fetch the bytes into the driver, flatten, put them again) and
`ray_direct` (export, then forward the reference rank 0 put).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "ray_ranks.json"


def build(hidden: int, layers: int):
    """One rank's DistributedLearner on the benchmark's models (every rank runs this)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig

    from sao.algo.registry import get_algorithm
    from sao.config import AlgoConfig, CriticConfig, TrainConfig
    from sao.trainer.distributed import DistributedLearner

    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=104, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 64, 1),
                         intermediate_size=4 * hidden, max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=0, num_labels=1, classifier_dropout=0.0)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(config)
    critic = AutoModelForTokenClassification.from_config(config)
    return DistributedLearner(actor, critic, get_algorithm("sao"), AlgoConfig(), CriticConfig(), TrainConfig())


def measure(hidden: int, layers: int, repeats: int) -> dict:
    from sao.config import TrainerConfig
    from sao.trainer.ranks import start_trainer_ranks
    from sao.trainer.ray_ranks import start_ray_ranks

    local = start_trainer_ranks(2, build, (hidden, layers), timeout_s=600)
    on_ray = start_ray_ranks(TrainerConfig(ranks=2), build, (hidden, layers))
    try:
        mb = sum(t.numel() * t.element_size() for t in local.export_weights()) / 2**20
        on_ray.export_weights()  # warm-up of both paths
        import ray

        from sao.runtime.ray_backend import _weights_ref
        from sao.runtime.weight_sync import flatten

        arms = {"local": local.export_weights,
                "ray": lambda: on_ray.export_weights().tensors(),  # the bytes in this process, as before
                "ray_via_driver": lambda: ray.put(flatten(list(on_ray.export_weights())).numpy()),
                "ray_direct": lambda: _weights_ref(on_ray.export_weights())}
        times: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(repeats):
            for name, arm in arms.items():
                t = time.perf_counter()
                arm()  # ray.put returns once the bytes are in the store
                times[name].append(time.perf_counter() - t)
    finally:
        on_ray.close()
        local.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": f"{hidden}x{layers}", "export_mb": round(mb, 1), "repeats": repeats,
            **{f"{k}_export_s": round(v, 3) for k, v in med.items()},
            **{f"{k}_export_s_per_mb": round(v / mb, 5) for k, v in med.items()},
            "ray_over_local": round(med["ray"] / med["local"], 2),
            "direct_over_via_driver": round(med["ray_direct"] / med["ray_via_driver"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512x8,1024x8")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=2 * 2**30)
    rows = []
    try:
        for size in args.sizes.split(","):
            hidden, layers = (int(x) for x in size.split("x"))
            rows.append(measure(hidden, layers, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
