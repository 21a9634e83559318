"""What the whole suite shares: tiny-run settings, one SFT cache per test session, an in-process CLI,
the real Ray cluster, and the lanes.

Lanes (markers declared in pyproject.toml):
    pytest -q                      the full suite (what CI and the README run)
    pytest -q -m "not slow"        the fast lane, before each commit: no end-to-end `sao train`
                                   subprocesses, no vLLM server, no Ray cluster, no SmolLM2
    pytest -q -m slow              only the slow ones
`slow` covers everything that is `ray`, `vllm` or `smollm2` too (added below), so each external
dependency can also be selected or left out on its own (e.g. -m "not vllm").
"""

import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(1)

# A background job (`cmd &` in a script, nohup, a CI runner that starts the suite so) begins with SIGINT
# ignored, and an ignored signal stays ignored across exec: every `sao` a test starts would then shrug off
# the Ctrl-C the test sends it (a full run hung in test_first_hour's Ctrl-C test this way). Handled here as
# in a terminal, a signal goes back to its default in each child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One SFT cache for the session: every end-to-end run with the same tiny config reuses one SFT model
# (sao/runtime/model_setup.py keys entries by config, so different configs never collide). Tests about
# the cache itself (tests/test_first_hour.py) use folders of their own.
SFT_CACHE = Path(tempfile.mkdtemp(prefix="sao-test-sft-"))

# The tiny run every end-to-end test starts from; a test appends what it is about (later keys win).
TINY = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
    "sft.steps=20", "sft.batch_size=8", "train.steps=4", "train.batch_size=4", "critic.warmup_steps=1",
    "rollout.concurrency=8", "rollout.max_turns=2", "rollout.max_action_tokens=12", "runtime.max_lag=1",
    "eval.num_tasks=4", "eval.every=0", "output.root=runs", f"model.cache_dir={SFT_CACHE}",
    # the barely trained tiny policy gets all-zero batches often; these runs test the machinery (versions,
    # resume, audit), so every step trains the actor (tests/test_solved_task.py tests the skip itself)
    "algo.skip_uniform_rewards=false",
]

EXTERNAL = ("ray", "vllm", "smollm2")


def two_turn_trajectories(codec, rewards, behavior: float = 0.0):
    """One two-turn episode per reward (answer, observation, answer), each action token's recorded log-prob
    `behavior`: the batches the algorithms' hand-computation tests step on."""
    from sao.types import Trajectory

    trajs = []
    for i, r in enumerate(rewards):
        p = codec.prompt_ids([{"role": "user", "content": f"{i + 2}+{i}"}])
        a = codec.action_ids(f"<answer>{2 * i + 2}</answer>")
        o = codec.action_ids("= ok")
        a2 = codec.action_ids("<answer>1</answer>")
        ids, mask = p + a + o + a2, [0] * len(p) + [1] * len(a) + [0] * len(o) + [1] * len(a2)
        trajs.append(Trajectory(f"e{i}", f"t{i}", ids, mask, [behavior * m for m in mask],
                                [0 if m else -1 for m in mask], len(p), reward=r, turns=2))
    return trajs


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(m) for m in EXTERNAL):
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session):
    shutil.rmtree(SFT_CACHE, ignore_errors=True)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture()
def sao_cli(capsys, monkeypatch):
    """`sao ARGS` in this process (for refusals: no interpreter start-up, no imports paid again). The
    exit code is main()'s; an exception it lets through fails the test, as a traceback would."""
    from sao.cli import main

    def run(*args: str, cwd: Path) -> CliResult:
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", ""))  # restored after the test
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return run


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialized built-in model (Llama architecture, char tokenizer), built once."""
    from sao.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, num_heads=2,
                            intermediate_size=64, max_positions=256, seed=0)


@pytest.fixture()
def tiny(tiny_model_dir):
    from sao.models.chat import ChatCodec
    from sao.models.tiny import load_model
    from sao.models.tokenizer import load_tokenizer

    torch.manual_seed(0)
    return load_model(tiny_model_dir), ChatCodec(load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_model_dir(request, tmp_path_factory):
    """A 32-wide, 2-layer built-in model of each architecture (the packing and SFT tests run on both)."""
    from sao.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, hidden_size=32,
                            num_layers=2, num_heads=2, intermediate_size=64, max_positions=128, seed=0)


@pytest.fixture(scope="session")
def ray_address():
    """One local Ray cluster for the whole test run (small object store); CLI runs join it with
    runtime.ray_address, so each test pays for actors, not for starting Ray."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False,
             logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def pytest_terminal_summary(terminalreporter):
    """Say why the real-vLLM tests did not run (CI installs the vLLM environment, so they should)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "vllm" in getattr(r, "keywords", {})]
    if skipped:
        reason = skipped[0].longrepr[2] if isinstance(skipped[0].longrepr, tuple) else ""
        terminalreporter.write_line(f"vllm: {len(skipped)} real-vLLM tests skipped: {reason}")


