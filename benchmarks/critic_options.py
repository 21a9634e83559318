"""What the critic's cost options buy on the default `calc` task: held-out accuracy and wall-clock.

    python benchmarks/critic_options.py [--steps 100] [--seeds 0] [--out benchmarks/results/critic_options_calc.json]

Each option is one async `sao train` on the defaults (the cached SFT warm start, `calc`), `--steps`
optimizer steps, the same seeds:
  default         the defaults (since critic.depth=0.25: a critic of the actor's first decoder layer of 2)
  full_critic     critic.depth=1: the paper's critic, the actor's whole architecture (the default before)
  k1              critic.updates_per_step=1
  warm0           critic.warmup_steps=0
  lora8           critic.lora.r=8 (adapters + value head)
  small_critic    critic.path = a 1-layer, 32-wide Llama (14K parameters; the actor: 0.23M) with the same
                  tokenizer, built here (seed 1)
  lean            k1 + warm0 + small_critic
  layers1         critic.num_layers=1: the critic from the actor's first decoder layer only (of 2)
  separate        critic.placement=separate: the critic on its own process, one batch ahead
Per run: held-out accuracy before and after (`eval.num_tasks` tasks), loop wall-clock, mean trainer step
time, final entropy and reward. The same options on the TRL comparison task, in time to a reward
threshold: `benchmarks/vs_trl.py --arms trl sao_async_k1 ...` (benchmarks/README.md). Writes `--out` and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(arch="llama", hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64)
OPTIONS = {
    "default": [], "full_critic": ["critic.depth=1"], "k1": ["critic.updates_per_step=1"], "warm0": ["critic.warmup_steps=0"],
    "lora8": ["critic.lora.r=8"], "small_critic": ["critic.path={small}"],
    "lean": ["critic.updates_per_step=1", "critic.warmup_steps=0", "critic.path={small}"],
    "layers1": ["critic.num_layers=1"], "separate": ["critic.placement=separate"],
}


def run(option: str, seed: int, steps: int, root: Path, small: Path, eval_tasks: int) -> dict:
    name = f"critic_options-{option}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [f"train.steps={steps}", f"train.seed={seed}", "eval.every=0", f"eval.num_tasks={eval_tasks}",
                 f"output.root={root}", f"output.name={name}", "output.save_every=0",
                 *(o.format(small=small) for o in OPTIONS[option])]
    subprocess.run([sys.executable, "-m", "sao.cli", "train", *overrides, "--quiet"], cwd=ROOT, check=True)
    run_dir = root / name
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    return {"option": option, "seed": seed, "overrides": overrides, "run_dir": str(run_dir),
            "heldout_before": summary["accuracy_before"], "heldout_after": summary["accuracy_after"],
            "loop_wall_s": rows[-1]["perf/wall_s"], "train_step_s_mean": statistics.mean(r["perf/train_step_s"] for r in rows),
            "reward_last10": statistics.mean(r["reward/mean"] for r in rows[-10:]),
            "entropy_last10": statistics.mean(r.get("actor/entropy", float("nan")) for r in rows[-10:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--eval-tasks", type=int, default=100)
    ap.add_argument("--runs-root", default="runs/bench")
    ap.add_argument("--out", default="benchmarks/results/critic_options_calc.json")
    ns = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from sao.models.tiny import build_tiny_model

    root = (ROOT / ns.runs_root).resolve()
    small = root / "critic_options-small-critic"
    if not (small / "config.json").exists():
        build_tiny_model(small, seed=1, **SMALL)
    runs = []
    for i, seed in enumerate(ns.seeds):
        for option in ns.options if i % 2 == 0 else ns.options[::-1]:  # alternate: a load drift hits all alike
            runs.append(run(option, seed, ns.steps, root, small, ns.eval_tasks))
            print(json.dumps(runs[-1]), flush=True)
    base = {r["seed"]: r for r in runs if r["option"] == "default"}
    table = {}
    for option in ns.options:
        rs = [r for r in runs if r["option"] == option]
        table[option] = {
            "heldout_after": [r["heldout_after"] for r in rs], "heldout_before": [r["heldout_before"] for r in rs],
            "loop_wall_s": [round(r["loop_wall_s"], 1) for r in rs],
            "wall_over_default": [r["loop_wall_s"] / base[r["seed"]]["loop_wall_s"] for r in rs if r["seed"] in base]}
    out = ROOT / ns.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": {"steps": ns.steps, "seeds": ns.seeds, "eval_tasks": ns.eval_tasks,
                                            "small_critic": SMALL, "options": OPTIONS,
                                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                               "summary": table, "runs": runs}, indent=1))
    print(f"{'option':<14}{'held-out before':>18}{'after':>18}{'loop wall s':>18}{'x default':>14}")
    for option, t in table.items():
        ratio = statistics.median(t["wall_over_default"]) if t["wall_over_default"] else float("nan")
        print(f"{option:<14}{str(t['heldout_before']):>18}{str(t['heldout_after']):>18}{str(t['loop_wall_s']):>18}"
              f"{ratio:>14.2f}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
