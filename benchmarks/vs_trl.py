"""sao against TRL's GRPOTrainer on the same model folder, prompts, reward and budgets (docs: benchmarks/README.md).

    python benchmarks/vs_trl.py [--seeds 0 1 2] [--steps 200] [--arms trl sao_async ...] [--quick]

What both frameworks get (benchmarks/vs_trl_task.py): one model folder, a ~1.8M-parameter char-level
Qwen2 (random init, seed 0) with the char tokenizer and a ChatML template; the one-turn task "What is
a+b?" with a, b in 0..4; one reward function (1 if the reply ended with EOS and its answer is a+b);
16 completions per optimizer step; at most 16 new tokens; temperature 1; lr 1e-3, constant (sao's
only schedule; TRL's default would decay it linearly); `--steps` steps; seeds 0-2.

Arms:
  trl         TRL `GRPOTrainer`: 4 prompts x 4 generations per step, one optimizer step per 16 completions
              (TRL defaults otherwise: beta 0, loss_type dapo, one iteration). It runs in its own venv
              (`--trl-venv`, default .venv-trl, created here if missing, torch==2.13.0 CPU + trl==1.16.0)
  sao_async   `sao train` (SAO, 16 prompts x 1), async; sao_sync the same with runtime.mode=sync
  grpo_async  `sao train algo.name=grpo`: 4 prompts x 4 (algo.group_size=4) and algo.ppo_minibatches=1, so
              one optimizer step per 16 completions as in TRL; grpo_sync the same with runtime.mode=sync
Each run is a subprocess; the arms run one after the other for a seed, the order changing every seed
(a drift in machine load hits all arms alike). Per run: per-step wall-clock from the first step
(model load, evaluation and checkpoints excluded), completions/s, peak memory of the whole process
tree (RSS and PSS summed over the tree, sampled every 0.2 s; PSS counts a page shared by n processes
1/n times, RSS n times) with the per-process split at the peak, the time and step at which the
trailing-20 reward first reaches each threshold, and the final trailing-20 reward. Writes
`--out`/results.json and curves.png (reward vs wall-clock and vs step) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["trl", "sao_async", "sao_sync", "grpo_async", "grpo_sync"]
THRESHOLDS = (0.1, 0.2, 0.3)
WINDOW = 20  # trailing-reward window, in steps
BATCH, GROUP, MAX_NEW_TOKENS, LR = 16, 4, 16, 1e-3
TRL_PINS = ["torch==2.13.0", "trl==1.16.0", "transformers==5.24.0"]
SAO_COMMON = ["env.name=benchmarks.vs_trl_task:AdditionEnvironment", "rollout.max_turns=1",
              f"rollout.max_action_tokens={MAX_NEW_TOKENS}", "rollout.temperature=1", f"train.lr={LR}",
              f"train.batch_size={BATCH}", "eval.every=0", "eval.num_tasks=25", "output.save_every=0",
              "output.progress=false"]
SAO_ARMS = {
    "sao_async": ["runtime.mode=async"], "sao_sync": ["runtime.mode=sync"],
    "grpo_async": ["algo.name=grpo", f"algo.group_size={GROUP}", "algo.ppo_minibatches=1", "runtime.mode=async"],
    "grpo_sync": ["algo.name=grpo", f"algo.group_size={GROUP}", "algo.ppo_minibatches=1", "runtime.mode=sync"],
    # The critic's cost, option by option (SAO async; each changes what SAO computes, none is a default):
    "sao_async_k1": ["runtime.mode=async", "critic.updates_per_step=1"],
    "sao_async_warm0": ["runtime.mode=async", "critic.warmup_steps=0"],
    "sao_async_lora8": ["runtime.mode=async", "critic.lora.r=8"],
    "sao_async_small_critic": ["runtime.mode=async", "critic.path={small_critic}"],
    "sao_async_lean": ["runtime.mode=async", "critic.updates_per_step=1", "critic.warmup_steps=0",
                       "critic.path={small_critic}"],
    # The rollout worker as a thread of the trainer's process (no second process: memory)
    "sao_async_thread": ["runtime.mode=async", "runtime.backend=thread"],
    # The paper's critic: the actor's whole architecture (the default before critic.depth=0.25)
    "sao_async_full_critic": ["runtime.mode=async", "critic.depth=1"],
    # A critic of the actor's first decoder layer(s) (of 4), and the critic on its own process, one batch ahead
    "sao_async_layers1": ["runtime.mode=async", "critic.num_layers=1"],
    "sao_async_layers2": ["runtime.mode=async", "critic.num_layers=2"],
    "sao_async_separate": ["runtime.mode=async", "critic.placement=separate"],
    "sao_async_layers1_separate": ["runtime.mode=async", "critic.num_layers=1", "critic.placement=separate"],
}
EXTRA_ARMS = [a for a in SAO_ARMS if a not in ARMS]
SMALL_CRITIC = dict(arch="qwen2", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=192)


# ---------------------------------------------------------------- memory of a process tree

def _smaps_kb(pid: int) -> tuple[int, int, int]:
    """(Rss, Pss, Private) of one process in kB from /proc/PID/smaps_rollup; zeros once it is gone."""
    kb = {"Rss": 0, "Pss": 0, "Private_Clean": 0, "Private_Dirty": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(":")[0]
                if key in kb:
                    kb[key] = int(line.split()[1])
    except OSError:
        pass
    return kb["Rss"], kb["Pss"], kb["Private_Clean"] + kb["Private_Dirty"]


class TreeMemory:
    """Samples RSS, PSS and private memory (USS) summed over a process and all its descendants; keeps
    the peaks. USS sums are a lower bound of what the tree holds, RSS sums an upper bound."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak_rss_kb = self.peak_pss_kb = self.peak_uss_kb = 0
        self.at_peak: list[dict] = []  # per process at the RSS peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rows = []
            for p in procs:
                rss, pss, uss = _smaps_kb(p.pid)
                try:
                    name = " ".join(p.cmdline()[:4])[-80:]
                except psutil.Error:
                    name = "?"
                rows.append({"pid": p.pid, "cmd": name, "rss_mb": rss / 1024, "pss_mb": pss / 1024,
                             "uss_mb": uss / 1024})
            rss_kb = sum(r["rss_mb"] for r in rows) * 1024
            self.peak_pss_kb = max(self.peak_pss_kb, int(sum(r["pss_mb"] for r in rows) * 1024))
            self.peak_uss_kb = max(self.peak_uss_kb, int(sum(r["uss_mb"] for r in rows) * 1024))
            if rss_kb > self.peak_rss_kb:
                self.peak_rss_kb, self.at_peak = int(rss_kb), rows
            self._stop.wait(self.every_s)


# ---------------------------------------------------------------- the TRL arm (runs inside the TRL venv)

def ensure_trl_venv(venv: Path) -> Path:
    """The TRL venv's python, creating the venv (torch CPU wheel + pinned trl) when it is missing."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    print(f"vs_trl: creating {venv} ({' '.join(TRL_PINS)}); a few minutes", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PINS], check=True)
    return python


def trl_worker(spec: dict) -> None:
    """One TRL GRPO run; writes {"steps": [{"step", "wall_s", "reward", ...}], "versions"} to spec["out"]."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from vs_trl_task import reward, tasks

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": a}
            for p, a in tasks(spec["seed"], BATCH // GROUP * spec["steps"])]

    def addition_reward(completions, answer, completion_ids, **_):
        return [reward(c[0]["content"], a, bool(ids) and ids[-1] == tok.eos_token_id)
                for c, a, ids in zip(completions, answer, completion_ids)]

    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            steps.append({"step": state.global_step, "wall_s": time.perf_counter() - self.t0})

        def on_log(self, args, state, control, logs=None, **kw):
            if steps and logs and "reward" in logs:
                steps[-1].update(reward=logs["reward"], entropy=logs.get("entropy"),
                                 completion_length=logs.get("completions/mean_length"))

    cfg = GRPOConfig(
        output_dir=spec["tmp"], per_device_train_batch_size=BATCH, num_generations=GROUP,
        gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=LR, lr_scheduler_type="constant",
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, seed=spec["seed"],
        use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=addition_reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    Path(spec["out"]).write_text(json.dumps({"steps": steps, "versions": versions}))


# ---------------------------------------------------------------- running one arm

def run_arm(arm: str, seed: int, steps: int, model: Path, runs_root: Path, trl_python: Path | None) -> dict:
    """Run one arm as a subprocess under the memory sampler; the per-step curve and the peaks."""
    name = f"vs_trl-{arm}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = runs_root / name
    if arm == "trl":
        run_dir.mkdir(parents=True)
        spec = {"model": str(model), "seed": seed, "steps": steps, "tmp": str(run_dir / "trl"),
                "out": str(run_dir / "curve.json")}
        cmd, env = [str(trl_python), __file__, "--trl-worker", json.dumps(spec)], {
            k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    else:
        sao = Path(sys.executable).with_name("sao")
        overrides = [o.format(small_critic=model.with_name("vs_trl-small-critic")) for o in SAO_ARMS[arm]]
        cmd = [str(sao), "train", *SAO_COMMON, *overrides, f"model.path={model}", f"train.steps={steps}",
               f"train.seed={seed}", f"output.root={runs_root}", f"output.name={name}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    log = (runs_root / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    with TreeMemory(proc.pid) as mem:
        rc = proc.wait()
    log.close()
    if rc != 0:
        tail = (runs_root / f"{name}.log").read_text()[-2000:]
        raise SystemExit(f"vs_trl: {arm} seed {seed} failed (exit {rc}):\n{tail}")
    curve = json.loads((run_dir / "curve.json").read_text())["steps"] if arm == "trl" else sao_curve(run_dir)
    return {"arm": arm, "seed": seed, "cmd": cmd, "run_dir": str(run_dir), "process_wall_s": time.perf_counter() - t0,
            "loadavg_1_5_15_at_end": os.getloadavg(),
            "peak_tree_rss_mb": mem.peak_rss_kb / 1024, "peak_tree_pss_mb": mem.peak_pss_kb / 1024,
            "peak_tree_uss_mb": mem.peak_uss_kb / 1024,
            "processes_at_rss_peak": mem.at_peak, "curve": curve}


def sao_curve(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "wall_s": r["perf/wall_s"], "reward": r["reward/mean"],
             "entropy": r.get("actor/entropy")} for r in rows if "reward/mean" in r]


# ---------------------------------------------------------------- figures

def trailing(rewards: list[float], window: int = WINDOW) -> list[float | None]:
    """Mean of the last `window` steps' rewards at each step (None until `window` steps exist)."""
    return [statistics.mean(rewards[i + 1 - window:i + 1]) if i + 1 >= window else None for i in range(len(rewards))]


def figures(run: dict) -> dict:
    curve = run["curve"]
    window = min(WINDOW, len(curve))
    trail = trailing([c["reward"] for c in curve], window)
    wall = curve[-1]["wall_s"]
    out = {"steps": len(curve), "steps_wall_s": wall, "s_per_step": wall / len(curve),
           "completions_per_s": BATCH * len(curve) / wall, "final_trailing_reward": trail[-1], "window": window}
    for thr in THRESHOLDS:
        hit = next((i for i, v in enumerate(trail) if v is not None and v >= thr), None)
        out[f"reach_{thr}"] = None if hit is None else {"step": curve[hit]["step"], "wall_s": curve[hit]["wall_s"]}
    return out


def summarize(runs: list[dict], arms: list[str]) -> dict:
    """Per arm: medians over seeds, threshold hits, and paired ratios against TRL when it ran."""
    out = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        med = {k: statistics.median(r["figures"][k] for r in rs)
               for k in ("steps_wall_s", "s_per_step", "completions_per_s", "final_trailing_reward")}
        med.update({k: statistics.median(r.get(k, float("nan")) for r in rs)  # USS: not in runs before 2026-12-02
                    for k in ("peak_tree_rss_mb", "peak_tree_pss_mb", "peak_tree_uss_mb")})
        for thr in THRESHOLDS:
            hits = [r["figures"][f"reach_{thr}"] for r in rs]
            med[f"reach_{thr}"] = {"seeds_reached": sum(h is not None for h in hits), "of": len(hits),
                                   "wall_s": [h and round(h["wall_s"], 1) for h in hits],
                                   "step": [h and h["step"] for h in hits]}
        if "trl" in arms and arm != "trl":
            ratios = [r["figures"]["steps_wall_s"] / t["figures"]["steps_wall_s"] for r in rs
                      for t in runs if t["arm"] == "trl" and t["seed"] == r["seed"]]
            mem = [r["peak_tree_rss_mb"] / t["peak_tree_rss_mb"] for r in rs
                   for t in runs if t["arm"] == "trl" and t["seed"] == r["seed"]]
            med["steps_wall_over_trl"] = {"per_seed": ratios, "median": statistics.median(ratios)}
            med["peak_rss_over_trl"] = {"per_seed": mem, "median": statistics.median(mem)}
        out[arm] = med
    for a in out:  # async over sync, paired by seed (sao_async_*: the options against plain sao --sync)
        s = a.split("_")[0] + "_sync"
        if "_async" in a and s in out:
            pairs = [(x, y) for x in runs if x["arm"] == a for y in runs if y["arm"] == s and y["seed"] == x["seed"]]
            out[a]["over_sync"] = {
                "steps_wall": statistics.median(x["figures"]["steps_wall_s"] / y["figures"]["steps_wall_s"]
                                                for x, y in pairs),
                "peak_rss": statistics.median(x["peak_tree_rss_mb"] / y["peak_tree_rss_mb"] for x, y in pairs),
                "peak_pss": statistics.median(x["peak_tree_pss_mb"] / y["peak_tree_pss_mb"] for x, y in pairs),
                "peak_uss": statistics.median(x.get("peak_tree_uss_mb", float("nan")) / y.get("peak_tree_uss_mb", float("nan"))
                                              for x, y in pairs)}
    return out


def plot(runs: list[dict], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    tab20 = plt.get_cmap("tab20").colors
    colors = dict(zip(ARMS + EXTRA_ARMS, tab20[::2] + tab20[1::2]))
    for arm in arms:
        for i, r in enumerate(x for x in runs if x["arm"] == arm):
            curve = r["curve"]
            trail = trailing([c["reward"] for c in curve], r["figures"]["window"])
            pts = [(c, v) for c, v in zip(curve, trail) if v is not None]
            label = arm if i == 0 else None
            axes[0].plot([c["wall_s"] for c, _ in pts], [v for _, v in pts], color=colors[arm], lw=1, label=label)
            axes[1].plot([c["step"] for c, _ in pts], [v for _, v in pts], color=colors[arm], lw=1, label=label)
    for ax, xlabel in zip(axes, ("steps wall-clock (s)", "optimizer step")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"trailing-{WINDOW} reward")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("a+b, 1.8M char-level Qwen2, 16 completions/step: one line per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(summary: dict) -> None:
    cols = ["steps wall s", "s/step", "compl/s", "final R", "RSS MB", "PSS MB", "USS MB",
            *(f"reach {t}" for t in THRESHOLDS)]
    print(f"{'arm':<24}" + "".join(f"{c:>14}" for c in cols))
    for arm, m in summary.items():
        reach = [f"{m[f'reach_{t}']['seeds_reached']}/{m[f'reach_{t}']['of']}" for t in THRESHOLDS]
        vals = [m["steps_wall_s"], m["s_per_step"], m["completions_per_s"], m["final_trailing_reward"],
                m["peak_tree_rss_mb"], m["peak_tree_pss_mb"], m["peak_tree_uss_mb"]]
        print(f"{arm:<24}" + "".join(f"{v:>14.3f}" for v in vals) + "".join(f"{x:>14}" for x in reach))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 200; --quick: 20)")
    ap.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS + EXTRA_ARMS, help=(
        f"default: {' '.join(ARMS)}; also: {' '.join(EXTRA_ARMS)} (the critic options: small_critic is a "
        "0.1M-parameter Qwen2 with the same tokenizer from critic.path, lean is K=1, no warm-up and that critic; "
        "thread: runtime.backend=thread)"))
    ap.add_argument("--quick", action="store_true", help="a pipeline check: 20 steps, the first seed only")
    ap.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], help=(
        "OMP_WAIT_POLICY for every arm (default: each framework's own; sao sets PASSIVE in async only). "
        "PASSIVE keeps 2-thread runs from spinning away their cores when other jobs share them"))
    ap.add_argument("--out", default="benchmarks/results/vs_trl", help="folder of results.json and curves.png")
    ap.add_argument("--runs-root", default="runs/bench", help="where the runs and the shared model folder go")
    ap.add_argument("--trl-venv", default=".venv-trl", help="the TRL venv (created when missing)")
    ap.add_argument("--load", default="shared: other jobs used the same 2 CPU cores during these runs; the arms "
                    "alternate per seed so the pairing stays fair", help="a note on machine load for the JSON")
    ap.add_argument("--summarize", action="store_true", help=(
        "no runs: recompute the summary, plot and table of `--out`/results.json (e.g. of a cut-short benchmark)"))
    ap.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.trl_worker:
        return trl_worker(json.loads(ns.trl_worker))
    if ns.summarize:
        return resummarize((ROOT / ns.out).resolve())
    ns.steps = ns.steps or (20 if ns.quick else 200)
    if ns.quick:
        ns.seeds = ns.seeds[:1]
    if ns.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = ns.omp_wait_policy  # the arms' subprocesses inherit it
    runs_root, out = (ROOT / ns.runs_root).resolve(), (ROOT / ns.out).resolve()
    runs_root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    trl_python = ensure_trl_venv(ROOT / ns.trl_venv) if "trl" in ns.arms else None
    sys.path.insert(0, str(ROOT))  # sao from this checkout, for the model builder
    from vs_trl_task import build_model

    model = runs_root / "vs_trl-model"
    if not (model / "config.json").exists():
        build_model(model, seed=0)
    if any("small_critic" in o for a in ns.arms for o in SAO_ARMS.get(a, [])):
        small = model.with_name("vs_trl-small-critic")
        if not (small / "config.json").exists():
            build_model(small, seed=1, **SMALL_CRITIC)
    runs = []
    for i, seed in enumerate(ns.seeds):
        order = ns.arms[i % len(ns.arms):] + ns.arms[:i % len(ns.arms)]
        for arm in order[::-1] if i % 2 else order:
            run = run_arm(arm, seed, ns.steps, model, runs_root, trl_python)
            run["figures"] = figures(run)
            runs.append(run)
            print(json.dumps({k: run[k] for k in ("arm", "seed", "peak_tree_rss_mb", "peak_tree_pss_mb",
                                                  "peak_tree_uss_mb", "figures")}), flush=True)
            done = [a for a in ns.arms if any(r["arm"] == a for r in runs)]
            write(out, ns, model, runs, done)  # after every run: a cut-short benchmark keeps what it measured
    summary = write(out, ns, model, runs, ns.arms)
    plot(runs, ns.arms, out / "curves.png")
    print_table(summary)
    print(f"results: {out / 'results.json'}, {out / 'curves.png'}")


def resummarize(out: Path) -> None:
    """Summary, plot and table again from a results.json, over the arms it has runs of."""
    res = json.loads((out / "results.json").read_text())
    arms = [a for a in ARMS + EXTRA_ARMS if any(r["arm"] == a for r in res["runs"])]
    res["summary"] = summarize(res["runs"], arms)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    plot(res["runs"], arms, out / "curves.png")
    print_table(res["summary"])


def write(out: Path, ns: argparse.Namespace, model: Path, runs: list[dict], arms: list[str]) -> dict:
    summary = summarize(runs, arms)
    settings = {"steps": ns.steps, "seeds": ns.seeds, "arms": ns.arms, "completions_per_step": BATCH,
                "trl_group": f"{BATCH // GROUP} prompts x {GROUP}", "max_new_tokens": MAX_NEW_TOKENS, "lr": LR,
                "trailing_window": WINDOW, "thresholds": THRESHOLDS, "sao_overrides": SAO_COMMON,
                "sao_arm_overrides": SAO_ARMS, "trl_pins": TRL_PINS, "model": str(model), "load": ns.load,
                "omp_wait_policy": ns.omp_wait_policy or "each framework's default",
                "host": {"cpus": os.cpu_count()}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "results.json").write_text(json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=1))
    return summary


if __name__ == "__main__":
    main()
