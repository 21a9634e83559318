"""Trainer memory per rank with FSDP2: 1 rank (the one-process Learner) vs N ranks (DistributedLearner).

    PYTHONPATH=$PWD python benchmarks/fsdp_memory.py [--sizes 512x8,1024x8] [--ranks 1,2] [--steps 2]
                                                     [--init full,meta]

Each size is HIDDENxLAYERS of the built-in Llama architecture (head_dim 64, MLP 4x hidden, char
tokenizer; 512x8 ~34M, 1024x8 ~134M parameters), randomly initialized from a config (no download).
The actor and a critic of the same size train with `sao` (K=2 critic updates, frozen critic
attention, DIS), fp32 on CPU, on one batch of `--batch` trajectories of ~`--tokens` tokens.

Per rank (every figure is the largest over ranks):
    state_mb        parameters + gradients + AdamW states this rank holds (its shards), exact
    train_peak_mb   peak RSS while training (reset after the models are built and sharded)
    export_peak_mb  peak RSS once the weights were exported, streamed (rank 0: one 256 MiB bucket at a time)
    init_peak_mb    peak RSS of the whole process up to the models built and sharded
    init_peak_rank0_mb / init_peak_others_mb   the same, for rank 0 and the largest of ranks 1..N-1
    init            N > 1: `full` = every rank builds the whole models, then shards them; `meta` = ranks
                    1..N-1 build them on the meta device and receive their shards from rank 0
                    (DistributedLearner(from_rank0=True), as `sao train trainer.ranks=N` does)
    base_mb         RSS after imports, before any model
    step_s          mean wall time of an optimizer step after one warm-up step
    export_s_per_mb weight export from shards (bucketed full_tensor, rank 0 keeps them) per MB of weights
Each configuration runs in fresh processes (one per rank). Writes benchmarks/results/fsdp_memory.json.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "fsdp_memory.json"


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Give freed heap back to the OS, then restart the peak-RSS counter (Linux: clear_refs 5)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def _models(hidden: int, layers: int, meta: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig

    from sao.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 64, 1),
                         intermediate_size=4 * hidden, max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, num_labels=1, classifier_dropout=0.0)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        actor = AutoModelForCausalLM.from_config(config)
        critic = AutoModelForTokenClassification.from_config(config)
    return actor, critic


def _batch(actor, n: int, tokens: int):
    from sao.trainer.batch import collate
    from sao.types import Trajectory

    gen = torch.Generator().manual_seed(1)
    trajs = []
    for i in range(n):
        length = tokens + int(torch.randint(-tokens // 4, tokens // 4 + 1, (1,), generator=gen))
        prompt = length // 4
        ids = torch.randint(3, 100, (length,), generator=gen).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        trajs.append(Trajectory(str(i), f"t{i}", ids, mask, [-4.0 * m for m in mask], [0 if m else -1 for m in mask],
                                prompt, reward=float(i % 2)))
    return collate(trajs, pad_id=0)


def _state_mb(learner) -> float:
    """Bytes this rank holds for parameters, gradients and AdamW states (local shards only)."""
    total = 0
    for model in (learner.actor, learner.critic):
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size() * (1 + 3 * p.requires_grad)  # + grad, exp_avg, exp_avg_sq
    return total / 2**20


def _rank(rank: int, world: int, port: int, hidden: int, layers: int, args: dict, out: str) -> None:
    torch.set_num_threads(max(1, args["threads"] // world))
    from sao.algo.registry import get_algorithm
    from sao.config import AlgoConfig, CriticConfig, TrainConfig

    base = _rss_mb("VmRSS")
    cfgs = (get_algorithm("sao"), AlgoConfig(), CriticConfig(warmup_steps=0), TrainConfig(lr=1e-5))
    from_rank0 = args["init"] == "meta"
    actor, critic = _models(hidden, layers, meta=from_rank0 and rank != 0)
    batch = _batch(actor, args["batch"], args["tokens"])
    if world == 1:
        from sao.trainer.learner import Learner

        learner = Learner(actor, critic, *cfgs)
    else:
        from sao.trainer.distributed import DistributedLearner, init_ranks

        init_ranks(rank, world, port, timeout_s=600)
        learner = DistributedLearner(actor, critic, *cfgs, from_rank0=from_rank0)
    params = sum(p.numel() for p in actor.parameters())  # the full count, read before the models are dropped
    del actor, critic
    init_peak = _rss_mb("VmHWM")
    _reset_peak()
    learner.step(batch)  # warm-up: AdamW states are allocated here
    times = []
    for _ in range(args["steps"]):
        t = time.perf_counter()
        learner.step(batch)
        times.append(time.perf_counter() - t)
    train_peak = _rss_mb("VmHWM")  # before the export, which adds a bucket of full weights on rank 0
    t = time.perf_counter()
    if world == 1:
        from sao.models.lora import engine_parameters

        n = sum(x.detach().clone().numel() * 4 for x in engine_parameters(learner.actor))
    else:
        from sao.trainer.distributed import timed_export

        _, n = timed_export(learner)
    export_s = time.perf_counter() - t
    row = {"rank": rank, "base_mb": base, "state_mb": _state_mb(learner), "train_peak_mb": train_peak,
           "export_peak_mb": _rss_mb("VmHWM"), "init_peak_mb": init_peak, "step_s": sum(times) / len(times), "export_s": export_s,
           "export_mb": n / 2**20, "actor_params_m": params / 1e6}
    Path(f"{out}.{rank}.json").write_text(json.dumps(row))


def measure(hidden: int, layers: int, world: int, init: str, args: dict, tmp: Path) -> dict:
    from sao.trainer.launch import spawn_ranks

    out = tmp / f"{hidden}x{layers}_{world}_{init}"
    spawn_ranks(_rank, world, hidden, layers, {**args, "init": init}, str(out))
    rows = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(world)]
    mb = rows[0]["export_mb"]
    return {"size": f"{hidden}x{layers}", "actor_params_m": round(rows[0]["actor_params_m"], 1), "ranks": world,
            "init": init if world > 1 else "-",
            **{k: round(max(r[k] for r in rows), 1)
               for k in ("base_mb", "state_mb", "train_peak_mb", "init_peak_mb", "export_peak_mb")},
            "init_peak_rank0_mb": round(rows[0]["init_peak_mb"], 1),
            "init_peak_others_mb": round(max(r["init_peak_mb"] for r in rows[1:]), 1) if world > 1 else None,
            "step_s": round(max(r["step_s"] for r in rows), 2),
            "export_s_per_mb": round(max(r["export_s"] for r in rows) / mb, 5) if mb else None}


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512x8,1024x8")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--init", default="full,meta", help="N > 1: how ranks get the models (see above)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads shared by the ranks")
    a = ap.parse_args()
    # glibc keeps freed heap blocks (and raises its mmap threshold after each large free), so RSS would
    # remember tensors long gone (the whole models before sharding, all-gather buffers); a fixed
    # threshold maps every tensor over 1 MiB on its own, and RSS follows the live tensors
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    args = {"batch": a.batch, "tokens": a.tokens, "steps": a.steps, "threads": a.threads}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            hidden, layers = map(int, size.split("x"))
            for world in map(int, a.ranks.split(",")):
                for init in a.init.split(",") if world > 1 else ["full"]:
                    rows.append(measure(hidden, layers, world, init, args, Path(tmp)))
                    print(rows[-1], flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    meta = {"args": args, "malloc_mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"], "torch": torch.__version__}
    RESULTS.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    cols = [c for c in rows[0] if c != "size"]
    print("| size | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['size']} | " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
