"""`env.name=verifiers` on the real `verifiers` package (0.3.1 and 0.4.0) and environments in a third-party
layout (examples/verifiers_envs, the older module:load_environment API too): rollouts of the environment's own
loop through sao's endpoint, rewards equal to
what the package's own scoring gives for the same replies, a short `sao train`, one-line refusals."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed (pip install 'sao[verifiers]')")
pytest.importorskip("uvicorn")

from sao.engine.torch_engine import TorchEngine  # noqa: E402
from sao.envs import make_environment  # noqa: E402
from sao.envs.base import EpisodeContext  # noqa: E402
from sao.rollout.agent_loop import EpisodeLimits, run_episode  # noqa: E402
from sao.types import SamplingParams, Status  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "verifiers_envs"


@pytest.fixture(autouse=True)
def third_party(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as if `pip install examples/verifiers_envs`
    monkeypatch.setenv("HOME", str(tmp_path))  # verifiers writes a cache under $HOME


class Recording:
    def __init__(self, engine):
        self.engine, self.gens = engine, []

    @property
    def version(self):
        return self.engine.version

    async def generate(self, prompt_ids, params, session=None):
        gen = await self.engine.generate(prompt_ids, params, session=session)
        self.gens.append((list(prompt_ids), gen))
        return gen

    def release(self, session):
        self.engine.release(session)


def rollouts(environment, engine, codec, n: int):
    limits = EpisodeLimits(max_turns=4, max_action_tokens=8, max_episode_tokens=250, step_timeout_s=30)
    tasks = environment.eval_tasks(n)

    async def go():
        out = await asyncio.gather(*(run_episode(environment.new_episode(EpisodeContext()), t, engine, codec,
                                                 SamplingParams(), limits) for t in tasks))
        await engine.engine.close()
        return out

    return asyncio.run(go()), tasks


def score(environment, task_id: str, messages: list[dict]) -> float:
    """The package's own scoring of a fixed conversation for the task (its @vf.reward functions)."""
    from verifiers.v1.dialects import parse_message

    task = environment.tasks[task_id]
    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=parse_message(m), sampled=m["role"] == "assistant")
             for i, m in enumerate(messages)]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(model="offline")), nodes=nodes)
    asyncio.run(task.score(trace))
    return trace.reward


def replies(traj, codec) -> list[str]:
    out, ids = [], []
    for i, m in zip(traj.token_ids, traj.action_mask):
        if m:
            ids.append(i)
        elif ids:
            out.append(codec.action_text(ids))
            ids = []
    return out + ([codec.action_text(ids)] if ids else [])


def test_single_turn_rewards_are_the_packages_own(tiny):
    model, codec = tiny
    environment = make_environment("verifiers", {"environment": "sao_vf_letters"}, seed=0)
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=8, seed=0))
    trajs, tasks = rollouts(environment, engine, codec, 6)
    assert [t.status for t in trajs] == [Status.OK] * 6, [t.status_reason for t in trajs]
    rewards = []
    for traj, task in zip(trajs, tasks):
        (reply,) = replies(traj, codec)
        assert traj.metrics["agent/calls"] == 1 and traj.metrics["agent/reply_chars"] == len(reply)
        data = environment.tasks[task.id].data
        own = score(environment, task.id, [{"role": "system", "content": data.system_prompt},
                                           {"role": "user", "content": data.prompt},
                                           {"role": "assistant", "content": reply}])
        assert traj.reward == pytest.approx(own)
        rewards.append(traj.reward)
    assert len(set(rewards)) > 1  # graded: the check is not all zeros
    # the trajectory is sao's tokens: every action token is a sampled one, with its log-prob
    sampled = [tok for _, g in engine.gens for tok in g.token_ids]
    assert sorted(sampled) == sorted(i for t in trajs for i, m in zip(t.token_ids, t.action_mask) if m)


def test_multi_turn_environment_loop_runs_through_the_endpoint(tiny):
    model, codec = tiny
    environment = make_environment("verifiers", {"environment": "sao_vf_guess"}, seed=0)
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=8, seed=0))
    trajs, tasks = rollouts(environment, engine, codec, 4)
    for traj, task in zip(trajs, tasks):
        assert traj.status == Status.OK, traj.status_reason
        said = replies(traj, codec)
        assert traj.metrics["agent/calls"] == len(said) == traj.metrics["agent/guesses"] >= 1
        data = environment.tasks[task.id].data
        messages = [{"role": "user", "content": data.prompt}]
        for k, reply in enumerate(said):  # the environment's hints, as its loop wrote them
            messages.append({"role": "assistant", "content": reply})
            if k + 1 < len(said):
                guess = [int(c) for c in reply if c.isdigit()]
                hint = "higher" if not guess or guess[-1] < data.secret else "lower"
                messages.append({"role": "user", "content": f"No, go {hint}. Guess again: one digit."})
        assert traj.reward == pytest.approx(score(environment, task.id, messages))


def test_bad_verifiers_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from sao import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty_env.py").write_text("import verifiers.v1 as vf\n\nclass Empty(vf.Taskset):\n"
                                           "    def load(self):\n        return []\n\n__all__ = ['Empty']\n")
    (tmp_path / "no_taskset.py").write_text("def load_environment():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for options, expect in [
        (["env.options.environment=no_such_env_module"],
         "env.options.environment: cannot load verifiers environment 'no_such_env_module': ModuleNotFoundError"),
        (["env.options.environment=no_taskset"], "cannot load verifiers environment 'no_taskset': AttributeError"),
        (["env.options.environment=empty_env"], "env.options.environment: verifiers taskset 'empty_env' has no tasks"),
        (["env.options.environment=sao_vf_letters", "env.options.args={nope: 1}"],
         "cannot load verifiers environment 'sao_vf_letters': ValidationError"),
    ]:
        assert cli.main(["train", "env.name=verifiers", *options]) == 2, options
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], lines
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("environment", ["sao_vf_guess", "sao_vf_legacy:load_environment"])
def test_sao_train_on_a_verifiers_environment(tiny_model_dir, tmp_path, environment):
    if ":" in environment:
        pytest.importorskip("verifiers.legacy", reason="verifiers' older API is in verifiers < 0.4 only")
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(REPO)])}
    args = ["env.name=verifiers", f"env.options.environment={environment}", f"model.path={tiny_model_dir}",
            "train.steps=3", "train.batch_size=4", "critic.warmup_steps=1", "rollout.concurrency=4",
            "rollout.max_turns=3", "rollout.max_action_tokens=8", "eval.num_tasks=4", "eval.every=0",
            "output.trajectories_every=1", "output.root=runs", "output.name=vf"]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "vf"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward/mean" in r] == [1, 2, 3]
    rows = [json.loads(line) for f in sorted((run_dir / "trajectories").glob("step_*.jsonl"))
            for line in f.read_text().splitlines()]
    assert rows and all(r["status"] == "ok" and r["metrics"]["agent/calls"] >= 1 for r in rows)
    gate = [r["parity/max_abs_diff"] for r in metrics if "parity/max_abs_diff" in r]
    assert gate and max(gate) <= 1e-4, gate


# -- verifiers' older API: module:load_environment -------------------------------------------------------


def legacy_score(environment, task_id: str, replies: list[str]) -> float:
    """The legacy rubric's own score of the same replies (with the environment's hints between them)."""
    from openai import AsyncOpenAI

    legacy = pytest.importorskip("verifiers.legacy.utils.message_utils")
    row, env = dict(environment.tasks[task_id]), environment.env
    completion = []
    for k, reply in enumerate(replies):
        completion.append({"role": "assistant", "content": reply})
        if k + 1 < len(replies):
            guess = [int(c) for c in reply if c.isdigit()]
            hint = "higher" if not guess or guess[-1] < int(row["answer"]) else "lower"
            completion.append({"role": "user", "content": f"No, go {hint}. One digit."})

    async def go():
        client = environment.vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url="http://unused.invalid/v1", api_key="x"))
        state = await env.init_state(row, client, "unused")
        state["completion"] = legacy.normalize_messages(completion, field_name="completion")
        state["trajectory"] = [None] * len(replies)
        await env.rubric.score_rollout(state)
        return state["reward"]

    return asyncio.run(go())


def test_a_legacy_environment_runs_its_own_loop_and_rubric(tiny):
    pytest.importorskip("verifiers.legacy", reason="verifiers' older API is in verifiers < 0.4 only")
    model, codec = tiny
    environment = make_environment("verifiers", {"environment": "sao_vf_legacy:load_environment"}, seed=0)
    assert (len(environment.train), len(environment.heldout)) == (32, 8)  # its dataset and its eval_dataset
    assert environment.heldout[0].prompt.startswith("Round 0: I picked a digit")
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=8, seed=0))
    trajs, tasks = rollouts(environment, engine, codec, 4)
    for traj, task in zip(trajs, tasks):
        assert traj.status == Status.OK, traj.status_reason
        said = replies(traj, codec)
        assert traj.metrics["agent/calls"] == len(said) == traj.metrics["agent/guesses"] >= 1
        assert traj.reward == pytest.approx(legacy_score(environment, task.id, said))


def test_bad_legacy_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    pytest.importorskip("verifiers.legacy", reason="verifiers' older API is in verifiers < 0.4 only")
    from sao import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "legacy_bad.py").write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n\n"
        "def no_data(**kw):\n    return vf.SingleTurnEnv(rubric=vf.Rubric(funcs=[]))\n\n"
        "def eval_only(**kw):\n"
        "    return vf.SingleTurnEnv(eval_dataset=Dataset.from_list([{'question': 'q', 'answer': 'a'}]))\n\n"
        "def not_an_env(**kw):\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for options, expect in [
        (["env.options.environment=no_such_module:load_environment"],
         "env.options.environment: cannot import module 'no_such_module'"),
        (["env.options.environment=legacy_bad:nope"], "env.options.environment: module 'legacy_bad' has no function 'nope'"),
        (["env.options.environment=legacy_bad:no_data"],
         "legacy_bad:no_data failed: ValueError: Either dataset or eval_dataset must be provided"),
        (["env.options.environment=legacy_bad:eval_only"], "legacy_bad:eval_only has no dataset (only an eval_dataset)"),
        (["env.options.environment=legacy_bad:not_an_env"], "legacy_bad:not_an_env returned int, not a verifiers Environment"),
    ]:
        assert cli.main(["train", "env.name=verifiers", *options]) == 2, options
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], lines
    assert not (tmp_path / "runs").exists()
