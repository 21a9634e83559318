"""Summaries of a benchmark: results.json, a Markdown table and PNG plots."""

from __future__ import annotations

from pathlib import Path

from sao.bench.analysis import (
    accuracy_at,
    bootstrap,
    collapse,
    mean,
    moving_average,
    paired_differences,
    recovery,
    time_to_target,
)


def _r(x, nd=4):
    return None if x is None else round(float(x), nd)


def summarize_run(run: dict, analysis: dict, starts: list[int] | None) -> dict:
    c = analysis.get("collapse", {})
    step, reason = collapse(run, c.get("drop", 0.5), c.get("min_best", 0.1), c.get("entropy_frac", 0.1),
                            c.get("converged_frac", 0.9))
    accs = run["eval_accuracy"]
    out = {
        "steps_done": run["step"][-1] if run["step"] else 0,
        "train_wall_s": _r(run["wall_s"][-1] if run["wall_s"] else None, 1),
        "start_accuracy": _r(accs[0]) if accs else None,
        "final_accuracy": _r(accs[-1]) if accs else None,
        "best_accuracy": _r(max(accs)) if accs else None,
        "collapse_step": step, "collapse_reason": reason,
        "dis_masked_mean": _r(mean(run["dis_masked"]), 5),
        "ppo_clipfrac_mean": _r(mean(run["ppo_clipfrac"]), 5),
        "explained_variance_mean": _r(mean(run["explained_variance"])),
        "lag_mean": _r(mean(run["lag"]), 3),
        "entropy_last": _r(run["entropy"][-1] if run["entropy"] else None),
        "gen_total_s": _r(run["gen_total_s"], 1), "train_total_s": _r(run["train_total_s"], 1),
    }
    if "target_accuracy" in analysis:
        wall, s = time_to_target(run, analysis["target_accuracy"])
        out.update(time_to_target_s=_r(wall, 1), steps_to_target=s)
    if starts and "recovery" in analysis:
        rc = analysis["recovery"]
        out["recovery_steps"] = recovery(run["step"], run["reward"], starts, rc.get("recover_at", 0.8),
                                         rc.get("window", 10))
    return out


def _algo(overrides: list[str]) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("algo.name=")), "sao")


def reference_of(exp, name: str, algo: str = "sao") -> str | None:
    """The variant this one is compared with, paired: the same settings but algo.name=`algo` (the same task,
    seeds and held-out games), or None (it is that variant, or the experiment has none like it)."""
    own = exp.variants[name]
    rest = sorted(o for o in own if not o.startswith("algo.name="))
    if _algo(own) == algo:
        return None
    return next((n for n, o in exp.variants.items() if _algo(o) == algo
                 and sorted(x for x in o if not x.startswith("algo.name=")) == rest), None)


def intervals(exp, runs: dict[str, dict[int, dict]]) -> tuple[dict, dict]:
    """Per variant the final held-out accuracy's 95% interval (bootstrap over games and seeds), with, when the
    runs evaluated before training, the start's interval and the paired gain final - start on the same games;
    and per variant with a reference (`reference_of`) the paired difference to it with its interval."""
    ci = {}
    for name, by_seed in runs.items():
        games = [list(r["final_games"].values()) for r in by_seed.values() if r.get("final_games")]
        got = bootstrap(games)
        if got:
            ci[name] = {"mean": _r(got[0]), "ci95": [_r(got[1]), _r(got[2])], "seeds": len(games),
                        "games_per_seed": sorted({len(g) for g in games})}
            start = bootstrap([list(r["start_games"].values()) for r in by_seed.values() if r.get("start_games")])
            gain = bootstrap(paired_differences(by_seed, by_seed, "start_games"))  # did training move it at all?
            if start and gain:
                ci[name]["start"] = {"mean": _r(start[0]), "ci95": [_r(start[1]), _r(start[2])]}
                ci[name]["gain"] = {"mean": _r(gain[0]), "ci95": [_r(gain[1]), _r(gain[2])],
                                    "outside_noise": gain[1] > 0 or gain[2] < 0}
    paired = {}
    for name in runs:
        ref = reference_of(exp, name, exp.analysis.get("reference_algo", "sao")) if name in exp.variants else None
        if ref is None or ref not in runs:
            continue
        diffs = paired_differences(runs[name], runs[ref])
        got = bootstrap(diffs)
        if got:
            paired[name] = {"reference": ref, "diff": _r(got[0]), "ci95": [_r(got[1]), _r(got[2])],
                            "seeds": len(diffs), "outside_noise": got[1] > 0 or got[2] < 0}
    return ci, paired


def summarize(exp, runs: dict[str, dict[int, dict]], infos: list[dict], starts: list[int] | None,
              preset: str) -> dict:
    """results.json: per variant its per-seed figures and their means, plus experiment-level figures."""
    variants = {}
    for name, by_seed in runs.items():
        per_seed = {seed: summarize_run(run, exp.analysis, starts) for seed, run in by_seed.items()}
        variants[name] = {"per_seed": per_seed, "final_accuracy_mean": _r(mean([s["final_accuracy"] for s in per_seed.values()])),
                          "collapse_steps": [s["collapse_step"] for s in per_seed.values()]}
    extra: dict = {}
    ci, paired = intervals(exp, runs)
    for name, c in ci.items():
        variants[name]["final_accuracy_ci95"] = c
    if paired:
        extra["paired_vs_reference"] = paired
    overlap = [o if isinstance(o, dict) else {"async": o[0], "sync": o[1]} for o in exp.analysis.get("overlap", [])]
    timing_only = {o["rollout_only"] for o in overlap if o.get("rollout_only")}  # measure time, do not train
    walls = [s["train_wall_s"] for n, v in variants.items() if n not in timing_only
             for s in v["per_seed"].values() if s["train_wall_s"]]
    if "target_accuracy" in exp.analysis and walls:
        equal = min(walls)  # accuracy when the fastest-finishing training run's time is spent
        extra["equal_wall_s"] = equal
        extra["accuracy_at_equal_wall"] = {n: _r(mean([accuracy_at(runs[n][s], equal) for s in runs[n]]))
                                           for n in runs if n not in timing_only}
    for prefix in exp.analysis.get("groups", []):  # variants compared among themselves (one task, one budget)
        names = [n for n in variants if n.startswith(prefix) and n not in timing_only]
        group_walls = [s["train_wall_s"] for n in names for s in variants[n]["per_seed"].values() if s["train_wall_s"]]
        if group_walls:
            equal = min(group_walls)
            extra.setdefault("equal_wall_by_group", {})[prefix] = {
                "wall_s": equal, "accuracy": {n: _r(mean([accuracy_at(runs[n][s], equal) for s in runs[n]])) for n in names}}
    for o in overlap:  # async wall / max(generation-only, training-only) for the same steps
        a, s, g = o["async"], o["sync"], o.get("rollout_only")
        if a not in variants or s not in variants:
            continue
        ratios = []
        for seed in variants[a]["per_seed"]:
            sa, ss = variants[a]["per_seed"][seed], variants[s]["per_seed"].get(seed, {})
            # generation-only: the rollout side alone (runtime.rollout_only) when the experiment has it, else
            # the sync run's generation phases, which also wait at each batch's barrier for its slowest episode
            sg = variants[g]["per_seed"].get(seed, {}).get("train_wall_s") if g in variants else ss.get("gen_total_s")
            if not (sa.get("train_wall_s") and sg and ss.get("train_total_s")):
                continue
            aw, tr = sa["train_wall_s"], ss["train_total_s"]
            r = {"seed": seed, "async_s": aw, "gen_only_s": sg,
                 "gen_only_from": "rollout_only run" if g in variants else "sync generation phases",
                 "sync_gen_s": ss.get("gen_total_s"), "train_only_s": tr,
                 "async_over_max": _r(aw / max(sg, tr), 3), "async_over_sum": _r(aw / (sg + tr), 3)}
            if g in variants:
                # the rollout-only policy never learns, so its episodes may take fewer environment steps
                # (tool calls) than the trained run's; with environment latency the time goes per step
                ta, tg = mean(runs[a][seed]["turns"]), mean(runs[g][seed]["turns"])
                if ta and tg:
                    scaled = sg * ta / tg
                    r.update(turns_async=_r(ta, 3), turns_rollout_only=_r(tg, 3), gen_only_turn_scaled_s=_r(scaled, 1),
                             async_over_max_turn_scaled=_r(aw / max(scaled, tr), 3))
            ratios.append(r)
        extra.setdefault("overlap", {})[f"{a} vs {g or s}"] = ratios
    return {"experiment": exp.name, "preset": preset, "description": exp.description, "seeds": exp.seeds,
            "overrides": exp.overrides, "config": exp.config, "analysis": exp.analysis, "phase_starts": starts,
            "variants": variants, **extra, "runs": infos}


def _fmt(x, pct=False):
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" if pct else (f"{x:.3f}" if isinstance(x, float) else str(x))


def failed_runs(res: dict) -> list[dict]:
    """Runs that exited with an error (a run stopped at its wall-clock budget exits 130 and is not one)."""
    return [r for r in res["runs"] if r.get("returncode") not in (0, None) and not r.get("budget_stopped")]


def markdown(res: dict) -> str:
    has_target = "target_accuracy" in res["analysis"]
    has_rec = res["phase_starts"] and "recovery" in res["analysis"]
    head = ["variant", "held-out start -> final (per seed)", "final, mean [95% CI]", "best", "collapse step", "train wall s",
            "DIS masked", "PPO clipfrac", "expl. var.", "lag"]
    if has_target:
        head.append(f"wall s to {res['analysis']['target_accuracy']}")
    if has_rec:
        head.append("recovery steps per switch (per seed)")
    lines = [f"# {res['experiment']} ({res['preset']} preset)", "", res["description"].strip(), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in res["variants"].items():
        ps = v["per_seed"].values()
        c = v.get("final_accuracy_ci95")
        row = [f"`{name}`", "; ".join(f"{_fmt(s['start_accuracy'])} -> {_fmt(s['final_accuracy'])}" for s in ps),
               f"{_fmt(c['mean'])} [{_fmt(c['ci95'][0])}, {_fmt(c['ci95'][1])}]" if c else "-",
               "; ".join(_fmt(s["best_accuracy"]) for s in ps),
               "; ".join(f"{s['collapse_step']} ({s['collapse_reason']})" if s["collapse_step"] else "none" for s in ps),
               "; ".join(_fmt(s["train_wall_s"]) for s in ps), "; ".join(_fmt(s["dis_masked_mean"], True) for s in ps),
               "; ".join(_fmt(s["ppo_clipfrac_mean"], True) for s in ps),
               "; ".join(_fmt(s["explained_variance_mean"]) for s in ps), "; ".join(_fmt(s["lag_mean"]) for s in ps)]
        if has_target:
            row.append("; ".join(f"{_fmt(s['time_to_target_s'])} (step {s['steps_to_target']})"
                                 if s["time_to_target_s"] is not None else "not reached" for s in ps))
        if has_rec:
            row.append("; ".join(str(s["recovery_steps"]) for s in ps))
        lines.append("| " + " | ".join(row) + " |")
    gains = {n: v["final_accuracy_ci95"] for n, v in res["variants"].items() if "gain" in v.get("final_accuracy_ci95", {})}
    if gains:
        lines += ["", "Gain over the start (final - start on the same held-out games, per seed; bootstrap over games "
                  "and seeds, 95% interval):", ""]
        for name, c in gains.items():
            s, g = c["start"], c["gain"]
            verdict = "outside the noise" if g["outside_noise"] else "within the noise"
            lines.append(f"- `{name}`: start {s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}], final "
                         f"{c['mean']:.3f}, gain {g['mean']:+.3f} [{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]: {verdict}")
    if res.get("paired_vs_reference"):
        lines += ["", "Paired against the same settings with SAO (same seeds and held-out games; per-game score "
                  "differences, bootstrap over games and seeds, 95% interval):", ""]
        for name, p in res["paired_vs_reference"].items():
            verdict = "outside the noise" if p["outside_noise"] else "within the noise"
            lines.append(f"- `{name}` - `{p['reference']}`: {p['diff']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] "
                         f"over {p['seeds']} seed(s): {verdict}")
    failed = failed_runs(res)
    if failed:
        lines += ["", "**Failed runs** (their figures above are what they wrote before failing):", ""]
        lines += [f"- `{r['variant']}` seed {r['seed']}: exit {r['returncode']}: {r['last_line']}" for r in failed]
    if "accuracy_at_equal_wall" in res:
        lines += ["", f"Held-out accuracy at equal training wall-clock ({res['equal_wall_s']:.0f} s): " + ", ".join(
            f"`{n}` {_fmt(a)}" for n, a in res["accuracy_at_equal_wall"].items())]
    for prefix, g in res.get("equal_wall_by_group", {}).items():
        lines += ["", f"`{prefix}*` at equal training wall-clock ({g['wall_s']:.0f} s, the group's fastest run): " + ", ".join(
            f"`{n}` {_fmt(a)}" for n, a in g["accuracy"].items())]
    for pair, ratios in res.get("overlap", {}).items():
        for r in ratios:
            text = (f"seed {r['seed']}: async {r['async_s']:.0f} s / max(gen-only {r['gen_only_s']:.0f} s "
                    f"({r.get('gen_only_from', 'sync generation phases')}), train-only {r['train_only_s']:.0f} s) = "
                    f"{r['async_over_max']} (1.0 is the physical limit; {r['async_over_sum']} of gen-only + train-only)")
            if r.get("sync_gen_s"):
                text += f"; sync's generation phases took {r['sync_gen_s']:.0f} s"
            if r.get("gen_only_turn_scaled_s"):
                text += (f"; the rollout-only policy took {r['turns_rollout_only']} environment turns per episode and "
                         f"the trained one {r['turns_async']}: scaled to those, gen-only is "
                         f"{r['gen_only_turn_scaled_s']:.0f} s and the ratio {r['async_over_max_turn_scaled']}")
            lines += ["", f"Overlap ({pair}): {text}"]
    lines += ["", "Commands (run from the repository root):", ""]
    lines += [f"    {r['command']}" for r in res["runs"]]
    return "\n".join(lines) + "\n"


PANELS = [("reward", "step", "train reward (10-step avg)"), ("reward", "wall_s", "train reward vs training wall-clock (s)"),
          ("eval_accuracy", "eval_step", "held-out accuracy"), ("dis_masked", "step", "DIS masked fraction (PPO: clipfrac)"),
          ("explained_variance", "step", "critic explained variance"), ("lag", "step", "lag (policy versions)"),
          ("entropy", "step", "policy entropy"), ("eval_accuracy", "eval_wall_s", "held-out accuracy vs wall-clock (s)")]


def plot(res: dict, runs: dict[str, dict[int, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (key, xkey, title) in zip(axes.flat, PANELS):
        for c, (name, by_seed) in enumerate(runs.items()):
            for i, run in enumerate(by_seed.values()):
                ys = run["ppo_clipfrac"] if key == "dis_masked" and run["dis_masked"] and run["dis_masked"][-1] is None \
                    else run[key]
                pts = [(x, y) for x, y in zip(run[xkey], ys) if x is not None and y is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                if key == "reward":
                    ys = moving_average(list(ys), 10)
                ci = res["variants"].get(name, {}).get("final_accuracy_ci95")
                label = f"{name}: final {ci['mean']:.2f} [{ci['ci95'][0]:.2f}, {ci['ci95'][1]:.2f}]" if ci else name
                ax.plot(xs, ys, color=f"C{c}", lw=1, alpha=0.8, marker="o" if key == "eval_accuracy" else None,
                        ms=2, label=label if i == 0 else None)
        for s in (res["phase_starts"] or [])[1:]:
            if xkey in ("step", "eval_step"):
                ax.axvline(s, color="grey", lw=0.8, ls="--")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    if axes.flat[0].get_legend_handles_labels()[0]:  # nothing to label when every run failed before step 1
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{res['experiment']} ({res['preset']} preset, seeds {res['seeds']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
