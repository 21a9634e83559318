"""Rollout throughput with 1, 2 and 4 rollout workers on the local and ray backends, and Ray's costs.

    python benchmarks/scale_out.py [--seconds 15] [--workers 1 2 4] [--backends local ray] [key=value ...]

For each (backend, workers) it starts the backend exactly as `sao train` does (the SFT-cached
built-in model, `calc`), issues episodes through the trainer-side Scheduler with the pacing room
kept open, publishes new weights once a second (as training would), and counts finished
trajectories and sampled action tokens over a window of `--seconds` after every worker has
delivered its first episode. No optimizer step runs: this measures the rollout side alone.

Also measured: start-up (backend.start until every worker delivered), publish time (local: shared
memory copy; ray: ray.put of one flat array + one call per worker), and the receive round trip with
nothing waiting (ray: one actor call). Ray overhead per step = publish + one receive round trip,
minus the local backend's. Writes benchmarks/results/scale_out.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sao.config import load_config
from sao.envs import make_environment
from sao.models.quiet import quiet_transformers
from sao.models.tiny import load_model
from sao.runtime.backend import make_backend
from sao.runtime.episodes import limits_of
from sao.runtime.model_setup import prepare_base_model
from sao.runtime.pacing import Pacing
from sao.runtime.queue import TrajectoryQueue
from sao.runtime.scheduler import Audit, Scheduler, TaskStream


def measure(cfg, model_path, seconds: float) -> dict:
    environment = make_environment(cfg.env.name, cfg.env.options, cfg.train.seed)
    params = list(load_model(model_path).parameters())
    backend = make_backend(cfg, str(model_path), limits_of(cfg))
    n, slots, batch = cfg.runtime.rollout_workers, cfg.rollout.concurrency, cfg.train.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        pacing = Pacing(batch, ahead=cfg.runtime.max_lag)
        sched = Scheduler(backend, TaskStream(environment.train_tasks()), Audit(Path(tmp) / "audit.jsonl"), pacing)
        queue, t0 = TrajectoryQueue(), time.perf_counter()
        backend.start(params, 0)
        start_call_s = time.perf_counter() - t0  # ray: ray.init + actor creation calls; local: process spawn
        delivered: set[int] = set()

        def pump() -> list:
            pacing.consumed = (len(queue) + 2 * n * slots) // batch  # keep ~2 episodes per slot in play
            sched.fill(0)
            records = backend.receive(timeout=0.2)
            delivered.update(r.worker for r in records if type(r).__name__ == "Finished")
            sched.handle(records, queue, 0)
            return records

        while len(delivered) < n:
            pump()
        start_s = time.perf_counter() - t0
        base, version, publish_ms, t_pub = len(queue), 0, [], time.perf_counter()
        t_start = time.perf_counter()
        while time.perf_counter() - t_start < seconds:
            pump()
            if time.perf_counter() - t_pub > 1.0:
                version += 1
                publish_ms.append(backend.publish(params, version))
                t_pub = time.perf_counter()
        wall = time.perf_counter() - t_start
        trajs = queue.items()[base:]
        rtt = []
        for _ in range(20):
            t = time.perf_counter()
            backend.receive(timeout=0.0)
            rtt.append((time.perf_counter() - t) * 1000)
        backend.stop()
    tokens = sum(t.num_action_tokens for t in trajs)
    return {"backend": cfg.runtime.backend, "workers": n, "window_s": wall, "trajectories": len(trajs),
            "trajectories_per_s": len(trajs) / wall, "tokens_per_s": tokens / wall,
            "start_s": start_s, "start_call_s": start_call_s,
            "publish_ms": statistics.median(publish_ms) if publish_ms else None,
            "receive_rtt_ms": statistics.median(rtt), "restarts": sched.lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--backends", nargs="+", default=["local", "ray"])
    argv = sys.argv[1:]
    ns = parser.parse_args([a for a in argv if "=" not in a])
    ns.overrides = [a for a in argv if "=" in a]  # key=value config overrides, anywhere on the line
    quiet_transformers()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(1)
    results = []
    for backend in ns.backends:
        for n in ns.workers:
            cfg = load_config(None, [f"runtime.backend={backend}", f"runtime.rollout_workers={n}",
                                     "runtime.ray_num_cpus=4", "runtime.worker_num_cpus=0.5", *ns.overrides])
            model_path, _ = prepare_base_model(cfg)
            results.append(measure(cfg, model_path, ns.seconds))
            print(json.dumps(results[-1]), flush=True)
    local = {r["workers"]: r for r in results if r["backend"] == "local"}
    for r in results:
        if r["backend"] == "ray" and r["workers"] in local:
            lo = local[r["workers"]]
            r["ray_overhead_per_step_ms"] = (r["publish_ms"] + r["receive_rtt_ms"]) - (lo["publish_ms"] + lo["receive_rtt_ms"])
    out = {"cpus": os.cpu_count(), "seconds": ns.seconds, "overrides": ns.overrides, "results": results,
           "note": "machine shared with other engineers' tests while measuring; rollout side only (no optimizer)"}
    path = Path(__file__).parent / "results" / "scale_out.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"\n{'backend':8} {'workers':>7} {'traj/s':>8} {'tok/s':>8} {'start s':>8} {'publish ms':>10} "
          f"{'recv rtt ms':>11} {'ray ovh/step ms':>15}")
    for r in results:
        ovh = r.get("ray_overhead_per_step_ms")
        print(f"{r['backend']:8} {r['workers']:7d} {r['trajectories_per_s']:8.1f} {r['tokens_per_s']:8.0f} "
              f"{r['start_s']:8.1f} {r['publish_ms']:10.2f} {r['receive_rtt_ms']:11.2f} "
              f"{'' if ovh is None else f'{ovh:15.2f}'}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
