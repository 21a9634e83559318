"""Cost of one SAO train step against a one-pass actor step, on the same model and batches, and of
each model pass inside it (docs/performance.md).

    python benchmarks/train_step.py [--batches 6] [--repeats 3] [key=value ...]
    python benchmarks/train_step.py --flops [--batches 4]     # FLOPs per pass: no timing, no load effects

Builds the run's starting policy (the cached SFT warm start of `sao train`), samples `--batches`
batches of B trajectories on the default task with the torch engine, then times, on each batch:
  - one_pass: a `running_mean` step (one actor forward + backward + AdamW step; the work of a
    GRPO step once advantages are known);
  - sao: a full SAO step (critic forward+backward x K, the first forward doubling as v0; v2 no-grad
    forward; GAE twice; one actor forward+backward), with the learner's per-pass timers;
for the padded batch (`train.pack=false`, the path before packing) and packed rows. The four
configurations take turns batch by batch (a burst of load from other processes hits all alike), and
each timing is the minimum over `--repeats` sweeps, after one warm-up sweep: on a shared machine the
minimum is the least disturbed measurement. Writes benchmarks/results/train_step.json and a table.
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
from sao.models.critic import build_critic, freeze_parameters
from sao.models.quiet import quiet_transformers
from sao.models.tiny import load_model
from sao.models.tokenizer import load_tokenizer
from sao.runtime.episodes import limits_of, usable_batch
from sao.runtime.model_setup import prepare_base_model
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


def make_learner(cfg, algo: str, pack: bool, actor0, critic0) -> Learner:
    critic_cfg = cfg.critic.model_copy(update={"warmup_steps": 0})
    train_cfg = cfg.train.model_copy(update={"pack": pack})
    critic = copy.deepcopy(critic0) if get_algorithm(algo).uses_critic else None
    return Learner(copy.deepcopy(actor0), critic, get_algorithm(algo), cfg.algo, critic_cfg, train_cfg)


def time_all(cfg, configs, model_path, pad_id: int, batches, repeats: int) -> dict:
    """Per configuration and batch, the minimum over `repeats` sweeps of the step time and of each pass;
    models restart from the same weights every sweep so each sweep does the same work."""
    actor0, critic0 = load_model(model_path), build_critic(model_path)
    keys = ["step_s", *PASSES, "perf/padded_frac", "perf/train_tokens", "perf/train_positions"]
    best: dict[str, dict[str, list[float]]] = {name: {k: [float("inf")] * len(batches) for k in keys} for name in configs}
    for sweep in range(repeats + 1):  # sweep 0 warms up allocator and caches
        learners = {name: make_learner(cfg, algo, pack, actor0, critic0) for name, (algo, pack) in configs.items()}
        for i, trajs in enumerate(batches):
            for name, learner in learners.items():  # configurations take turns
                t0 = time.perf_counter()
                m = learner.step(collate(trajs, pad_id))
                m["step_s"] = time.perf_counter() - t0
                if sweep:
                    for k in keys:
                        best[name][k][i] = min(best[name][k][i], m.get(k, 0.0))
    return {name: {**rows, "step_s_total": sum(rows["step_s"])} for name, rows in best.items()}


def pass_flops(cfg, model_path, pad_id: int, trajs, pack: bool) -> dict[str, float]:
    """FLOPs (torch.utils.flop_counter) of each model pass of a step on one batch: deterministic, so
    unaffected by other processes on the machine."""
    from torch.utils.flop_counter import FlopCounterMode

    from sao.algo.losses import dis_policy_loss, value_loss
    from sao.trainer.packing import actor_logprobs, critic_forward
    from sao.trainer.packing import pack as pack_rows

    actor, critic = load_model(model_path), build_critic(model_path)
    if cfg.critic.freeze_attention:  # as the learner does: no weight gradients for q/k/v/o
        freeze_parameters(critic, cfg.critic.freeze_pattern)
    batch = collate(trajs, pad_id)
    if pack:
        batch.packing = pack_rows(batch.input_ids, batch.attention_mask)
    mask = batch.action_mask
    out = {}
    with FlopCounterMode(display=False) as fc:  # one critic update: forward with grad + backward
        value_loss(critic_forward(critic, batch), torch.zeros_like(mask), mask)[0].backward()
    out["critic_update"] = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc, torch.inference_mode():  # v2
        critic_forward(critic, batch)
    out["critic_v2"] = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:  # the actor step
        logprobs, _ = actor_logprobs(actor, batch)
        dis_policy_loss(logprobs, batch.behavior_logprobs, torch.ones_like(mask), mask, 0.3, 5.0)[0].backward()
    out["actor_update"] = fc.get_total_flops()
    k = cfg.critic.updates_per_step
    out["sao_step"] = k * out["critic_update"] + out["critic_v2"] + out["actor_update"]
    out["one_pass_step"] = out["actor_update"]
    return out


def flops_main(ns, cfg, model_path, pad: int, batches) -> None:
    res = {name: [pass_flops(cfg, model_path, pad, trajs, pack) for trajs in batches]
           for name, pack in (("padded", False), ("packed", True))}
    tot = {name: {k: sum(r[k] for r in rows) for k in rows[0]} for name, rows in res.items()}
    tokens = [sum(len(t.token_ids) for t in trajs) for trajs in batches]
    per_token = {name: [r["sao_step"] / n for r, n in zip(rows, tokens)] for name, rows in res.items()}
    # cost per real token against the median: a step whose cost follows its real tokens stays near 1
    spread = {name: max(v) / statistics.median(v) for name, v in per_token.items()}
    summary = {
        "batches": ns.batches, "batch_size": cfg.train.batch_size, "per_batch": res, "total": tot,
        "real_tokens": tokens, "sao_flops_per_real_token": per_token, "max_over_median_per_real_token": spread,
        "sao_over_one_pass_padded": tot["padded"]["sao_step"] / tot["padded"]["one_pass_step"],
        "sao_over_one_pass_packed": tot["packed"]["sao_step"] / tot["packed"]["one_pass_step"],
        "sao_packed_over_padded": tot["packed"]["sao_step"] / tot["padded"]["sao_step"],
        "sao_packed_over_one_pass_padded": tot["packed"]["sao_step"] / tot["padded"]["one_pass_step"],
    }
    out = Path(ns.out.replace(".json", "_flops.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"{'GFLOP per step (sum of ' + str(len(batches)) + ' batches)':<40}{'padded':>12}{'packed':>12}")
    for k in ("critic_update", "critic_v2", "actor_update", "sao_step", "one_pass_step"):
        print(f"{k:<40}{tot['padded'][k] / 1e9:>12.2f}{tot['packed'][k] / 1e9:>12.2f}")
    for k in ("sao_over_one_pass_padded", "sao_over_one_pass_packed", "sao_packed_over_padded",
              "sao_packed_over_one_pass_padded"):
        print(f"{k:<40}{summary[k]:>12.2f}")
    print(f"{'max / median SAO FLOPs per real token':<40}{spread['padded']:>12.2f}{spread['packed']:>12.2f}")
    print(f"results: {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flops", action="store_true", help="count FLOPs per pass instead of timing")
    ap.add_argument("--out", default="benchmarks/results/train_step.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    quiet_transformers()
    cfg = load_config(None, ns.overrides)
    torch.manual_seed(cfg.train.seed)
    model_path, codec, batches = sample_batches(cfg, ns.batches)
    torch.set_num_threads(ns.threads)
    pad = codec.tokenizer.pad_token_id
    if ns.flops:
        return flops_main(ns, cfg, model_path, pad, batches)
    configs = {f"{algo}_{'packed' if pack else 'padded'}": (algo, pack)
               for algo, pack in itertools.product(("running_mean", "sao"), (False, True))}
    res = time_all(cfg, configs, model_path, pad, batches, ns.repeats)
    summary = {
        "threads": ns.threads, "batches": ns.batches, "repeats": ns.repeats, "batch_size": cfg.train.batch_size,
        "real_tokens": res["sao_padded"]["perf/train_tokens"],
        "padded_frac": {k: statistics.mean(v["perf/padded_frac"]) for k, v in res.items()},
        "statistic": "minimum over repeats per batch; configurations interleaved",
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
