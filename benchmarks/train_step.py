"""Cost of one SAO train step against a one-pass actor step, on the same model and batches, and of
each model pass inside it (docs/performance.md).

    python benchmarks/train_step.py [--batches 6] [--repeats 3] [key=value ...]

Builds the run's starting policy (the cached SFT warm start of `sao train`), samples `--batches`
batches of B trajectories on the default task with the torch engine, then times, on each batch:
  - one_pass: a `running_mean` step (one actor forward + backward + AdamW step; the work of a
    GRPO step once advantages are known);
  - sao: a full SAO step (critic forward+backward x K, the first forward doubling as v0; v2 no-grad
    forward; GAE twice; one actor forward+backward), with the learner's per-pass timers;
for the padded batch (`train.pack=false`, the path before packing) and packed rows. Each timing is
the median over `--repeats` passes over the batches, after one warm-up pass. Writes
benchmarks/results/train_step.json and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from sao.algo.registry import get_algorithm
from sao.config import load_config
from sao.engine.torch_engine import TorchEngine
from sao.envs import make_environment
from sao.models.chat import ChatCodec
from sao.models.critic import build_critic
from sao.models.tiny import load_model
from sao.models.tokenizer import load_tokenizer
from sao.runtime.model_setup import prepare_base_model
from sao.runtime.train import limits_of, usable_batch
from sao.runtime.worker_host import quiet_transformers
from sao.trainer.batch import collate
from sao.trainer.learner import Learner

PASSES = ["perf/critic_forward_s", "perf/critic_backward_s", "perf/critic_v2_s", "perf/gae_s", "perf/actor_s"]


def sample_batches(cfg, n: int):
    model_path, _ = prepare_base_model(cfg)
    codec = ChatCodec(load_tokenizer(model_path))
    env = make_environment(cfg.env.name, cfg.env.options, cfg.train.seed)
    engine = TorchEngine(load_model(model_path), codec.tokenizer.pad_token_id, max_batch=cfg.rollout.concurrency,
                         seed=cfg.train.seed)
    tasks = env.train_tasks()
    batches = [usable_batch(engine, env, codec, tasks, limits_of(cfg), cfg.train.batch_size)[0] for _ in range(n)]
    return model_path, codec, batches


def time_steps(cfg, algo: str, pack: bool, model_path, pad_id: int, batches, repeats: int) -> dict:
    """Median seconds per step (and per pass) over `repeats` sweeps of the batches; models are reset
    to their start for every sweep so each sweep does the same work."""
    actor0 = load_model(model_path)
    critic0 = build_critic(model_path) if get_algorithm(algo).uses_critic else None
    critic_cfg = cfg.critic.model_copy(update={"warmup_steps": 0})
    train_cfg = cfg.train.model_copy(update={"pack": pack})
    per_batch: dict[str, list[list[float]]] = {}
    for sweep in range(repeats + 1):  # sweep 0 warms up allocator and caches
        learner = Learner(copy.deepcopy(actor0), copy.deepcopy(critic0), get_algorithm(algo), cfg.algo, critic_cfg,
                          train_cfg)
        for i, trajs in enumerate(batches):
            t0 = time.perf_counter()
            m = learner.step(collate(trajs, pad_id))
            m["step_s"] = time.perf_counter() - t0
            if sweep:
                for k in ["step_s", *PASSES, "perf/padded_frac", "perf/train_tokens", "perf/train_positions"]:
                    per_batch.setdefault(k, [[] for _ in batches])[i].append(m.get(k, 0.0))
    out = {k: [statistics.median(v) for v in rows] for k, rows in per_batch.items()}
    out["step_s_total"] = sum(out["step_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/train_step.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    quiet_transformers()
    cfg = load_config(None, ns.overrides)
    torch.manual_seed(cfg.train.seed)
    model_path, codec, batches = sample_batches(cfg, ns.batches)
    torch.set_num_threads(ns.threads)
    pad = codec.tokenizer.pad_token_id
    res = {f"{algo}_{'packed' if pack else 'padded'}": time_steps(cfg, algo, pack, model_path, pad, batches, ns.repeats)
           for algo, pack in itertools.product(("running_mean", "sao"), (False, True))}
    summary = {
        "threads": ns.threads, "batches": ns.batches, "repeats": ns.repeats, "batch_size": cfg.train.batch_size,
        "real_tokens": res["sao_padded"]["perf/train_tokens"],
        "padded_frac": {k: statistics.mean(v["perf/padded_frac"]) for k, v in res.items()},
        "sao_over_one_pass_padded": res["sao_padded"]["step_s_total"] / res["running_mean_padded"]["step_s_total"],
        "sao_over_one_pass_packed": res["sao_packed"]["step_s_total"] / res["running_mean_packed"]["step_s_total"],
        "sao_packed_over_padded": res["sao_packed"]["step_s_total"] / res["sao_padded"]["step_s_total"],
        "sao_packed_over_one_pass_padded": res["sao_packed"]["step_s_total"] / res["running_mean_padded"]["step_s_total"],
        "overrides": ns.overrides, "runs": res,
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    n = len(batches)
    print(f"{'ms per step (mean of ' + str(n) + ' batches)':<34}" + "".join(f"{k:>22}" for k in res))
    for key in ["step_s", *PASSES]:
        print(f"{key:<34}" + "".join(f"{1000 * sum(v.get(key, [0.0] * n)) / n:>22.1f}" for v in res.values()))
    print(f"{'padded share of positions':<34}" + "".join(f"{summary['padded_frac'][k]:>22.2f}" for k in res))
    for k in ("sao_over_one_pass_padded", "sao_over_one_pass_packed", "sao_packed_over_padded",
              "sao_packed_over_one_pass_padded"):
        print(f"{k:<34}{summary[k]:>10.2f}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
