"""`env.name=harbor` on Harbor task folders (examples/harbor_tasks, the format Harbor's own template uses):
the task's verifier run in sao's sandbox gives the reward Harbor would read; sao's own loop and an agent
command through the endpoint; nothing a command does reaches the host; bad input is one line, exit 2.

The `harbor` package itself needs Python >= 3.12 (this machine has 3.11) and runs tasks only in
containers, so these tests read the task format without it (docs/integrations.md)."""

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sao.envs import make_environment
from sao.envs.base import EpisodeContext
from sao.envs.harbor_env import read_tasks
from sao.rollout.agent_loop import EpisodeLimits, run_episode
from sao.sandbox.namespace import available_mechanism
from sao.sandbox.shell import run_shell
from sao.types import Generation, SamplingParams, Status

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "examples" / "harbor_tasks"

pytestmark = pytest.mark.skipif(available_mechanism() == "none", reason="no sandbox mechanism (bwrap or unshare)")


class Scripted:
    """Replays fixed replies as the engine's samples."""

    def __init__(self, codec, replies):
        self.codec, self.replies, self.version = codec, list(replies), 0

    async def generate(self, prompt_ids, params, session=None):
        ids = self.codec.action_ids(self.replies.pop(0))
        return Generation(ids, [-0.1] * len(ids), [0] * len(ids), "stop")

    def release(self, session):
        pass


def episode(environment, task_id, engine, codec, turns=6):
    task = next(t for t in environment.train if t.id == task_id)
    limits = EpisodeLimits(max_turns=turns, max_action_tokens=200, max_episode_tokens=4000, step_timeout_s=120)
    return asyncio.run(run_episode(environment.new_episode(EpisodeContext()), task, engine, codec, SamplingParams(),
                                   limits))


def test_tasks_are_read_as_harbor_reads_them():
    tasks = {t.name: t for t in read_tasks(TASKS)}
    assert sorted(tasks) == ["example/count-lines", "example/hello-world"]
    count = tasks["example/count-lines"]
    assert count.instruction.startswith("/app/data.txt holds")  # the canary line is dropped, as Harbor does
    assert count.verifier_timeout_s == 60.0 and "/tests/test.sh" in count.tests
    assert [t.name for t in read_tasks(TASKS / "hello-world")] == ["example/hello-world"]  # one task folder


@pytest.mark.parametrize("name", ["hello-world", "count-lines"])
def test_the_reference_solution_earns_the_verifiers_reward_and_doing_nothing_does_not(name):
    environment = make_environment("harbor", {"path": str(TASKS)}, seed=0)
    task = environment.tasks[f"example/{name}"]
    solve = (TASKS / name / "solution" / "solve.sh").read_text()
    solved = asyncio.run(run_shell(solve, workspace=task.workspace))
    assert solved.exit_code == 0 and not solved.error, solved.output
    assert asyncio.run(environment.verify(task, solved.workspace))[0] == 1.0
    reward, metrics = asyncio.run(environment.verify(task, task.workspace))
    assert reward == 0.0
    if name == "count-lines":  # reward.json: the named values beside `reward` become metrics
        assert metrics == {"harbor/file_written": 0.0}


def test_sao_loop_runs_commands_in_the_sandbox_and_the_verifier_scores_the_workspace(tiny):
    _, codec = tiny
    environment = make_environment("harbor", {"path": str(TASKS)}, seed=0)
    marker = f"/tmp/sao-harbor-escape-{uuid.uuid4().hex[:8]}"
    replies = [f"<bash>echo escaped > {marker}; ls</bash>", "<bash>wc -l < data.txt > count.txt && cat count.txt</bash>",
               "done <submit>"]
    traj = episode(environment, "example/count-lines", Scripted(codec, replies), codec)
    assert traj.status == Status.OK, traj.status_reason
    assert (traj.reward, traj.turns, traj.metrics["harbor/commands"], traj.metrics["harbor/file_written"]) == (1.0, 3, 2, 1)
    text = codec.decode(traj.token_ids)
    assert "data.txt" in text and "[exit 0]" in text and "4\n[exit 0]" in text  # what the model saw
    assert not os.path.exists(marker)  # /tmp inside is the run's own tmpfs
    # a reply with no command ends the episode: the verifier runs on the untouched workspace
    traj = episode(environment, "example/hello-world", Scripted(codec, ["I am not sure."]), codec)
    assert (traj.status, traj.reward, traj.turns) == (Status.OK, 0.0, 1), traj.status_reason


def test_an_agent_command_calls_the_endpoint_from_the_sandbox(tiny, tmp_path):
    pytest.importorskip("uvicorn")
    model, codec = tiny
    from sao.engine.torch_engine import TorchEngine

    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "solve.py").write_text(
        "import json, os, urllib.request\n"
        "task = json.loads(os.environ['SAO_TASK'])\n"
        "body = json.dumps({'model': 'sao', 'max_tokens': 4,\n"
        "                   'messages': [{'role': 'user', 'content': task['prompt']}]}).encode()\n"
        "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', data=body,\n"
        "    headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
        "reply = json.load(urllib.request.urlopen(req))['choices'][0]['message']['content']\n"
        "open('/app/out.txt', 'w').write('hello')\n"
        "print('the model said', repr(reply))\n")
    environment = make_environment("harbor", {"path": str(TASKS), "agent": "command", "command": "python3 /agent/solve.py",
                                              "command_dir": str(agent)}, seed=0)
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)
    traj = episode(environment, "example/hello-world", engine, codec)
    assert traj.status == Status.OK, traj.status_reason
    assert (traj.reward, traj.metrics["agent/calls"], traj.metrics["agent/harbor/agent_exit"]) == (1.0, 1, 0)
    assert traj.num_action_tokens >= 1  # the agent's one call, sampled by sao's engine


def test_a_verifier_that_writes_no_reward_is_an_env_error(tiny, tmp_path):
    _, codec = tiny
    task = tmp_path / "broken"
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "instruction.md").write_text("Do nothing.\n")
    (task / "task.toml").write_text("[verifier]\ntimeout_sec = 30\n")
    (task / "tests" / "test.sh").write_text("echo 'pytest: not installed' >&2; exit 3\n")
    environment = make_environment("harbor", {"path": str(task)}, seed=0)
    traj = episode(environment, "broken", Scripted(codec, ["<submit>"]), codec)
    assert traj.status == Status.ENV_ERROR
    assert "wrote neither /logs/verifier/reward.json nor reward.txt (test.sh exited 3: pytest: not installed)" in \
        traj.status_reason


def test_bad_harbor_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from sao import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    no_tests = tmp_path / "no_tests"
    no_tests.mkdir()
    (no_tests / "task.toml").write_text("[verifier]\ntimeout_sec = 30\n")
    (no_tests / "instruction.md").write_text("x\n")
    steps = tmp_path / "steps"
    steps.mkdir()
    (steps / "task.toml").write_text("[[steps]]\nname = 'a'\n")
    (steps / "instruction.md").write_text("x\n")
    for options, expect in [
        ([f"env.options.path={tmp_path / 'nope'}"], "is not a folder"),
        ([f"env.options.path={tmp_path / 'empty'}"], "env.options.path: no Harbor task in"),
        ([f"env.options.path={no_tests}"], "is not a Harbor task: no tests/test.sh"),
        ([f"env.options.path={steps}"], "is not a Harbor task: a multi-step task"),
        ([f"env.options.path={TASKS}", "env.options.agent=command"], "give command exactly when agent=command"),
    ]:
        assert cli.main(["train", "env.name=harbor", *options]) == 2, options
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], lines
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_sao_train_on_harbor_tasks(tmp_path):
    from sao.models.tiny import build_tiny_model

    # the system prompt and instruction are ~300 characters: a context of 1024 for the character tokenizer
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                 max_positions=1024, seed=0)
    args = ["env.name=harbor", f"env.options.path={TASKS}", "env.options.output_chars=200", f"model.path={model_dir}",
            "train.steps=2", "train.batch_size=4", "critic.warmup_steps=1", "rollout.concurrency=4",
            "rollout.max_turns=3", "rollout.max_action_tokens=16", "rollout.max_episode_tokens=1000", "eval.num_tasks=2",
            "eval.every=0", "output.trajectories_every=1", "output.root=runs", "output.name=harbor"]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "harbor"
    rows = [json.loads(line) for f in sorted((run_dir / "trajectories").glob("step_*.jsonl"))
            for line in f.read_text().splitlines()]
    assert rows and all(r["status"] in ("ok", "truncated") for r in rows), [r["status_reason"] for r in rows]
    assert all(r["reward"] in (0.0, 1.0) for r in rows)
