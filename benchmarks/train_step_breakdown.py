"""Where the time of one SAO train step goes, pass by pass (docs/performance.md §6).

    python benchmarks/train_step_breakdown.py [--batches 4] [--repeats 3] [--threads 1] [key=value ...]

Samples `--batches` batches on the default task with the torch engine from the run's starting policy
(as benchmarks/train_step.py does), then runs full SAO steps (`train.pack` as configured, no critic
warm-up) with timers wrapped around each part of `Learner.step`, call by call:

    collate          trajectories -> padded tensors (the runtime does this before `step`)
    pack             planning the packed rows (once per batch)
    critic_fwd_k     critic forward of critic update k (k=0 also gives v0 for the returns)
    critic_loss_k    the clipped value loss
    critic_bwd_k     its backward, critic_clip_k the gradient norm and clip, critic_opt_k AdamW's step
    critic_v2        the no-grad critic forward after the updates (advantages)
    gae              both GAE calls (returns on v0, advantages on v2)
    actor_fwd        the actor forward + log-probs + entropy (the only actor pass: DIS takes the
                     rollout's behavior log-probs, there is no pi_old recomputation)
    actor_loss       the DIS loss; actor_bwd, actor_clip, actor_opt as for the critic
    other            the rest of `step`: metrics, whitening, masks, Python between the parts
    step, step_cpu   the whole step in wall-clock, and in this process's CPU time (less disturbed by
                     other processes on the cores)

Each figure is the median over `--repeats` sweeps of the per-batch time (models restart from the same
weights each sweep), after a warm-up sweep; the table is the mean over batches of those medians.
`--profile` adds the top operators by self CPU time (torch.profiler) of one sweep; `--ab` times whole
steps with and without the kept packed mask and the shared log-softmax (paired, alternating). Writes
benchmarks/results/train_step_breakdown.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step  # noqa: E402  (benchmarks/train_step.py: sampling and learner setup)

import sao.trainer.learner as learner_mod  # noqa: E402
from sao.config import load_config  # noqa: E402
from sao.models.quiet import quiet_transformers  # noqa: E402
from sao.trainer.batch import collate  # noqa: E402
from sao.trainer.build import build_models  # noqa: E402


def parts(k: int) -> list[str]:
    """The table's rows for K critic updates."""
    critic = [f"critic_{p}_{i}" for i in range(k) for p in ("fwd", "loss", "bwd", "clip", "opt")]
    return ["collate", "pack", *critic, "critic_v2", "gae", "actor_fwd", "actor_loss", "actor_bwd", "actor_clip",
            "actor_opt", "other", "step", "step_cpu"]


class Timers:
    """Wall time of named calls within one step; `phase` says whose backward/clip/opt step runs."""

    def __init__(self):
        self.t: dict[str, float] = defaultdict(float)
        self.phase = "critic"
        self.k = 0
        self.fwd_name = "critic_fwd_0"

    def wrap(self, fn, name):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.t[name() if callable(name) else name] += time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def instrumented(timers: Timers):
    """Wrap the learner's parts with timers for the duration (restored after)."""
    L = learner_mod
    saved = {n: getattr(L, n) for n in ("critic_forward", "actor_logprobs", "skip_observation_gae",
                                         "dis_policy_loss", "value_loss", "pack")}
    saved_bwd, saved_clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
    saved_values, saved_apply = L.Learner._values, L.Learner._apply

    def values(self, batch):  # which critic forward this is: update k, or v2 under inference mode
        timers.fwd_name = "critic_v2" if torch.is_inference_mode_enabled() else f"critic_fwd_{timers.k}"
        return saved_values(self, batch)

    def apply(self, opt, loss, clip):
        timers.phase = "critic" if opt is self.critic_opt else "actor"
        suffix = f"_{timers.k}" if timers.phase == "critic" else ""
        orig_step = opt.step
        opt.step = timers.wrap(orig_step, f"{timers.phase}_opt{suffix}")
        try:
            return saved_apply(self, opt, loss, clip)
        finally:
            opt.step = orig_step
            if timers.phase == "critic":
                timers.k += 1

    def tag(part):
        return lambda: f"{timers.phase}_{part}" + (f"_{timers.k}" if timers.phase == "critic" else "")

    L.critic_forward = timers.wrap(saved["critic_forward"], lambda: timers.fwd_name)
    L.actor_logprobs = timers.wrap(saved["actor_logprobs"], "actor_fwd")
    L.skip_observation_gae = timers.wrap(saved["skip_observation_gae"], "gae")
    L.dis_policy_loss = timers.wrap(saved["dis_policy_loss"], "actor_loss")
    L.value_loss = timers.wrap(saved["value_loss"], lambda: f"critic_loss_{timers.k}")
    L.pack = timers.wrap(saved["pack"], "pack")
    L.Learner._values, L.Learner._apply = values, apply
    torch.Tensor.backward = timers.wrap(saved_bwd, tag("bwd"))
    torch.nn.utils.clip_grad_norm_ = timers.wrap(saved_clip, tag("clip"))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(L, n, fn)
        L.Learner._values, L.Learner._apply = saved_values, saved_apply
        torch.Tensor.backward, torch.nn.utils.clip_grad_norm_ = saved_bwd, saved_clip


def one_step(learner, trajs, pad: int) -> dict[str, float]:
    timers = Timers()
    with instrumented(timers):
        t0, c0 = time.perf_counter(), time.process_time()
        batch = collate(trajs, pad)
        timers.t["collate"] = time.perf_counter() - t0
        learner.step(batch)
        timers.t["step"] = time.perf_counter() - t0
        timers.t["step_cpu"] = time.process_time() - c0  # this process's CPU time: less disturbed by others
    timers.t["other"] = timers.t["step"] - sum(v for k, v in timers.t.items() if k not in ("step", "step_cpu", "other"))
    return dict(timers.t)


def sweep_all(cfg, model_path, pad: int, batches, repeats: int):
    actor0, critic0 = build_models(cfg, model_path, None)  # as `sao train` builds them (LoRA, critic.path)
    order = parts(cfg.critic.updates_per_step)
    runs: list[list[dict]] = [[] for _ in batches]
    for sweep in range(repeats + 1):  # sweep 0 warms up allocator and caches
        learner = train_step.make_learner(cfg, "sao", cfg.train.pack, actor0, critic0)
        for i, trajs in enumerate(batches):
            row = one_step(learner, trajs, pad)
            if sweep:
                runs[i].append(row)
    med = [{k: statistics.median(r.get(k, 0.0) for r in rows) for k in order} for rows in runs]
    return {k: statistics.mean(m[k] for m in med) for k in order}, med, learner


@contextlib.contextmanager
def before_changes():
    """The trainer passes as they were before the mask was kept and the log-softmax shared: every pass
    builds its own attention mask, log-probs and entropy take a log-softmax each (same numbers, more work)."""
    import sao.trainer.packing as packing
    from sao.models.actor import token_entropy, token_logprobs

    def two_softmaxes(logits, ids, entropy_grad=False):
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_entropy(logits)
        return token_logprobs(logits, ids), entropy

    saved = packing.attention_mask, packing.token_logprobs_and_entropy
    packing.attention_mask, packing.token_logprobs_and_entropy = (lambda model, p: None), two_softmaxes
    try:
        yield
    finally:
        packing.attention_mask, packing.token_logprobs_and_entropy = saved


def ab_steps(cfg, model_path, pad: int, batches, repeats: int) -> dict:
    """Whole-step seconds before/after the changes, batch by batch, the order alternating: paired
    ratios are robust to a load that drifts. Both learners start from the same weights every sweep."""
    actor0, critic0 = build_models(cfg, model_path, None)
    pairs = []
    for sweep in range(repeats + 1):
        learners = {v: train_step.make_learner(cfg, "sao", cfg.train.pack, actor0, critic0) for v in ("before", "after")}
        for i, trajs in enumerate(batches):
            t = {}
            for v in (("before", "after") if (sweep + i) % 2 else ("after", "before")):
                with before_changes() if v == "before" else contextlib.nullcontext():
                    t0, c0 = time.perf_counter(), time.process_time()
                    learners[v].step(collate(trajs, pad))
                    t[v], t[f"{v}_cpu"] = time.perf_counter() - t0, time.process_time() - c0
            if sweep:
                pairs.append(t)
    out = {"pairs_s": pairs}
    for clock in ("", "_cpu"):  # wall-clock, and this process's CPU time (less disturbed by other processes)
        ratios = [p["after" + clock] / p["before" + clock] for p in pairs]
        out[f"median_before{clock}_s"] = statistics.median(p["before" + clock] for p in pairs)
        out[f"median_after{clock}_s"] = statistics.median(p["after" + clock] for p in pairs)
        out[f"median_ratio{clock}"] = statistics.median(ratios)
        out[f"ratio{clock}_range"] = [min(ratios), max(ratios)]
    return out


def top_ops(learner, batches, pad: int, n: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for trajs in batches:
            learner.step(collate(trajs, pad))
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [{"op": e.key, "calls": e.count, "self_ms_per_step": e.self_cpu_time_total / 1e3 / len(batches)}
            for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also list the top operators (torch.profiler)")
    ap.add_argument("--ab", action="store_true", help="also time whole steps before/after the changes, paired")
    ap.add_argument("--out", default="benchmarks/results/train_step_breakdown.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    quiet_transformers()
    cfg = load_config(None, ns.overrides)
    torch.manual_seed(cfg.train.seed)
    model_path, codec, batches = train_step.sample_batches(cfg, ns.batches)
    torch.set_num_threads(ns.threads)
    pad = codec.tokenizer.pad_token_id
    mean, per_batch, learner = sweep_all(cfg, model_path, pad, batches, ns.repeats)
    summary = {"threads": ns.threads, "batches": ns.batches, "repeats": ns.repeats,
               "batch_size": cfg.train.batch_size, "pack": cfg.train.pack, "overrides": ns.overrides,
               "real_tokens": [sum(len(t.token_ids) for t in trajs) for trajs in batches],
               "statistic": "median over repeats per batch, mean over batches (seconds)",
               "mean_s": mean, "per_batch_s": per_batch}
    if ns.profile:
        summary["top_ops"] = top_ops(learner, batches, pad)
    if ns.ab:
        summary["ab"] = ab_steps(cfg, model_path, pad, batches, ns.repeats)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"{'part of one SAO step':<16}{'ms':>9}{'share':>8}")
    for k in mean:  # step_cpu: the process's CPU time; its share is CPU / wall (below 1 when others load the cores)
        print(f"{k:<16}{1000 * mean[k]:>9.1f}{mean[k] / mean['step']:>8.1%}")
    for row in summary.get("top_ops", []):
        print(f"  {row['op'][:48]:<48}{row['calls']:>7}{row['self_ms_per_step']:>9.1f} ms/step")
    if ns.ab:
        ab = summary["ab"]
        for clock, name in (("", "wall"), ("_cpu", "CPU")):
            lo, hi = ab[f"ratio{clock}_range"]
            print(f"whole step {name}, {len(ab['pairs_s'])} pairs: before {1000 * ab[f'median_before{clock}_s']:.1f} ms, "
                  f"after {1000 * ab[f'median_after{clock}_s']:.1f} ms (medians); after/before median "
                  f"{ab[f'median_ratio{clock}']:.3f} [{lo:.3f}, {hi:.3f}]")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
