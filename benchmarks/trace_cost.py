"""What recording the trainer's per-token values costs (sao/trainer/trace.py, `sao view`).

    python benchmarks/trace_cost.py [--batches 6] [--repeats 5] [key=value ...]

Samples `--batches` batches on the default task (the run's starting policy, the torch engine, as
benchmarks/train_step.py does), then times full SAO steps on each batch with `trace_rows` 0 and
`output.trace_trajectories` (2), taking turns step by step (paired: a burst of load hits both alike);
each figure is the minimum over `--repeats` sweeps after a warm-up sweep. It also writes the traces
of those steps as the runtime does (RunDir.write_traces) and measures their size, from which the
size per 1,000 steps at `output.trajectories_every` follows. Writes benchmarks/results/trace_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step  # noqa: E402  (benchmarks/train_step.py: sampling and learner setup)

from sao.config import load_config  # noqa: E402
from sao.models.critic import build_critic  # noqa: E402
from sao.models.quiet import quiet_transformers  # noqa: E402
from sao.models.tiny import load_model  # noqa: E402
from sao.runtime.run_dir import RunDir  # noqa: E402
from sao.trainer.batch import collate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/trace_cost.json")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    quiet_transformers()
    torch.set_num_threads(ns.threads)
    cfg = load_config(None, ns.overrides)
    rows = cfg.output.trace_trajectories
    print(f"sampling {ns.batches} batches of {cfg.train.batch_size} on {cfg.env.name} ...", flush=True)
    model_path, codec, batches = train_step.sample_batches(cfg, ns.batches)
    actor0, critic0 = load_model(model_path), build_critic(model_path)
    pad = codec.tokenizer.pad_token_id
    best = {n: [float("inf")] * len(batches) for n in ("off", "on")}
    records: list[list[dict]] = [[] for _ in batches]
    for sweep in range(ns.repeats + 1):  # sweep 0 warms up
        learners = {n: train_step.make_learner(cfg, "sao", cfg.train.pack, actor0, critic0) for n in best}
        for i, trajs in enumerate(batches):
            for name, learner in learners.items():
                batch = collate(trajs, pad)
                batch.trace_rows = rows if name == "on" else 0
                t0 = time.perf_counter()
                m = learner.step(batch)
                dt = time.perf_counter() - t0
                if sweep:
                    best[name][i] = min(best[name][i], dt)
                if name == "on":
                    records[i] = m["trace"]
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp))
        sizes = []
        for i, (trajs, recs) in enumerate(zip(batches, records)):
            run.write_traces(i + 1, trajs, recs, codec.decode, "sao", 0)
            sizes.append((Path(tmp) / "traces" / f"step_{i + 1:06d}.jsonl").stat().st_size)
    off, on = sum(best["off"]), sum(best["on"])
    per_dump = statistics.mean(sizes)
    dumps_per_1000 = 1000 // cfg.output.trajectories_every
    out = {
        "config": {"batches": ns.batches, "repeats": ns.repeats, "threads": ns.threads, "batch_size": cfg.train.batch_size,
                   "trace_trajectories": rows, "trajectories_every": cfg.output.trajectories_every,
                   "overrides": ns.overrides},
        "step_s_off": best["off"], "step_s_on": best["on"],
        "traced_step_ratio": on / off, "traced_step_extra_ms": (on - off) / len(batches) * 1e3,
        "trace_bytes_per_dump": per_dump, "trace_bytes_per_record": per_dump / max(rows, 1),
        "action_tokens_per_record": statistics.mean(sum(v is not None for v in r["adv"]) for recs in records for r in recs)
        if rows else 0.0,
        "tokens_per_record": statistics.mean(len(r["adv"]) for recs in records for r in recs) if rows else 0.0,
        "trace_mb_per_1000_steps": per_dump * dumps_per_1000 / 1e6,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    print(f"{'':34}{'value':>12}")
    print(f"{'SAO step, no trace (s, sum)':34}{off:>12.4f}")
    print(f"{'SAO step, traced (s, sum)':34}{on:>12.4f}")
    print(f"{'traced / untraced':34}{on / off:>12.3f}")
    print(f"{'extra per traced step (ms)':34}{out['traced_step_extra_ms']:>12.2f}")
    print(f"{'bytes per dump':34}{per_dump:>12.0f}")
    print(f"{'tokens per record':34}{out['tokens_per_record']:>12.1f}")
    print(f"{'MB per 1,000 steps':34}{out['trace_mb_per_1000_steps']:>12.2f}")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
