"""Experiment files and running their variants. The shipped experiments are package data
(sao/bench/experiments/*.yaml, named on the command line: `sao bench stability`); any other is a
.yaml file the user gives by path.

    description: what the experiment shows
    config: my_recipe.yaml                        # optional recipe every variant starts from (a path)
    overrides: [train.steps=300, eval.every=25]   # the shared budget and settings (dotted keys)
    seeds: [0, 1, 2]
    budget_s: 600                                 # optional wall-clock budget per run (SIGTERM, then stop)
    variants:                                     # name -> its own overrides
      sao: [algo.name=sao]
      grpo: [algo.name=grpo, algo.group_size=4]
    analysis: {collapse: {...}, target_accuracy: 0.6, overlap: [{async: sao, sync: sao_sync,
              rollout_only: sao_gen}], recovery: {...}}
    quick: {overrides: [...], seeds: [0], analysis: {recovery: {window: 2}},  # the `--quick` preset, on top
            variants: [sao]}                      # optional: only these variants in the quick preset
                                                  # (its overrides win over the variants' own)

Every variant runs as its own `sao train` process (a fresh interpreter, so no state leaks from one
run into the next), one after another: on a small machine side-by-side runs would steal each
other's cores and the wall-clock figures would measure the contention.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sao.config import ConfigError

EXPERIMENTS_DIR = Path(__file__).resolve().parent / "experiments"  # shipped with the package (pyproject.toml)


class Preset(BaseModel):
    model_config = ConfigDict(extra="forbid")
    overrides: list[str] = Field(default_factory=list, description="dotted overrides on top of the experiment's")
    seeds: list[int] | None = Field(None, description="seeds of this preset (default: the experiment's)")
    budget_s: float | None = Field(None, gt=0, description="wall-clock budget per run of this preset")
    analysis: dict[str, Any] = Field(default_factory=dict, description="analysis settings replaced in this preset")
    variants: list[str] | None = Field(None, description="the variants this preset runs (default: all of them)")


class Experiment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = ""
    description: str = Field("", description="what the experiment shows")
    config: str | None = Field(None, description="a recipe file every variant starts from")
    overrides: list[str] = Field(default_factory=list, description="shared settings and budget (dotted keys)")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="train.seed of each repeat")
    budget_s: float | None = Field(None, gt=0, description="optional wall-clock budget per run (then SIGTERM)")
    variants: dict[str, list[str]] = Field(min_length=1, description="variant name -> its overrides")
    analysis: dict[str, Any] = Field(default_factory=dict, description="collapse, target_accuracy, overlap, recovery")
    quick: Preset = Field(default_factory=Preset, description="the --quick preset")

    def preset(self, quick: bool, seeds: list[int] | None = None) -> Experiment:
        """The experiment with the --quick preset applied (or as is), and `seeds` (--seeds) if given."""
        if not quick:
            return self.model_copy(update={"seeds": list(seeds)}) if seeds else self
        chosen = self.quick.variants or list(self.variants)
        return self.model_copy(update={
            # the preset's sizing wins over a variant's own (horizon's longer quests take fewer steps in full)
            "variants": {name: self.variants[name] + self.quick.overrides for name in chosen},
            "overrides": self.overrides + self.quick.overrides,
            "seeds": list(seeds or self.quick.seeds or self.seeds),
            "budget_s": self.quick.budget_s or self.budget_s,
            "analysis": {**self.analysis, **self.quick.analysis},
        })


def find_experiment(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"experiment file {str(p)!r}: not found")
        return p
    p = EXPERIMENTS_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        known = ", ".join(sorted(x.stem for x in EXPERIMENTS_DIR.glob("*.yaml")))
        raise ConfigError(f"experiment {name_or_path!r}: unknown (known: {known}; or give a .yaml file)")
    return p


def load_experiment(name_or_path: str) -> Experiment:
    path = find_experiment(name_or_path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"experiment file {str(path)!r}: invalid YAML") from None
    try:
        exp = Experiment(**{"name": path.stem, **tree})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(f"experiment file {str(path)!r}: {loc}: {msg}") from None
    unknown = [v for v in exp.quick.variants or [] if v not in exp.variants]
    if unknown:
        raise ConfigError(f"experiment file {str(path)!r}: quick.variants: unknown variant {unknown[0]!r}")
    if exp.config and not Path(exp.config).is_file():
        raise ConfigError(f"experiment file {str(path)!r}: config: {exp.config!r} not found")
    return exp


def train_args(exp: Experiment, variant: str, seed: int, runs_root: Path, extra: list[str]) -> list[str]:
    """The `sao train` arguments of one run (also what results.json records as its command)."""
    merged: dict[str, str] = {}  # later settings win, as in `sao train`; each key written once
    for item in [*exp.overrides, *exp.variants[variant], *extra, f"train.seed={seed}", f"output.root={runs_root}",
                 f"output.name={variant}-s{seed}"]:
        key = item.partition("=")[0]
        merged.pop(key, None)
        merged[key] = item
    return ([exp.config] if exp.config else []) + list(merged.values())


def last_line(path: Path) -> str:
    """The last line a run printed (its summary, or why it failed); "" without a log."""
    lines = path.read_text().strip().splitlines() if path.is_file() else []
    return lines[-1] if lines else ""


def check_runs(exp: Experiment, extra: list[str]) -> None:
    """Every variant's config is valid, before the first run starts (a typo fails in seconds)."""
    from sao.config import load_config
    from sao.runtime.preflight import check_algorithm, check_runtime

    for variant in exp.variants:
        overrides = [a for a in train_args(exp, variant, 0, Path("."), extra) if "=" in a]
        try:
            cfg = load_config(exp.config, overrides)
            check_runtime(cfg)
            check_algorithm(cfg)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"variant {variant!r}: {exc}") from None


def _progress_line(run_dir: Path, total: int, log_file: Path | None = None) -> str:
    """Step, reward and held-out accuracy from the run's metrics; before its first step, the last line the
    run printed (games being generated, say) when there is one."""
    path = run_dir / "metrics.jsonl"
    step, reward, acc = 0, None, None
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if "reward/mean" in row:
                step, reward = row["step"], row["reward/mean"]
            if "eval/accuracy" in row:
                acc = row["eval/accuracy"]
    parts = [f"step {step}/{total}"]
    if reward is not None:
        parts.append(f"reward {reward:.2f}")
    if acc is not None:
        parts.append(f"held-out {acc:.2f}")
    if reward is None and log_file is not None:
        said = last_line(log_file)
        if said:
            parts.append(said[:120])
    return ", ".join(parts)


def run_variant(exp: Experiment, variant: str, seed: int, runs_root: Path, extra: list[str], total_steps: int,
                label: str, log=print) -> dict:
    """One `sao train` process; progress every few seconds; SIGTERM at the wall-clock budget."""
    args = train_args(exp, variant, seed, runs_root, extra)
    run_dir = runs_root / f"{variant}-s{seed}"
    runs_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    with open(runs_root / f"{variant}-s{seed}.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
        last, stopped = 0.0, False
        while proc.poll() is None:
            time.sleep(1.0)
            now = time.time()
            if exp.budget_s and not stopped and now - t0 > exp.budget_s:
                proc.send_signal(signal.SIGTERM)  # stops at the next step boundary, writes a checkpoint
                stopped = True
            if now - last >= 10:
                last = now
                said = _progress_line(run_dir, total_steps, runs_root / f"{variant}-s{seed}.log")
                log(f"{label} {variant} seed {seed}: {said} ({now - t0:.0f}s)")
    return {"variant": variant, "seed": seed, "run_dir": str(run_dir), "returncode": proc.returncode,
            "budget_stopped": stopped, "process_s": time.time() - t0, "command": "sao train " + " ".join(args),
            "last_line": last_line(runs_root / f"{variant}-s{seed}.log")}
