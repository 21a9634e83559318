"""How much of the critic's time hides behind the actor's step when the critic has its own process
(critic.placement=separate, sao/trainer/critic_ranks.py), against the colocated sequence.

    python benchmarks/critic_overlap.py [--batches 8] [--repeats 3] [--threads 2] [key=value ...]

Samples `--batches` batches on the default task from the run's starting policy (benchmarks/train_step.py),
then runs them through two trainers, in turns (paired; the order alternates each repeat):
  - colocated: one process, v0 -> K critic updates -> v2 -> actor per batch, `--threads` torch threads;
  - separate: the actor in this process (`--threads` - 1 threads, at least 1), the critic in its own
    process (critic.threads, default 1; `critic.ranks=M`: M FSDP2 critic processes), handed batch n+1
    before the actor steps on batch n.
No rollout runs meanwhile: this is the trainer alone on the machine's cores. The critic warm-up is off
(every step has an actor step). Per step it records when each phase ran on each side (a timeline on the
wall clock both processes share) and reports, per repeat, the median step wall (the first step of a
sweep cannot overlap and is left out), the separate/colocated ratio, and the share of the critic's time
hidden behind the actor: 1 - (time the actor side waited for the critic) / (the critic's own time).
Writes benchmarks/results/critic_overlap.json and prints a table. On a GPU (`trainer.device=cuda`, as
benchmarks/gpu_check.sh runs it) both processes share the one GPU, each on its own CUDA stream.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import sample_batches  # noqa: E402

from sao.algo.registry import get_algorithm  # noqa: E402
from sao.config import load_config  # noqa: E402
from sao.device import resolve_device  # noqa: E402
from sao.models.critic import build_critic  # noqa: E402
from sao.models.quiet import quiet_transformers  # noqa: E402
from sao.models.tiny import load_model  # noqa: E402
from sao.trainer.batch import collate  # noqa: E402
from sao.trainer.build import critic_learner  # noqa: E402
from sao.trainer.critic_ranks import start_critic_rank  # noqa: E402
from sao.trainer.learner import Learner  # noqa: E402


def sweep(cfg, model_path, batches, pad: int, separate: bool, threads: int) -> dict:
    """One pass over the batches; per step its wall and timeline (seconds from the sweep's start)."""
    algo, device = get_algorithm(cfg.algo.name), resolve_device(cfg.trainer.device)
    collated = [collate(b, pad) for b in batches]
    actor = load_model(model_path).to(device)
    if separate:
        torch.set_num_threads(max(1, threads - 1))
        group = start_critic_rank(critic_learner, (cfg, str(model_path), None), cfg.critic.threads,
                                  cfg.critic.ranks, cfg.trainer.timeout_s)
        learner = Learner(actor, None, algo, cfg.algo, cfg.critic, cfg.train, critic_group=group)
    else:
        torch.set_num_threads(threads)
        critic = build_critic(model_path, num_layers=cfg.critic.num_layers, depth=cfg.critic.depth).to(device)
        learner = Learner(actor, critic, algo, cfg.algo, cfg.critic, cfg.train)
    steps = []
    try:
        t0 = time.time()
        if separate:
            learner.look_ahead(collated[0])
        for n, batch in enumerate(collated):
            began = time.time()
            if separate and n + 1 < len(collated):
                learner.look_ahead(collated[n + 1])
            m = learner.step(batch)
            ended = time.time()
            row = {"step_s": ended - began, "began": began - t0, "ended": ended - t0,
                   "actor_s": m["perf/actor_s"], "critic_wait_s": m.get("perf/critic_wait_s", 0.0)}
            if separate:
                row.update(critic_s=m["perf/critic_phase_s"], critic_began=m["perf/critic_began_at"] - t0,
                           critic_ended=m["perf/critic_ended_at"] - t0)
            else:
                row["critic_s"] = sum(m[k] for k in ("perf/critic_forward_s", "perf/critic_backward_s",
                                                     "perf/critic_v2_s", "perf/gae_s"))
            steps.append(row)
    finally:
        learner.close()
    rest = steps[1:]  # the first step of a sweep has nothing to overlap with
    out = {"steps": steps, "step_s_median": statistics.median(r["step_s"] for r in rest),
           "actor_s_median": statistics.median(r["actor_s"] for r in rest),
           "critic_s_median": statistics.median(r["critic_s"] for r in rest)}
    if separate:
        out["critic_hidden_frac"] = 1 - sum(r["critic_wait_s"] for r in rest) / sum(r["critic_s"] for r in rest)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="cores the trainer has (colocated: all in one process)")
    ap.add_argument("--out", default="benchmarks/results/critic_overlap.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    quiet_transformers()
    cfg = load_config(None, ["critic.warmup_steps=0", *ns.overrides])
    torch.manual_seed(cfg.train.seed)
    model_path, codec, batches = sample_batches(cfg, ns.batches)
    pad = codec.tokenizer.pad_token_id
    sweep(cfg, model_path, batches[:2], pad, False, ns.threads)  # warm-up: allocator, caches
    repeats = []
    for r in range(ns.repeats):
        order = [False, True] if r % 2 == 0 else [True, False]
        res = {("separate" if sep else "colocated"): sweep(cfg, model_path, copy.copy(batches), pad, sep, ns.threads)
               for sep in order}
        res["ratio"] = res["separate"]["step_s_median"] / res["colocated"]["step_s_median"]
        repeats.append(res)
        print(f"repeat {r}: step median colocated {res['colocated']['step_s_median'] * 1000:.0f} ms, separate "
              f"{res['separate']['step_s_median'] * 1000:.0f} ms (x{res['ratio']:.2f}), critic hidden "
              f"{res['separate']['critic_hidden_frac']:.0%}", flush=True)
    summary = {
        "batches": ns.batches, "repeats": ns.repeats, "threads": ns.threads, "critic_threads": cfg.critic.threads,
        "batch_size": cfg.train.batch_size, "overrides": ns.overrides,
        "ratio_median": statistics.median(r["ratio"] for r in repeats),
        "critic_hidden_frac_median": statistics.median(r["separate"]["critic_hidden_frac"] for r in repeats),
        "repeats_detail": repeats,
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"{'repeat':<8}{'colocated ms':>14}{'separate ms':>13}{'sep/colo':>10}{'actor ms':>10}{'critic ms':>11}"
          f"{'hidden':>8}")
    for i, r in enumerate(repeats):
        c, s = r["colocated"], r["separate"]
        print(f"{i:<8}{c['step_s_median'] * 1000:>14.0f}{s['step_s_median'] * 1000:>13.0f}{r['ratio']:>10.2f}"
              f"{s['actor_s_median'] * 1000:>10.0f}{s['critic_s_median'] * 1000:>11.0f}{s['critic_hidden_frac']:>8.0%}")
    print(f"median separate/colocated {summary['ratio_median']:.2f}, critic hidden "
          f"{summary['critic_hidden_frac_median']:.0%}; results: {out}")


if __name__ == "__main__":
    main()
