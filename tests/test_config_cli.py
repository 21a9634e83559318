"""Config validation and the CLI's contract for bad input: one line naming it, exit 2, nothing written."""

import subprocess
import sys
from pathlib import Path

import pytest

from sao.config import ConfigError, load_config


def test_defaults_file_and_dotted_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  eps_high: 4.0\ntrain:\n  steps: 7\n")
    cfg = load_config(f, ["algo.eps_high=3.0", "runtime.max_lag=4", "env.options.max_digits=3"])
    assert cfg.algo.eps_high == 3.0 and cfg.train.steps == 7 and cfg.runtime.max_lag == 4
    assert cfg.env.options == {"max_digits": 3}


@pytest.mark.parametrize("overrides,message", [
    (["algo.eps_hgh=3"], "algo.eps_hgh: unknown key; did you mean algo.eps_high?"),
    (["trian.steps=3"], "trian: unknown key; did you mean train?"),
    (["train.eps_high=3"], "train.eps_high: unknown key; did you mean algo.eps_high?"),
    (["train.steps=-1"], "train.steps: Input should be greater than or equal to 1"),
    (["runtime.mode=fast"], "runtime.mode: Input should be 'async' or 'sync'"),
    (["rollout.temperature=0.7"], "rollout: training samples at temperature 1"),
    (["nonsense"], "override 'nonsense': expected key=value"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def _sao(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sao.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["train", "algo.eps_hgh=3"], "algo.eps_hgh: unknown key"),
    (["train", "missing.yaml"], "config file 'missing.yaml': not found"),
    (["train", "foo"], "argument 'foo': neither a config file (no such file) nor a key=value override"),
    (["train", "train.steps", "100"], "argument 'train.steps': an override needs a value, e.g. train.steps=VALUE"),
    (["train", "env.options.max_digit=3"], "env.options.max_digit: unknown key; did you mean env.options.max_digits?"),
    (["train", "env.name=nope"], "env.name: unknown environment 'nope'"),
    (["train", "env.options.max_ops=0"], "env.options.max_ops"),
    (["train", "algo.name=ppo2"], "algo.name: unknown algorithm 'ppo2'"),
    (["train", "model.path=/nonexistent"], "model.path: '/nonexistent' is not a model folder"),
    (["eval", "/nonexistent"], "'/nonexistent': neither a run directory"),
    (["report", "/nonexistent"], "not a run directory"),
])
def test_cli_bad_input_exits_2_without_traceback_or_writes(tmp_path, sao_cli, args, needle):
    proc = sao_cli(*args, "output.root=runs", cwd=tmp_path) if args[0] == "train" else sao_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_existing_run_directory_is_never_overwritten(tmp_path, sao_cli):
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("precious\n")
    proc = sao_cli("train", "output.root=runs", "output.name=mine", cwd=tmp_path)
    assert proc.returncode == 2 and "exists already" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == "precious\n"


def test_flags_may_follow_overrides():
    """Also the one refusal through the real entry point (a new interpreter): exit code 2, one line."""
    from sao.cli import build_parser

    ns, rest = build_parser().parse_known_args(["train", "a.b=1", "--quiet", "c.d=2"])
    assert ns.args == ["a.b=1"] and rest == ["c.d=2"] and ns.quiet
    # an override after a flag reaches the config (argparse alone would reject it as unrecognized)
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", "algo.name=sao", "--quiet", "algo.bad=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "algo.bad: unknown key" in proc.stderr and len(proc.stderr.splitlines()) == 1


RECIPES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def test_recipes_set_environment_settings_visibly_and_environments_change_nothing():
    from sao.config import value_sources
    from sao.runtime.preflight import preflight

    cfg = load_config(RECIPES / "code.yaml")
    before = cfg.model_dump()
    preflight(cfg)
    assert cfg.model_dump() == before  # the environment changes no setting behind the user's back
    assert cfg.rollout.max_action_tokens == 72 and cfg.rollout.max_turns == 3 and cfg.sft.steps == 800
    assert cfg.algo.whiten_advantages is False and cfg.train.lr == 1e-4
    src = value_sources(cfg)
    assert src["train.lr"] == src["algo.whiten_advantages"] == "file" and src["train.batch_size"] == "default"
    cfg = load_config(RECIPES / "code.yaml", ["rollout.max_action_tokens=40"])
    assert cfg.rollout.max_action_tokens == 40 and cfg.rollout.max_turns == 3
    cfg = load_config(None, ["env.name=code"])
    preflight(cfg)
    assert cfg.train.lr == 5e-4 and cfg.rollout.max_action_tokens == 24  # no recipe: the documented defaults
    for recipe in RECIPES.glob("*.yaml"):
        load_config(recipe)  # every recipe validates


def test_sao_config_lists_every_key_with_type_default_and_description():
    from sao.algo.registry import ALGORITHMS
    from sao.config import Config, config_keys
    from sao.envs.base import _REGISTRY

    proc = subprocess.run([sys.executable, "-m", "sao.cli", "config"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for key in config_keys():
        *sections, name = key.split(".")
        node = Config()
        for part in sections:
            node = getattr(node, part)
        field = type(node).model_fields[name]
        row = next(line for line in lines if line.split()[:1] == [key])
        assert field.description in row and "=" in row, row
    assert next(line for line in lines if line.split()[:1] == ["train.lr"]).split()[1:4] == ["float", "=", "0.0005"]
    for name in ALGORITHMS:
        assert any(line.split()[:1] == [name] for line in lines), name
    for name in _REGISTRY:
        assert f"  {name}: " in proc.stdout
    assert "env.options.max_digits" in proc.stdout  # each environment's options too
    assert "sao config" in subprocess.run([sys.executable, "-m", "sao.cli", "--help"], capture_output=True,
                                          text=True, timeout=120).stdout


def test_resolved_config_records_each_value_and_its_source(tmp_path):
    from sao.config import to_yaml, value_sources

    f = tmp_path / "recipe.yaml"
    f.write_text("train:\n  lr: 1.0e-4\nenv:\n  options:\n    max_digits: 3\n")
    cfg = load_config(f, ["train.steps=5", "env.options.ops=+-"])
    cfg.eval.every = 7  # set in Python (the API)
    src = value_sources(cfg)
    assert src["train.lr"] == "file" and src["env.options.max_digits"] == "file"
    assert src["train.steps"] == "override" and src["env.options.ops"] == "override"
    assert src["eval.every"] == "api" and src["algo.eps_high"] == "default"
    text = to_yaml(cfg)
    assert "  lr: 0.0001  # file" in text and "  steps: 5  # override" in text and "eps_high: 5.0  # default" in text
    again = tmp_path / "config.yaml"
    again.write_text(text)
    assert load_config(again).model_dump() == cfg.model_dump()  # config.yaml reloads to the same values
