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
from sao.bench.experiment import check_runs, last_line, load_experiment, run_variant, train_args
from sao.bench.report import failed_runs, markdown, plot, summarize


def phase_starts(exp, extra: list[str]) -> list[int] | None:
    """Switch steps of a style_shift experiment (for recovery), else None."""
    from sao.config import load_config

    cfg = load_config(exp.config, [*exp.overrides, *extra])
    if cfg.env.name != "style_shift":
        return None
    from sao.envs.style_shift import StyleShiftOptions

    return [p.start for p in StyleShiftOptions(**cfg.env.options).phases]


def total_steps(exp, extra: list[str], variant: str | None = None) -> int:
    """train.steps of a variant (its own overrides may change it), or of the shared settings."""
    from sao.config import load_config

    own = exp.variants[variant] if variant else []
    return load_config(exp.config, [*exp.overrides, *own, *extra]).train.steps


def write_results(exp, runs: dict, infos: list[dict], starts, preset: str, out: Path) -> dict:
    res = summarize(exp, runs, infos, starts, preset)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    return res


def _previous_records(root: Path, out_dir: Path) -> dict[str, dict]:
    """run folder name -> what an earlier bench recorded about it (command, exit status, process time):
    root/bench.json, else the run list of the results.json it wrote."""
    known: dict[str, dict] = {}
    try:
        for r in json.loads((out_dir / "results.json").read_text()).get("runs", []):
            if Path(r["run_dir"]).parent == root:
                known[Path(r["run_dir"]).name] = r
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pass
    try:
        known.update(json.loads((root / "bench.json").read_text()))
    except (OSError, json.JSONDecodeError):
        pass
    return known


def finished_run(exp, variant: str, seed: int, root: Path, extra: list[str], steps: int,
                 previous: dict[str, dict]) -> dict | None:
    """The record of a run already finished in `root` with the same command (None: run it). A bench that
    was interrupted, or whose analysis changed, continues from its folder instead of re-training."""
    run_dir = root / f"{variant}-s{seed}"
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if summary.get("steps") != steps:
        return None
    command = "sao train " + " ".join(train_args(exp, variant, seed, root, extra))
    prev = previous.get(run_dir.name, {})
    if prev.get("command", command) != command:
        return None  # same folder, different settings: run again
    return {"variant": variant, "seed": seed, "run_dir": str(run_dir), "returncode": prev.get("returncode", 0),
            "budget_stopped": prev.get("budget_stopped", False), "process_s": prev.get("process_s"),
            "command": command, "last_line": last_line(root / f"{variant}-s{seed}.log"), "reused": True}


def set_aside(run_dir: Path) -> Path | None:
    """Move a run folder that is in the way (a run interrupted before its summary, or one trained with other
    settings) and its log to `NAME.interrupted-TIME` / `NAME.superseded-TIME`, so the run can start again
    from step 0 (`sao train` refuses an existing folder, and a resumed run's wall-clock would include the
    gap). Nothing is deleted. Returns the new folder, or None when nothing was in the way."""
    if not run_dir.exists():
        return None
    kind = "superseded" if (run_dir / "summary.json").is_file() else "interrupted"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.{kind}-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.{kind}-{stamp}-{n}")
    run_dir.rename(aside)
    log_file = run_dir.with_name(run_dir.name + ".log")
    if log_file.is_file():
        log_file.rename(aside.with_name(aside.name + ".log"))
    return aside


def _record(root: Path, info: dict) -> None:
    path = root / "bench.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    known[Path(info["run_dir"]).name] = {k: info[k] for k in ("command", "returncode", "budget_stopped", "process_s")}
    path.write_text(json.dumps(known, indent=1))


def bench(name: str, quick: bool = False, out: str | None = None, runs_root: str | None = None,
          extra: list[str] | None = None, log=print, seeds: list[int] | None = None,
          finished_only: bool = False) -> dict:
    """Run every variant x seed (reusing runs finished in `runs_root`) and write the results; with
    `finished_only`, write the results of the finished runs and run nothing (a bench cut short)."""
    extra = extra or []
    exp = load_experiment(name).preset(quick, seeds)
    preset = "quick" if quick else "full"
    check_runs(exp, extra)  # every variant's config is valid before the first run starts
    out_dir = Path(out) if out else Path("benchmarks") / "results" / exp.name / preset
    root = Path(runs_root) if runs_root else Path("runs") / "bench" / f"{exp.name}-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    starts = phase_starts(exp, extra)
    steps = {v: total_steps(exp, extra, v) for v in exp.variants}
    jobs = [(seed, v) for seed in exp.seeds for v in exp.variants]
    counts = sorted(set(steps.values()))
    log(f"bench {exp.name} ({preset}): {len(exp.variants)} variants x {len(exp.seeds)} seeds, "
        f"{'/'.join(map(str, counts))} steps each; runs in {root}, results in {out_dir}")
    runs: dict[str, dict[int, dict]] = {v: {} for v in exp.variants}
    infos: list[dict] = []
    t0 = time.time()
    previous = _previous_records(root, out_dir)
    for i, (seed, variant) in enumerate(jobs, 1):
        info = finished_run(exp, variant, seed, root, extra, steps[variant], previous)
        if info is not None:
            log(f"[{i}/{len(jobs)}] {variant} seed {seed}: finished in {root} already, reused")
        elif finished_only:
            log(f"[{i}/{len(jobs)}] {variant} seed {seed}: not finished in {root}, left out (--finished-only)")
            continue
        else:
            aside = set_aside(root / f"{variant}-s{seed}")
            if aside is not None:
                log(f"[{i}/{len(jobs)}] {variant} seed {seed}: unfinished or other settings in {root}, "
                    f"moved to {aside.name} and run again from the start")
            info = run_variant(exp, variant, seed, root, extra, steps[variant], f"[{i}/{len(jobs)}]", log)
            _record(root, info)
            state = "ok" if info["returncode"] == 0 else f"exit {info['returncode']}: {info['last_line']}"
            log(f"[{i}/{len(jobs)}] {variant} seed {seed}: {state} ({info['process_s']:.0f}s)")
        infos.append(info)
        runs[variant][seed] = load_run(Path(info["run_dir"]))
        write_results(exp, runs, infos, starts, preset, out_dir)  # after every run: a crash keeps the rest
    res = write_results(exp, runs, infos, starts, preset, out_dir)
    plot(res, runs, out_dir / "curves.png")
    log(markdown(res))
    log(f"bench {exp.name} ({preset}) done in {time.time() - t0:.0f}s: {out_dir}/results.json, results.md, curves.png")
    failed = failed_runs(res)
    if failed:
        log(f"{len(failed)} of {len(res['runs'])} runs failed: " + "; ".join(
            f"{r['variant']} seed {r['seed']} (exit {r['returncode']}, log {Path(r['run_dir']).name}.log)" for r in failed))
    return res
