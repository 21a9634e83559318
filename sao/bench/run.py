"""`sao bench EXPERIMENT [--quick] [--out DIR] [key=value ...]`: run every variant x seed, then write

    OUT/results.json   per variant and seed: held-out accuracy (start, final, best), collapse step and
                       reason, training wall-clock, time to target, recovery steps, DIS masked fraction,
                       explained variance, lag; experiment-level figures; each run's exact command
    OUT/results.md     the same as a Markdown table
    OUT/curves.png     reward vs step and vs wall-clock, held-out accuracy vs step and vs wall-clock,
                       DIS masked fraction, explained variance, lag, entropy
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sao.bench.analysis import load_run
from sao.bench.experiment import check_runs, load_experiment, run_variant
from sao.bench.report import markdown, plot, summarize


def phase_starts(exp, extra: list[str]) -> list[int] | None:
    """Switch steps of a style_shift experiment (for recovery), else None."""
    from sao.config import load_config

    cfg = load_config(exp.config, [*exp.overrides, *extra])
    if cfg.env.name != "style_shift":
        return None
    from sao.envs.style_shift import StyleShiftOptions

    return [p.start for p in StyleShiftOptions(**cfg.env.options).phases]


def total_steps(exp, extra: list[str]) -> int:
    from sao.config import load_config

    return load_config(exp.config, [*exp.overrides, *extra]).train.steps


def write_results(exp, runs: dict, infos: list[dict], starts, preset: str, out: Path) -> dict:
    res = summarize(exp, runs, infos, starts, preset)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    return res


def bench(name: str, quick: bool = False, out: str | None = None, runs_root: str | None = None,
          extra: list[str] | None = None, log=print) -> dict:
    extra = extra or []
    exp = load_experiment(name).preset(quick)
    preset = "quick" if quick else "full"
    check_runs(exp, extra)  # every variant's config is valid before the first run starts
    out_dir = Path(out) if out else Path("benchmarks") / "results" / exp.name / preset
    root = Path(runs_root) if runs_root else Path("runs") / "bench" / f"{exp.name}-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    starts, steps = phase_starts(exp, extra), total_steps(exp, extra)
    jobs = [(seed, v) for seed in exp.seeds for v in exp.variants]
    log(f"bench {exp.name} ({preset}): {len(exp.variants)} variants x {len(exp.seeds)} seeds, {steps} steps each; "
        f"runs in {root}, results in {out_dir}")
    runs: dict[str, dict[int, dict]] = {v: {} for v in exp.variants}
    infos: list[dict] = []
    t0 = time.time()
    for i, (seed, variant) in enumerate(jobs, 1):
        info = run_variant(exp, variant, seed, root, extra, steps, f"[{i}/{len(jobs)}]", log)
        infos.append(info)
        runs[variant][seed] = load_run(Path(info["run_dir"]))
        state = "ok" if info["returncode"] == 0 else f"exit {info['returncode']}: {info['last_line']}"
        log(f"[{i}/{len(jobs)}] {variant} seed {seed}: {state} ({info['process_s']:.0f}s)")
        write_results(exp, runs, infos, starts, preset, out_dir)  # after every run: a crash keeps the rest
    res = write_results(exp, runs, infos, starts, preset, out_dir)
    plot(res, runs, out_dir / "curves.png")
    log(markdown(res))
    log(f"bench {exp.name} ({preset}) done in {time.time() - t0:.0f}s: {out_dir}/results.json, results.md, curves.png")
    return res
