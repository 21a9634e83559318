"""Agents whose chat template re-renders their history (a thinking model's) and one sample per call:
`env.options.on_rewrite=segment|refuse`, `env.options.sample_unit=episode|turn`. A segmented episode keeps
every sampled token exactly; the trainer makes each segment a row and carries the return across them."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai", reason="the agent extra is not installed (pip install 'sao[agent]')")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402,F401  loaded here: agents in two threads importing it at once can see it half-initialized

from sao.algo.gae import (  # noqa: E402
    episode_totals,
    length_adaptive_lambda,
    skip_observation_gae,
    skip_observation_gae_reference,
    step_level_gae,
)
from sao.engine.torch_engine import TorchEngine  # noqa: E402
from sao.envs import make_environment  # noqa: E402
from sao.envs.base import EpisodeContext  # noqa: E402
from sao.rollout.agent_loop import EpisodeLimits, run_episode  # noqa: E402
from sao.trainer.batch import collate  # noqa: E402
from sao.types import SamplingParams, Status, Trajectory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# the Qwen3-style template and the model folder it is given to: the example's (examples/agent/thinking_agent.py)
from examples.agent.thinking_agent import THINKING_TEMPLATE, with_thinking_template  # noqa: E402


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory):
    from sao.models.tiny import build_tiny_model
    from sao.models.tokenizer import load_tokenizer

    model_dir = with_thinking_template(build_tiny_model(tmp_path_factory.mktemp("thinking"), hidden_size=32,
                                                        num_layers=2, num_heads=2, intermediate_size=64,
                                                        max_positions=256, seed=0))
    assert load_tokenizer(model_dir).chat_template == THINKING_TEMPLATE
    return model_dir


@pytest.fixture()
def thinking(thinking_model_dir):
    from sao.models.chat import ChatCodec
    from sao.models.tiny import load_model
    from sao.models.tokenizer import load_tokenizer

    torch.manual_seed(0)
    return load_model(thinking_model_dir), ChatCodec(load_tokenizer(thinking_model_dir))


@pytest.fixture()
def tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"add {i} and {i + 1}", "answer": str(2 * i + 1)}) + "\n"
                            for i in range(40)))
    return path


class Recording:
    """The real engine; every generate's prompt and result are kept."""

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


def three_calls(task, base_url, api_key):
    """A thinking agent's loop: each reply goes back as an assistant message, then a new user message."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": "think, then answer"}, {"role": "user", "content": task["prompt"]}]
    for follow_up in ["again", "once more", None]:
        reply = client.chat.completions.create(model="sao", messages=messages, max_tokens=6)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return 0.5


def refused_second_call(task, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    reply = client.chat.completions.create(model="sao", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}, {"role": "user", "content": "go"}]
    try:
        client.chat.completions.create(model="sao", messages=messages, max_tokens=4)
        raise AssertionError("a re-rendered history was served with on_rewrite=refuse")
    except openai.ConflictError as exc:
        assert "renders the earlier turns differently" in str(exc) and "on_rewrite=segment" in str(exc)
    return 0.0


def restarting_completions(task, base_url, api_key):
    """A completions agent that drops its history once (its second prompt does not extend the first)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = task["prompt"] + client.completions.create(model="sao", prompt=task["prompt"], max_tokens=4).choices[0].text
    second = "summary: " + first[-3:]
    second += client.completions.create(model="sao", prompt=second, max_tokens=4).choices[0].text
    client.completions.create(model="sao", prompt=second + " ok", max_tokens=4)
    return 1.0


def run(tasks, agent, engine, codec, **options):
    environment = make_environment("agent", {"path": str(tasks), "agent": f"test_agent_segments:{agent}", **options},
                                   seed=0)
    task = next(environment.train_tasks())
    limits = EpisodeLimits(max_turns=4, max_action_tokens=8, max_episode_tokens=250, step_timeout_s=5)

    async def go():
        traj = await run_episode(environment.new_episode(EpisodeContext()), task, engine, codec, SamplingParams(), limits)
        await engine.engine.close()
        return traj

    return asyncio.run(go()), task


def check_segments_are_the_samples(traj, gens):
    """Each call's prompt starts a segment (or extends one) and its sampled tokens, log-probs and versions are
    in the trajectory exactly; prompts are never trained on."""
    segs = traj.segments()
    assert len(segs) == len(gens)
    for (a, b), (prompt, gen) in zip(segs, gens):
        assert traj.token_ids[a:b] == prompt + gen.token_ids
        assert traj.action_mask[a:b] == [0] * len(prompt) + [1] * len(gen.token_ids)
        assert traj.behavior_logprobs[a + len(prompt):b] == gen.logprobs
        assert traj.token_versions[a + len(prompt):b] == gen.versions
        assert all(v == -1 for v in traj.token_versions[a:a + len(prompt)])


@pytest.mark.parametrize("unit", ["episode", "turn"])
def test_a_thinking_template_episode_continues_as_segments(thinking, tasks, unit):
    model, codec = thinking
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0, version=3))
    traj, task = run(tasks, "three_calls", engine, codec, sample_unit=unit)
    assert traj.status == Status.OK, traj.status_reason
    assert (traj.turns, traj.metrics["agent/calls"], traj.metrics["agent/segments"]) == (3, 3, 3)
    assert traj.metrics["agent/rewrites"] == (2 if unit == "episode" else 0)  # turn: every call is a sample anyway
    check_segments_are_the_samples(traj, engine.gens)
    (p1, g1), (p2, g2), (p3, g3) = engine.gens
    sent = [{"role": "system", "content": "think, then answer"}, {"role": "user", "content": task.prompt},
            {"role": "assistant", "content": codec.action_text(g1.token_ids)}, {"role": "user", "content": "again"}]
    assert p1 == codec.prompt_ids(sent[:2]) and p2 == codec.prompt_ids(sent)  # the history as re-rendered
    assert codec.decode(p2).count("<think>") == 1  # the template dropped the first turn's opening
    assert traj.prompt_len == len(p1)
    rows = collate([traj], codec.tokenizer.pad_token_id)
    assert rows.size == 3 and rows.episodes.tolist() == [0, 0, 0] and rows.scalar_rewards.tolist() == [0.5] * 3
    assert rows.rewards.sum(1).tolist() == [0.0, 0.0, 0.5]  # the outcome on the episode's last action token


def test_refuse_mode_still_answers_409(thinking, tasks):
    model, codec = thinking
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0))
    traj, _ = run(tasks, "refused_second_call", engine, codec, on_rewrite="refuse")
    assert traj.status == Status.OK, traj.status_reason
    assert (traj.metrics["agent/rewrites"], traj.metrics["agent/segments"], len(engine.gens)) == (1, 1, 1)
    assert traj.token_ids == engine.gens[0][0] + engine.gens[0][1].token_ids


def test_a_completions_prompt_that_drops_its_history_is_a_segment(thinking, tasks):
    model, codec = thinking
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0))
    traj, task = run(tasks, "restarting_completions", engine, codec)
    assert traj.status == Status.OK, traj.status_reason
    assert (traj.metrics["agent/segments"], traj.metrics["agent/rewrites"]) == (2, 1)
    (p1, g1), (p2, g2), (p3, g3) = engine.gens
    assert p2 == codec.encode("summary: " + (task.prompt + codec.action_text(g1.token_ids))[-3:])
    assert p3 == p2 + g2.token_ids + codec.encode(" ok")  # the third call extends the new segment
    segs = traj.segments()
    assert [traj.token_ids[a:b] for a, b in segs] == [p1 + g1.token_ids, p3 + g3.token_ids]


# -- the trainer's side: GAE across segments, baselines over episodes ------------------------------------


def test_gae_carries_the_return_across_segments_as_computed_by_hand():
    """One episode in two segments (rows 0, 1) and one in one (row 2). Actions of the first: V = .5 .6 | .7 .8,
    reward 1 at the end, gamma .9, lambda .5: the last action of segment 1 links to the first of segment 2."""
    T = 5
    mask = torch.zeros(3, T)
    values = torch.zeros(3, T)
    rewards = torch.zeros(3, T)
    mask[0, 1:3], values[0, 1:3] = 1, torch.tensor([0.5, 0.6])  # segment 1: prompt token, 2 actions
    mask[1, 2:4], values[1, 2:4] = 1, torch.tensor([0.7, 0.8])  # segment 2: 2 prompt tokens, 2 actions
    rewards[1, 3] = 1.0
    mask[2, 0:2], values[2, 0:2], rewards[2, 1] = 1, torch.tensor([0.3, 0.4]), 1.0
    adv, ret = skip_observation_gae(rewards, values, mask, 0.9, 0.5, torch.tensor([0, 0, 1]))
    # by hand: deltas .9*.6-.5=.04, .9*.7-.6=.03, .9*.8-.7=.02, 1-.8=.2; A_i = delta_i + .45 A_{i+1}
    a3 = 0.2
    a2 = 0.02 + 0.45 * a3
    a1 = 0.03 + 0.45 * a2
    a0 = 0.04 + 0.45 * a1
    assert adv[0, 1:3].tolist() == pytest.approx([a0, a1]) and adv[1, 2:4].tolist() == pytest.approx([a2, a3])
    assert ret[0, 1:3].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6])
    b1 = 1 - 0.4
    assert adv[2, :2].tolist() == pytest.approx([0.9 * 0.4 - 0.3 + 0.45 * b1, b1])  # the other episode alone
    assert (adv * (1 - mask)).abs().sum() == 0
    # the same as the reference recurrence over the episode's tokens in one row
    # (segment 2's prompt becomes an observation between the two turns)
    joined_r, joined_v, joined_m = (torch.cat([x[0, :3], x[1, 1:4]])[None] for x in (rewards, values, mask))
    acts = [1, 2, 4, 5]
    ref, _ = skip_observation_gae_reference(joined_r, joined_v, joined_m, 0.9, 0.5)
    assert ref[0, acts].tolist() == pytest.approx([a0, a1, a2, a3])
    # lambda per episode from all its action tokens; rows of one episode share it
    lam = length_adaptive_lambda(episode_totals(mask.sum(1), torch.tensor([0, 0, 1])), 1.5)
    assert lam.tolist() == pytest.approx([1 - 1 / 6, 1 - 1 / 6, 1 - 1 / 3])
    # step-level GAE (one advantage per turn) runs across the segments the same way
    step_seg, lam_seg = step_level_gae(rewards[:2], values[:2], mask[:2], 0.9, 1.5, "state", torch.tensor([0, 0]))
    step_one, lam_one = step_level_gae(joined_r, joined_v, joined_m, 0.9, 1.5, "state")
    assert torch.cat([step_seg[0, 1:3], step_seg[1, 2:4]]).tolist() == pytest.approx(step_one[0, acts].tolist())
    assert lam_seg.tolist() == [float(lam_one[0])] * 2


def _traj(tid, task, segments, reward):
    """A trajectory from [(prompt ids, action ids)] segments."""
    t = Trajectory(id=tid, task_id=task, token_ids=[], action_mask=[], behavior_logprobs=[], token_versions=[],
                   prompt_len=len(segments[0][0]), reward=reward)
    for k, (prompt, action) in enumerate(segments):
        if k:
            t.segment_starts.append(len(t.token_ids))
        t.token_ids += prompt + action
        t.action_mask += [0] * len(prompt) + [1] * len(action)
        t.behavior_logprobs += [0.0] * len(prompt) + [-1.0] * len(action)
        t.token_versions += [-1] * len(prompt) + [0] * len(action)
    return t


def test_baselines_count_episodes_not_segments(tiny):
    """GRPO's groups and the running mean see one reward per episode: a segmented episode is not counted
    twice, and every row of it gets its episode's advantage."""
    from sao.algo.registry import get_algorithm
    from sao.config import AlgoConfig, CriticConfig, TrainConfig
    from sao.trainer.learner import Learner

    model, codec = tiny
    batch = collate([_traj("a", "g1", [([5, 6], [7, 8]), ([9, 9, 9], [10])], 1.0),
                     _traj("b", "g1", [([5, 6], [11])], 0.0)], codec.tokenizer.pad_token_id)
    assert batch.size == 3 and batch.heads.tolist() == [True, False, True] and batch.prompt_keys[0] == batch.prompt_keys[1]
    learner = Learner(model, None, get_algorithm("grpo"), AlgoConfig(name="grpo", group_size=2), CriticConfig(),
                      TrainConfig())
    adv = learner._baseline_advantages(batch)
    per_row = [float(adv[i][batch.action_mask[i] > 0][0]) for i in range(3)]
    assert per_row[0] == per_row[1] > 0 > per_row[2]  # one group of two episodes; rows 0-1 are one of them
    metrics = learner.step(batch)
    assert metrics["reward/mean"] == 0.5  # over episodes


# -- end to end --------------------------------------------------------------------------------------------


TRAIN_AGENT = textwrap.dedent('''
    import json, os, openai

    def agent(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": task["prompt"]}]
        got = []
        for _ in range(3):
            reply = client.chat.completions.create(model="sao", messages=messages)
            got.append(reply.choices[0].message.content or "")
            messages += [{"role": "assistant", "content": got[-1]}, {"role": "user", "content": "more a"}]
        with open(os.path.join(os.environ["SEEN_DIR"], task["id"] + ".json"), "a") as f:
            f.write(json.dumps(got) + "\\n")
        text = "".join(got)
        return text.count("a") / max(len(text), 1)
''')


def train_thinking_agent(tmp_path, tasks, model_dir, extra) -> list[dict]:
    """`sao train` on a three-call agent with a thinking template; every trained segment decodes to what the
    agent read, and the trainer's log-probs of every segment equal the engine's (the parity gates)."""
    from sao.models.chat import ChatCodec
    from sao.models.tokenizer import load_tokenizer

    (tmp_path / "train_agent.py").write_text(TRAIN_AGENT)
    (tmp_path / "seen").mkdir()
    env = {**os.environ, "SEEN_DIR": str(tmp_path / "seen"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    args = ["env.name=agent", f"env.options.path={tasks}", "env.options.agent=train_agent:agent",
            f"model.path={model_dir}", "train.steps=3", "train.batch_size=4", "critic.warmup_steps=1",
            "rollout.concurrency=4", "rollout.max_turns=3", "rollout.max_action_tokens=8", "runtime.max_lag=1",
            "eval.num_tasks=4", "eval.every=0", "output.trajectories_every=1", "output.root=runs", "output.name=agent",
            "runtime.mode=sync", *extra]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codec = ChatCodec(load_tokenizer(model_dir))
    run_dir = tmp_path / "runs" / "agent"
    rows = [json.loads(line) for f in sorted((run_dir / "trajectories").glob("*.jsonl"))
            for line in f.read_text().splitlines()]
    assert len(rows) >= 12
    for row in rows:
        t = Trajectory.from_json(json.dumps(row))
        assert len(t.segments()) == 3 and row["metrics"]["agent/segments"] == 3, row["segment_starts"]
        acts = [codec.action_text([i for i, m in zip(t.token_ids[a:b], t.action_mask[a:b]) if m]) for a, b in t.segments()]
        seen = [json.loads(line) for line in (tmp_path / "seen" / f"{row['task_id']}.json").read_text().splitlines()]
        assert acts in seen  # the trained tokens decode to exactly what a run of the agent on this task read
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward/mean" in r] == [1, 2, 3]
    gates = [r[k] for r in metrics for k in ("parity/max_abs_diff", "parity/live_max_abs_diff") if k in r]
    assert gates and max(gates) <= 1e-4, gates  # the trainer's log-probs of every segment equal the engine's
    return metrics


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["episode", "turn"])
def test_sao_train_on_a_thinking_agent(thinking_model_dir, tasks, tmp_path, unit):
    train_thinking_agent(tmp_path, tasks, thinking_model_dir, [f"env.options.sample_unit={unit}"])


VLLM_PYTHON = os.environ.get("SAO_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason=f"vLLM environment absent ({VLLM_PYTHON}); "
                    "build it with `bash scripts/install.sh vllm`")
@pytest.mark.parametrize("unit", ["episode", "turn"])
def test_sao_train_on_a_thinking_agent_with_vllm(tmp_path_factory, tasks, tmp_path, unit):
    from sao.models.tiny import build_tiny_model

    # head_dim 32: one that vLLM's CPU attention accepts (sao/runtime/preflight.py VLLM_CPU_HEAD_DIMS)
    model_dir = with_thinking_template(build_tiny_model(tmp_path_factory.mktemp("thinking64"), hidden_size=64,
                                                        num_layers=1, num_heads=2, intermediate_size=64,
                                                        max_positions=256, seed=0))
    train_thinking_agent(tmp_path, tasks, model_dir, [f"env.options.sample_unit={unit}", "engine.name=vllm",
                                                      f"engine.python={VLLM_PYTHON}",
                                                      'engine.server_args=["--enforce-eager"]'])


@pytest.mark.slow
def test_the_thinking_agent_example_runs_offline_in_segments(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "agent" / "thinking_agent.py"), "--out",
                           str(tmp_path / "ex"), "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 trained episodes, segments per episode: 3.0-3.0" in proc.stdout, proc.stdout
