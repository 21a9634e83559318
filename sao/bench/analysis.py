"""What a benchmark reads out of each run's metrics.jsonl: curves, collapse, time to target, recovery.

Wall-clock here is the training loop's own: `perf/wall_s` minus the held-out evaluations done so far
(`eval/wall_s`), which every variant pays the same way and which are bench overhead, not training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CURVES = {  # results.json name -> metrics.jsonl key (per training step)
    "reward": "reward/mean",
    "dis_masked": None,  # low + high side, computed
    "ppo_clipfrac": "ppo/clipfrac",
    "explained_variance": "critic/explained_variance",
    "lag": "async/lag_mean",
    "entropy": "actor/entropy",
    "loss": "loss/policy",
    "turns": "rollout/turns_mean",
}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def nonfinite_step(row: dict) -> bool:
    """A policy loss logged as null/NaN/inf (a critic warm-up step and a skipped uniform batch log none), or
    an update the trainer skipped for a non-finite loss or gradient (`guard/skipped_updates`, this step's
    count). Not `actor/uniform_skipped` (no actor update on a batch whose rewards are all equal, by design)
    and not the running total, `guard/skipped_updates_total`: until 2026-12-06 any key with "skipped" in its
    name counted, so every run that once met a uniform batch was reported as a non-finite collapse."""
    return ("loss/policy" in row and not _finite(row["loss/policy"])) or (
        _finite(row.get("guard/skipped_updates")) and row["guard/skipped_updates"] > 0)


def load_run(run_dir: Path) -> dict:
    """Per-step curves and the held-out evaluations of one run (empty lists when it never started)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    eval_wall = {r["step"]: r.get("eval/wall_s", 0.0) for r in evals}

    def train_wall(row: dict) -> float:  # wall at the end of this step, evaluations before it taken out
        return row.get("perf/wall_s", 0.0) - sum(w for s, w in eval_wall.items() if 0 < s < row["step"])

    run: dict = {"step": [r["step"] for r in steps], "wall_s": [round(train_wall(r), 3) for r in steps]}
    for name, key in CURVES.items():
        if key is None:
            run[name] = [(r.get("dis/masked_low_frac") or 0.0) + (r.get("dis/masked_high_frac") or 0.0)
                         if "dis/masked_low_frac" in r else None for r in steps]
        else:
            run[name] = [r.get(key) for r in steps]
    wall_at = dict(zip(run["step"], run["wall_s"]))
    run["eval_step"] = [r["step"] for r in evals]
    run["eval_accuracy"] = [r["eval/accuracy"] for r in evals]
    run["eval_wall_s"] = [0.0 if r["step"] == 0 else wall_at.get(r["step"], None) for r in evals]
    run["eval_rows"] = evals
    run["final_games"] = final_games(Path(run_dir))
    run["start_games"] = start_games(Path(run_dir))
    last = steps[-1] if steps else {}
    run["gen_total_s"], run["train_total_s"] = last.get("perf/gen_total_s"), last.get("perf/train_total_s")
    run["nonfinite"] = [r["step"] for r in steps if nonfinite_step(r)]
    return run


def collapse(run: dict, drop: float = 0.5, min_best: float = 0.1, entropy_frac: float = 0.1,
             converged_frac: float = 0.9) -> tuple[int | None, str]:
    """(step, reason) of the first collapse, or (None, ""). Three signs:
    - a non-finite loss (or a step the trainer skipped as non-finite);
    - held-out accuracy more than `drop` below its best so far (best >= min_best) at an evaluation and
      at every later one, at least two evaluations in a row (one bad evaluation is noise);
    - entropy below `entropy_frac` of its first value and staying there to the end, unless the policy
      converged: its best held-out accuracy is above its first and its last evaluation is at least
      `converged_frac` of that best. A policy that learned and settled on its best answers may be
      near-deterministic; that is convergence, not a collapse. Entropy that collapses with no gain, or
      with accuracy ending below its best, counts (and without evaluations after that step it counts alone)."""
    signs = []
    if run["nonfinite"]:
        signs.append((min(run["nonfinite"]), "non-finite loss"))
    accs, best = run["eval_accuracy"], 0.0
    for i, a in enumerate(accs):
        best = max(best, a)
        floor = (1 - drop) * best
        rest = accs[i:]
        if best >= min_best and len(rest) >= 2 and all(x < floor for x in rest):
            signs.append((run["eval_step"][i], f"held-out accuracy {a:.2f} < {1 - drop:.0%} of its best {best:.2f}"))
            break
    ent = [(s, e) for s, e in zip(run["step"], run["entropy"]) if _finite(e)]
    if ent:
        floor = entropy_frac * ent[0][1]
        top = max(accs, default=0.0)
        for i, (s, e) in enumerate(ent):
            if e < floor and all(x < floor for _, x in ent[i:]):
                after = [a for t, a in zip(run["eval_step"], accs) if t >= s]
                if after and top > accs[0] and after[-1] >= converged_frac * top:
                    break  # converged: it learned, and it ends near its best
                signs.append((s, f"entropy {e:.3f} < {entropy_frac:.0%} of its start {ent[0][1]:.3f}"))
                break
    return min(signs) if signs else (None, "")


def time_to_target(run: dict, target: float) -> tuple[float | None, int | None]:
    """Training wall-clock and step of the first evaluation at or above `target` (None, None if never)."""
    for s, w, a in zip(run["eval_step"], run["eval_wall_s"], run["eval_accuracy"]):
        if a >= target and w is not None:
            return w, s
    return None, None


def accuracy_at(run: dict, wall_s: float) -> float | None:
    """Held-out accuracy of the last evaluation done within `wall_s` of training."""
    got = [a for w, a in zip(run["eval_wall_s"], run["eval_accuracy"]) if w is not None and w <= wall_s + 1e-9]
    return got[-1] if got else None


def moving_average(xs: list[float], w: int) -> list[float]:
    return [sum(xs[max(0, i - w + 1): i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(xs))]


def recovery(steps: list[int], rewards: list[float], starts: list[int], recover_at: float = 0.8,
             window: int = 10) -> list[int | None]:
    """Per switch (phase k >= 1): steps from the switch until the mean reward of the last `window`
    steps *of the new phase* first reaches `recover_at` (None: not within the phase). Same rule as
    benchmarks/style_shift.py."""
    bounds = starts + [math.inf]
    out = []
    for k in range(1, len(starts)):
        phase = [(s, r) for s, r in zip(steps, rewards) if bounds[k] <= s < bounds[k + 1] and r is not None]
        hit = None
        for i in range(window - 1, len(phase)):
            if sum(r for _, r in phase[i - window + 1: i + 1]) / window >= recover_at:
                hit = phase[i][0] - starts[k]
                break
        out.append(hit)
    return out


def mean(xs: list) -> float | None:
    xs = [x for x in xs if _finite(x)]
    return sum(xs) / len(xs) if xs else None


# --- intervals: bootstrap over held-out games and seeds ------------------------------------------------

BOOTSTRAP = 2000  # resamples; the intervals' own noise at this count is ~0.005 on a 0..1 accuracy


def final_games(run_dir: Path) -> dict[str, float] | None:
    """task -> score of the run's last held-out evaluation (evals/step_N.json, written by the runtime),
    failed episodes left out; None for a run without one (or written before per-game results existed)."""
    files = sorted((Path(run_dir) / "evals").glob("step_*.json"))
    return _games(files[-1]) if files else None


def start_games(run_dir: Path) -> dict[str, float] | None:
    """task -> score of the run's evaluation before its first step (evals/step_000000.json), as `final_games`;
    None without one (eval.every=0 evaluates at the end only)."""
    path = Path(run_dir) / "evals" / f"step_{0:06d}.json"
    return _games(path) if path.is_file() else None


def _games(path: Path) -> dict[str, float]:
    games = json.loads(path.read_text())["games"]
    out: dict[str, float] = {}
    for i, g in enumerate(games):
        if g["score"] is not None:
            out[g["task"] if g["task"] not in out else f"{g['task']}#{i}"] = float(g["score"])
    return out


def bootstrap(per_seed: list[list[float]], n: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float, float] | None:
    """(mean, 2.5th, 97.5th percentile) of the mean over seeds of each seed's mean over games, resampling
    seeds and, within each drawn seed, its games (a two-level bootstrap: both sources of noise). With
    paired differences as the values it is the paired comparison."""
    import numpy as np

    arrays = [np.asarray(v, dtype=float) for v in per_seed if len(v)]
    if not arrays:
        return None
    rng = np.random.default_rng(seed)
    s = len(arrays)
    # for every seed, an (n, s) table of resampled game means: slot j of replicate r, if it draws this seed
    means = np.stack([a[rng.integers(0, len(a), size=(n, s, len(a)))].mean(-1) for a in arrays])  # (S, n, s)
    pick = rng.integers(0, s, size=(n, s))  # which seed each slot of each replicate draws
    reps = means[pick, np.arange(n)[:, None], np.arange(s)[None, :]].mean(1)
    point = float(np.mean([a.mean() for a in arrays]))
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return point, float(lo), float(hi)


def paired_differences(runs: dict[int, dict], ref: dict[int, dict], ref_key: str = "final_games") -> list[list[float]]:
    """Per seed both ran, the per-game score differences on the held-out games both evaluated: the final
    evaluations of two variants, or (ref = runs, ref_key="start_games") a run's gain over its own start."""
    out = []
    for seed in sorted(set(runs) & set(ref)):
        a, b = runs[seed].get("final_games"), ref[seed].get(ref_key)
        if a and b:
            common = sorted(set(a) & set(b))
            if common:
                out.append([a[k] - b[k] for k in common])
    return out

