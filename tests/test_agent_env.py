"""`env.name=agent`: agents that call the rollout worker's OpenAI-compatible endpoint with the real `openai`
client; the trajectory holds exactly the engine's sampled tokens, masks, log-probs and versions."""

import asyncio
import collections
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the agent extra is not installed (pip install 'sao[agent]')")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402,F401  loaded here: agents in two threads importing it at once can see it half-initialized

from sao.engine.torch_engine import TorchEngine  # noqa: E402
from sao.envs import make_environment  # noqa: E402
from sao.envs.base import EpisodeContext  # noqa: E402
from sao.rollout.agent_loop import EpisodeLimits, run_episode  # noqa: E402
from sao.rollout.agent_session import parse_tool_calls  # noqa: E402
from sao.types import Generation, SamplingParams, Status  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEEN: dict[str, list] = {}  # what each agent got back, by task id


class Recording:
    """The real engine; every generate's result is kept so the test can compare it with the trajectory."""

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


class Scripted:
    """Replays fixed replies (for the tool-call format, which a random tiny model never writes)."""

    def __init__(self, codec, replies):
        self.codec, self.replies, self.version, self.gens = codec, list(replies), 5, []

    async def generate(self, prompt_ids, params, session=None):
        ids = self.codec.action_ids(self.replies.pop(0))
        gen = Generation(ids, [-0.1] * len(ids), [self.version] * len(ids), "stop")
        self.gens.append((list(prompt_ids), gen))
        return gen

    def release(self, session):
        pass


# -- agents (plain functions of task, base_url, api_key, as a user writes them) -------------------------


def three_calls(task, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": task["prompt"]}]
    got = []
    for follow_up in ["again", "once more", None]:
        kw = {"tools": [TOOL]} if follow_up is None else {}
        reply = client.chat.completions.create(model="sao", messages=messages, max_tokens=6, **kw)
        got.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    SEEN[task["id"]] = got
    return {"reward": 0.5, "replies": len(got)}


TOOL = {"type": "function", "function": {"name": "add", "description": "a + b",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                         "b": {"type": "integer"}}}}}


def tool_agent(task, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    first = client.chat.completions.create(model="sao", messages=messages, tools=[TOOL])
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "add"
    args = json.loads(msg.tool_calls[0].function.arguments)
    messages += [msg.model_dump(exclude_none=True),  # the reply as the openai client returns it
                 {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": str(args["a"] + args["b"])}]
    final = client.chat.completions.create(model="sao", messages=messages, tools=[TOOL])
    return 1.0 if final.choices[0].message.content == "5" else 0.0


def rewriting_agent(task, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    reply = client.chat.completions.create(model="sao", messages=messages, max_tokens=4)
    edited = messages + [{"role": "assistant", "content": "something I would rather have said"},
                         {"role": "user", "content": "go on"}]
    try:
        client.chat.completions.create(model="sao", messages=edited, max_tokens=4)
        raise AssertionError("a rewritten history was served")
    except openai.ConflictError as exc:
        assert "history rewritten" in str(exc)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "go on"}]
    client.chat.completions.create(model="sao", messages=messages, max_tokens=4)
    return 0.0


def bad_requests_agent(task, base_url, api_key):
    """Requests the endpoint must refuse (HTTP 4xx, nothing recorded), then one good call."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    good = [{"role": "user", "content": task["prompt"]}]
    for kwargs, error in [({"messages": ["not a message"]}, openai.BadRequestError),
                          ({"messages": good, "n": 2}, openai.BadRequestError),
                          ({"messages": good, "stream": True}, openai.BadRequestError)]:
        try:
            client.chat.completions.create(model="sao", **kwargs)
            raise AssertionError(f"served {kwargs}")
        except error:
            pass
    try:
        openai.OpenAI(base_url=base_url, api_key="sao-wrong", max_retries=0).chat.completions.create(
            model="sao", messages=good)
        raise AssertionError("served a wrong key")
    except openai.AuthenticationError:
        pass
    assert [m.id for m in client.models.list()] == ["sao"]
    client.chat.completions.create(model="sao", messages=good, max_tokens=3)
    return 1.0


def completions_agent(task, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = task["prompt"]
    for _ in range(2):
        prompt += client.completions.create(model="sao", prompt=prompt, max_tokens=5).choices[0].text + " | "
    return 0.25


def failing_agent(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="sao", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raise RuntimeError("the agent's own bug")


def slow_agent(task, base_url, api_key):
    time.sleep(2)
    return 1.0


async def async_agent(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model="sao", messages=[{"role": "user", "content": task["prompt"]}],
                                                 max_tokens=3)
    await client.close()
    return {"reward": 1.0 if reply.choices[0].message.content is not None else 0.0}


def nan_reward_agent(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="sao", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return {"reward": float("nan"), "extra": float("inf")}


def hostile_requests_agent(task, base_url, api_key):
    """Requests that must be refused with 4xx before they reach the engine (or blow the worker's memory),
    then one good call."""
    head = {"Authorization": f"Bearer {api_key}"}
    good = [{"role": "user", "content": task["prompt"]}]
    with httpx.Client(base_url=base_url, headers=head, timeout=30) as http:
        for bad in (float("nan"), -1, "5", True, 1.5):
            body = json.dumps({"model": "sao", "messages": good, "max_tokens": bad})  # NaN: json's own extension
            r = http.post("/chat/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "max_tokens" in r.text, (bad, r.status_code, r.text)
        r = http.post("/completions", json={"model": "sao", "prompt": [1, 2, 10**9], "max_tokens": 2})
        assert r.status_code == 400 and "token ids" in r.text, r.text
        r = http.post("/completions", json={"model": "sao", "prompt": [1, -5], "max_tokens": 2})
        assert r.status_code == 400, r.text
        deep = "[" * 100_000 + "]" * 100_000
        r = http.post("/chat/completions", content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        r = http.post("/chat/completions", json={"model": "sao", "messages": [{"role": "user", "content": {"x": 1}}]})
        assert r.status_code == 400, r.text  # a wrong type: refused, not a 500 and not served
        r = http.post("/chat/completions", content=b"{" + b" " * (9 << 20) + b"}",
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.status_code
        for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "x " * (3 << 20)}]}),
                           ("/completions", {"prompt": "x " * (3 << 20)})):  # 6 MB: under the body limit
            t0 = time.perf_counter()
            r = http.post(path, json={"model": "sao", "max_tokens": 2, **body})
            # refused before the tokenizer reads it (tokenized, it blocked the worker's event loop for seconds)
            assert r.status_code == 400 and "token limit" in r.text and time.perf_counter() - t0 < 2, r.text
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).completions.create(
        model="sao", prompt=[5, 6, 7], max_tokens=3)
    return 1.0


# -- helpers ---------------------------------------------------------------------------------------------


@pytest.fixture()
def tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"add {i} and {i + 1}", "answer": str(2 * i + 1)}) + "\n"
                            for i in range(40)))
    return path


def run(tasks, agent, engine, codec, action_tokens: int = 8, **options):
    environment = make_environment("agent", {"path": str(tasks), "agent": f"test_agent_env:{agent}", **options}, seed=0)
    task = next(environment.train_tasks())
    limits = EpisodeLimits(max_turns=4, max_action_tokens=action_tokens, max_episode_tokens=250, step_timeout_s=5)

    async def go():
        traj = await run_episode(environment.new_episode(EpisodeContext()), task, engine, codec, SamplingParams(), limits)
        close = getattr(engine, "engine", engine)
        if hasattr(close, "close"):
            await close.close()
        return traj

    return asyncio.run(go()), task


def segments(traj):
    """[(mask, ids)] runs of the trajectory after its prompt."""
    out, start, ids, mask = [], traj.prompt_len, traj.token_ids, traj.action_mask
    for i in range(start, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            out.append((mask[start], ids[start:i]))
            start = i
    return out


def test_trajectory_is_exactly_the_sampled_tokens(tiny, tasks):
    model, codec = tiny
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0, version=2))
    traj, task = run(tasks, "three_calls", engine, codec)
    assert traj.status == Status.OK, traj.status_reason
    assert (traj.reward, traj.turns, traj.metrics["agent/calls"], traj.metrics["agent/replies"]) == (0.5, 3, 3, 3)
    (p1, g1), (p2, g2), (p3, g3) = engine.gens
    system_user = [{"role": "system", "content": "be brief"}, {"role": "user", "content": task.prompt}]
    assert p1 == codec.prompt_ids(system_user) and traj.prompt_len == len(p1)
    # each later prompt is the earlier prompt + the sampled tokens + only the new message's tokens
    # (a reply cut at max_tokens has its turn closed by an unsampled end-of-turn token, action_mask 0)
    def closed(g):
        return g.token_ids + ([] if g.finish_reason == "stop" else [codec.eos_id])

    assert p2 == p1 + closed(g1) + codec.observation_ids("again", "user")
    assert p3 == p2 + closed(g2) + codec.observation_ids("once more", "user")
    assert traj.token_ids == p3 + g3.token_ids
    assert [(m, ids) for m, ids in segments(traj) if m] == [(1, g.token_ids) for g in (g1, g2, g3)]
    acted = [i for i, m in enumerate(traj.action_mask) if m]
    assert [traj.behavior_logprobs[i] for i in acted] == g1.logprobs + g2.logprobs + g3.logprobs
    assert [traj.token_versions[i] for i in acted] == [2] * len(acted)
    assert all(traj.behavior_logprobs[i] == 0 and traj.token_versions[i] == -1
               for i, m in enumerate(traj.action_mask) if not m)
    assert SEEN[task.id] == [codec.action_text(g.token_ids) for g in (g1, g2, g3)]  # what the agent read


def test_tool_calls_round_trip_through_the_openai_client(tiny, tasks):
    _, codec = tiny
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = Scripted(codec, [call, "5"])
    traj, task = run(tasks, "tool_agent", engine, codec, action_tokens=96)  # scripted replies: no budget
    assert (traj.status, traj.reward, traj.metrics["agent/tool_calls"]) == (Status.OK, 1.0, 1), traj.status_reason
    p1 = codec.prompt_ids([{"role": "user", "content": task.prompt}])
    assert traj.token_ids == p1 + codec.action_ids(call) + codec.observation_ids("5", "tool") + codec.action_ids("5")
    assert [m for m, _ in segments(traj)] == [1, 0, 1]
    assert parse_tool_calls("x <tool_call>not json</tool_call>", 0) == ("x <tool_call>not json</tool_call>", [])


def test_rewritten_history_is_refused_and_counted(tiny, tasks):
    model, codec = tiny
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0))
    traj, _ = run(tasks, "rewriting_agent", engine, codec, on_rewrite="refuse")
    assert traj.status == Status.OK, traj.status_reason
    assert (traj.metrics["agent/rewrites"], traj.metrics["agent/calls"]) == (1, 2)
    (p1, g1), (p2, g2) = engine.gens
    assert traj.token_ids == p2 + g2.token_ids and p2[: len(p1) + len(g1.token_ids)] == p1 + g1.token_ids
    assert len(engine.gens) == 2  # the refused call generated nothing and appended nothing


def test_bad_requests_are_refused_and_record_nothing(tiny, tasks):
    model, codec = tiny
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0))
    traj, _ = run(tasks, "bad_requests_agent", engine, codec)
    assert (traj.status, traj.turns, len(engine.gens)) == (Status.OK, 1, 1), traj.status_reason
    assert traj.token_ids == engine.gens[0][0] + engine.gens[0][1].token_ids


def test_completions_and_async_agents(tiny, tasks):
    model, codec = tiny
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0))
    traj, task = run(tasks, "completions_agent", engine, codec)
    assert (traj.status, traj.reward) == (Status.OK, 0.25), traj.status_reason
    (p1, g1), (p2, g2) = engine.gens
    assert p1 == codec.encode(task.prompt) and p2 == p1 + g1.token_ids + codec.encode(" | ")
    assert traj.token_ids == p2 + g2.token_ids
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0))
    traj, _ = run(tasks, "async_agent", engine, codec)
    assert (traj.status, traj.reward, traj.turns) == (Status.OK, 1.0, 1), traj.status_reason


def test_agent_failures_end_only_the_episode(tiny, tasks, tmp_path):
    model, codec = tiny
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)
    traj, _ = run(tasks, "failing_agent", engine, codec)
    assert traj.status == Status.ENV_ERROR and "the agent's own bug" in traj.status_reason
    t0 = time.monotonic()
    traj, _ = run(tasks, "slow_agent", engine, codec, timeout_s=0.3)
    assert traj.status == Status.TIMEOUT and time.monotonic() - t0 < 1.5
    script = tmp_path / "bad_agent.py"
    script.write_text("import sys; print('no luck', file=sys.stderr); sys.exit(3)")
    environment = make_environment("agent", {"path": str(tasks), "command": f"{sys.executable} {script}"}, seed=0)
    traj = asyncio.run(run_episode(environment.new_episode(EpisodeContext()), next(environment.train_tasks()), engine,
                                   codec, SamplingParams(), EpisodeLimits()))
    assert traj.status == Status.ENV_ERROR and "exited with 3" in traj.status_reason and "no luck" in traj.status_reason


def test_command_agent_uses_the_openai_environment_variables(tiny, tasks):
    model, codec = tiny
    engine = Recording(TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0))
    script = REPO / "examples" / "agent" / "openai_agent.py"
    environment = make_environment("agent", {"path": str(tasks), "command": f"{sys.executable} {script}"}, seed=0)
    limits = EpisodeLimits(max_turns=4, max_action_tokens=8, max_episode_tokens=250)
    traj = asyncio.run(run_episode(environment.new_episode(EpisodeContext()), next(environment.train_tasks()), engine,
                                   codec, SamplingParams(), limits))
    assert traj.status in (Status.OK, Status.TRUNCATED), traj.status_reason
    assert traj.metrics["agent/calls"] == len(engine.gens) >= 2
    assert traj.token_ids == engine.gens[-1][0] + engine.gens[-1][1].token_ids


def test_bad_agent_input_is_one_line_exit_2(tmp_path, tasks, monkeypatch, capsys):
    """The real `sao train` entry point, in process (a subprocess per case costs ~10 s of imports)."""
    from sao import cli

    monkeypatch.chdir(tmp_path)
    for bad, expect in [
        (["env.options.agent=no_such_module:run"], "env.options.agent: cannot import module 'no_such_module'"),
        (["env.options.agent=test_agent_env:nope"], "env.options.agent: module 'test_agent_env' has no function 'nope'"),
        (["env.options.command=no-such-agent-binary --x"], "env.options.command: 'no-such-agent-binary' is not an executable"),
        (["env.options.agent=test_agent_env:three_calls", "env.options.command=python"], "give exactly one of agent"),
        ([f"env.options.command={sys.executable} -c 'import sys; sys.exit(\"no API key configured\")'"],
         "env.options.command: exited by itself with 1 before calling the model: no API key configured"),
        ([f"env.options.command={sys.executable} -c 'import time; time.sleep(30)'", "env.options.start_timeout_s=1"],
         "env.options.command: made no model call within 1s, so sao stopped it (raise env.options.start_timeout_s"),
    ]:
        assert cli.main(["train", "env.name=agent", f"env.options.path={tasks}", *bad]) == 2, bad
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], lines
    assert not (tmp_path / "runs").exists()
    # the example agent calls the model at once: it passes the start check (stopped at its first call)
    command = f"{sys.executable} {REPO / 'examples' / 'agent' / 'openai_agent.py'}"
    make_environment("agent", {"path": str(tasks), "command": command}, seed=0).check_start()


@pytest.mark.slow
def test_an_agent_that_prepares_for_over_a_minute_passes_the_start_check(tasks, tmp_path):
    """A command that prepares 62 s (a clone, a container) before its first call: the start check waits for
    it (env.options.start_timeout_s, 600 s by default); it used to be killed at 60 s and reported as
    "exited with -9" as if the agent had died."""
    agent = tmp_path / "slow_agent.py"
    agent.write_text("import time, openai\ntime.sleep(62)\n"
                     "openai.OpenAI(max_retries=0).chat.completions.create(model='sao', messages=[])\n")
    t0 = time.time()
    make_environment("agent", {"path": str(tasks), "command": f"{sys.executable} {agent}"}, seed=0).check_start()
    assert time.time() - t0 > 62


TRAIN_AGENT = textwrap.dedent('''
    import json, os, openai

    def agent(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": task["prompt"]}]
        got = []
        for _ in range(2):
            reply = client.chat.completions.create(model="sao", messages=messages)
            got.append(reply.choices[0].message.content or "")
            messages += [{"role": "assistant", "content": got[-1]}, {"role": "user", "content": "more a"}]
        with open(os.path.join(os.environ["SEEN_DIR"], task["id"] + ".json"), "a") as f:
            f.write(json.dumps(got) + "\\n")
        text = "".join(got)
        return text.count("a") / max(len(text), 1)
''')


def train_agent(tmp_path, tasks, model_dir, extra) -> list[dict]:
    """A real `sao train` on TRAIN_AGENT; every trained trajectory is checked against what the agent read.
    Returns the run's metrics rows."""
    (tmp_path / "train_agent.py").write_text(TRAIN_AGENT)
    (tmp_path / "seen").mkdir()
    env = {**os.environ, "SEEN_DIR": str(tmp_path / "seen"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    args = ["env.name=agent", f"env.options.path={tasks}", "env.options.agent=train_agent:agent",
            f"model.path={model_dir}", "train.steps=3", "train.batch_size=4", "critic.warmup_steps=1",
            "rollout.concurrency=4", "rollout.max_turns=2", "rollout.max_action_tokens=8", "runtime.max_lag=1",
            "eval.num_tasks=4", "eval.every=0", "output.trajectories_every=1", "output.root=runs", "output.name=agent",
            *extra]
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from sao.models.chat import ChatCodec
    from sao.models.tokenizer import load_tokenizer

    codec = ChatCodec(load_tokenizer(model_dir))
    run_dir = tmp_path / "runs" / "agent"
    rows = [json.loads(line) for f in sorted((run_dir / "trajectories").glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(rows) >= 12
    for row in rows:
        seen = [json.loads(line) for line in (tmp_path / "seen" / f"{row['task_id']}.json").read_text().splitlines()]
        acts = [codec.action_text(ids) for m, ids in segments(_Traj(row)) if m]
        assert acts in seen  # the trained tokens decode to exactly what some run of the agent on this task read
        assert row["metrics"]["agent/calls"] == 2 and all(v in (-1,) or v >= 0 for v in row["token_versions"])
        text = "".join(acts)
        assert row["reward"] == pytest.approx(text.count("a") / max(len(text), 1))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward/mean" in r] == [1, 2, 3]
    gate = [r["parity/max_abs_diff"] for r in metrics if "parity/max_abs_diff" in r]
    assert gate and max(gate) <= 1e-4, gate  # exact tokens: the step-0 parity gate holds
    return metrics


def live_parity(metrics) -> list[float]:
    return [r["parity/live_max_abs_diff"] for r in metrics if "parity/live_max_abs_diff" in r]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sao_train_on_an_openai_agent(tiny_model_dir, tasks, tmp_path, mode):
    metrics = train_agent(tmp_path, tasks, tiny_model_dir, [f"runtime.mode={mode}"])
    if mode == "sync":  # no weight swap can land mid-episode (async torch mixes KV versions by design, docs/engines.md)
        assert live_parity(metrics) and max(live_parity(metrics)) <= 1e-4, live_parity(metrics)


@pytest.mark.slow
def test_an_agent_that_exits_1_after_a_call_stops_the_run_in_one_line(tiny_model_dir, tasks, tmp_path):
    """Every episode's agent calls the model once, then exits 1: the run used to loop for ever (935 failed
    episodes in 10 minutes, step 1 never ending; failed episodes count as arrivals, so
    runtime.receive_timeout_s never fired). Past runtime.max_failed_frac of the last runtime.failure_window
    finished episodes it stops in one line naming the reason, exit code 1, its run directory intact."""
    agent = tmp_path / "failing_agent.py"
    agent.write_text("import sys, openai\n"
                     "openai.OpenAI(max_retries=0).chat.completions.create(model='sao', max_tokens=4, "
                     "messages=[{'role': 'user', 'content': 'hi'}])\n"
                     "sys.exit('giving up')\n")
    args = ["env.name=agent", f"env.options.path={tasks}", f"env.options.command={sys.executable} {agent}",
            f"model.path={tiny_model_dir}", "train.steps=3", "train.batch_size=4", "rollout.concurrency=4",
            "rollout.max_action_tokens=8", "eval.num_tasks=4", "runtime.failure_window=12", "output.root=runs",
            "output.name=failing"]
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", *args, "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert lines[-1] == ("sao: error: 12 of the last 12 episodes failed (most: env_error: AgentFailed: agent command "
                         "exited with 1: giving up); stopping (runtime.max_failed_frac=0.9; audit.jsonl names each "
                         "one's reason)"), proc.stderr[-3000:]
    assert sum("of the last 12 episodes failed" in line for line in lines) == 1  # stopped at once: no warning first
    assert any("sao: warning: 4 of 4 held-out episodes failed at step 0 (env_error: AgentFailed: agent command "
               "exited with 1: giving up x4); eval/accuracy is over the other 0, eval/failed counts them" in line
               for line in lines), lines
    assert "Traceback" not in proc.stderr and time.time() - t0 < 300
    audit = [json.loads(line) for line in (tmp_path / "runs" / "failing" / "audit.jsonl").read_text().splitlines()]
    assert sum(a.get("status") == "env_error" for a in audit) >= 12


VLLM_PYTHON = os.environ.get("SAO_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason=f"vLLM environment absent ({VLLM_PYTHON}); "
                    "build it with `bash scripts/install.sh vllm`")
def test_sao_train_on_an_openai_agent_with_vllm(tmp_path_factory, tasks, tmp_path):
    from sao.models.tiny import build_tiny_model

    # head_dim 32: one that vLLM's CPU attention accepts (sao/runtime/preflight.py VLLM_CPU_HEAD_DIMS)
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny64"), hidden_size=64, num_layers=1, num_heads=2,
                                 intermediate_size=64, max_positions=256, seed=0)
    metrics = train_agent(tmp_path, tasks, model_dir, ["engine.name=vllm", f"engine.python={VLLM_PYTHON}",
                                                       'engine.server_args=["--enforce-eager"]'])
    assert live_parity(metrics) and live_parity(metrics)[0] <= 1e-4  # as sao's own check on vLLM's tokens


class _Traj:
    def __init__(self, row):
        self.token_ids, self.action_mask, self.prompt_len = row["token_ids"], row["action_mask"], row["prompt_len"]


def test_an_agent_reward_that_is_not_finite_is_an_env_error(tiny, tasks):
    model, codec = tiny
    traj, _ = run(tasks, "nan_reward_agent", TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0), codec)
    assert traj.status == Status.ENV_ERROR and "reward nan is not finite" in traj.status_reason, traj.status_reason


def test_hostile_requests_are_refused_and_never_end_another_episode(tiny, tasks):
    """On one worker's engine, an agent sending out-of-vocabulary ids, non-finite or negative max_tokens,
    deep JSON and an oversized body gets 4xx for each; the agent beside it finishes normally."""
    model, codec = tiny
    environment = make_environment("agent", {"path": str(tasks), "agent": "test_agent_env:hostile_requests_agent"},
                                   seed=0)
    calm = make_environment("agent", {"path": str(tasks), "agent": "test_agent_env:three_calls"}, seed=0)
    task, other = list(zip(environment.train_tasks(), range(2)))[0][0], list(zip(calm.train_tasks(), range(2)))[1][0]
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)
    limits = EpisodeLimits(max_turns=4, max_action_tokens=8, max_episode_tokens=250, step_timeout_s=60)

    async def go():
        try:
            return await asyncio.gather(
                run_episode(environment.new_episode(EpisodeContext()), task, engine, codec, SamplingParams(), limits),
                run_episode(calm.new_episode(EpisodeContext()), other, engine, codec, SamplingParams(), limits))
        finally:
            await engine.close()

    hostile, normal = asyncio.run(go())
    assert hostile.status in (Status.OK, Status.TRUNCATED), hostile.status_reason
    assert hostile.metrics["agent/calls"] == 1  # only the good call reached the engine
    assert normal.status == Status.OK and normal.metrics["agent/calls"] == 3, normal.status_reason



HOARDER = textwrap.dedent('''
    import os, socket, sys, time, urllib.parse, urllib.request, json
    url = urllib.parse.urlparse(os.environ["OPENAI_BASE_URL"])
    held = []

    def hold(n):  # connections that never send a request, as many as this process's own limit allows
        for _ in range(n):
            try:
                held.append(socket.create_connection((url.hostname, url.port), timeout=5))
            except OSError:
                return

    hold(int(sys.argv[1]))
    time.sleep(float(sys.argv[2]))
    del held[:20]
    hold(20)  # 20 more, which the endpoint must make room for
    del held[:10]  # descriptors of this process's own for its one call
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/completions", method="POST",
                                 data=json.dumps({"model": "sao", "prompt": [5, 6], "max_tokens": 2}).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
    print(1.0)
''')


def late_three_calls(task, base_url, api_key):
    time.sleep(1.5)  # while the other episode's connections are held
    return three_calls(task, base_url, api_key)


def test_idle_connections_of_one_episode_never_end_another(tiny, tasks, tmp_path):
    """An agent (its own process) holds hundreds of connections that never send a request, on a worker
    whose descriptor limit is 256; the agent beside it, on the same endpoint, makes its 3 calls and
    finishes. Before: the held connections took the worker's descriptors and the other episode ended
    env_error (too many open files)."""
    import resource

    model, codec = tiny
    script = tmp_path / "hoarder.py"
    script.write_text(HOARDER)
    hoarder = make_environment("agent", {"path": str(tasks), "command": f"{sys.executable} {script} 400 4"}, seed=0)
    calm = make_environment("agent", {"path": str(tasks), "agent": "test_agent_env:late_three_calls"}, seed=0)
    task, other = next(hoarder.train_tasks()), list(zip(calm.train_tasks(), range(2)))[1][0]
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)
    limits = EpisodeLimits(max_turns=4, max_action_tokens=8, max_episode_tokens=250, step_timeout_s=60)

    async def go():
        try:
            return await asyncio.gather(
                run_episode(hoarder.new_episode(EpisodeContext()), task, engine, codec, SamplingParams(), limits),
                run_episode(calm.new_episode(EpisodeContext()), other, engine, codec, SamplingParams(), limits))
        finally:
            await engine.close()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        hoarding, normal = asyncio.run(go())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert normal.status == Status.OK and normal.metrics["agent/calls"] == 3, normal.status_reason
    assert hoarding.status in (Status.OK, Status.TRUNCATED), hoarding.status_reason  # its own call still served
    assert hoarding.metrics["agent/calls"] == 1


def connection_bounds_agent(task, base_url, api_key):
    """Holds more kept-alive connections than its episode may (4 here), then one that sends nothing."""
    import socket
    import urllib.parse

    url = urllib.parse.urlparse(base_url)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
               "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}").encode()
    held, codes = [], []
    for _ in range(6):
        s = socket.create_connection((url.hostname, url.port), timeout=10)
        s.sendall(request)
        codes.append(int(s.recv(4096).split(b" ", 2)[1]))  # the connection stays open (kept alive)
        held.append(s)
    assert codes == [400] * 4 + [429] * 2, codes  # bound to this episode up to its limit, then refused
    silent = socket.create_connection((url.hostname, url.port), timeout=10)
    t0 = time.time()
    assert silent.recv(1) == b"" and 0.5 < time.time() - t0 < 5  # closed by the endpoint after first_request_s
    for s in held:
        s.close()
    time.sleep(0.3)  # the endpoint sees them go
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).completions.create(
        model="sao", prompt=[5, 6, 7], max_tokens=3)
    return 1.0


def test_an_episode_holds_at_most_its_connections_and_a_silent_one_is_closed(tiny, tasks):
    model, codec = tiny
    traj, _ = run(tasks, "connection_bounds_agent", TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0),
                  codec, max_connections_per_episode=4, first_request_s=1.0)
    assert traj.status in (Status.OK, Status.TRUNCATED) and traj.metrics["agent/calls"] == 1, traj.status_reason


FUZZ: dict[str, list] = {}


def fuzz_chat_agent(task, base_url, api_key):
    return fuzz_agent(task, base_url, api_key, chat=True)


def fuzz_completions_agent(task, base_url, api_key):
    return fuzz_agent(task, base_url, api_key, chat=False)


def fuzz_agent(task, base_url, api_key, chat: bool):
    """100 seeded mutations of a valid chat (or completions) body: wrong types, odd numbers, deep or huge
    values, unknown fields, broken JSON and UTF-8; each answered, the statuses kept for the test."""
    import random

    rng = random.Random(0)
    odd = [None, True, False, -1, 0, 1.5, 10**30, 1e308, "", "5", "x" * 5000, "\udc80", [], {}, [[[]]], {"a": {"b": []}},
           [1] * 3000, -(2**63), "NaN"]
    valid = ({"model": "sao", "messages": [{"role": "user", "content": task["prompt"]}], "max_tokens": 3} if chat
             else {"model": "sao", "prompt": [5, 6, 7], "max_tokens": 3})
    path = "/chat/completions" if chat else "/completions"
    head = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    codes = FUZZ.setdefault(task["id"], [])
    with httpx.Client(base_url=base_url, headers=head, timeout=30) as http:
        for _ in range(100):
            body = json.loads(json.dumps(valid))  # valid: it extends the episode so far (chat)
            kind = rng.randrange(6)
            if kind == 0:  # a field's value replaced
                body[rng.choice(list(body))] = rng.choice(odd)
            elif kind == 1 and chat:  # inside the newest message
                body["messages"][-1][rng.choice(["role", "content", "name", "tool_calls"])] = rng.choice(odd)
            elif kind == 2:  # a field removed, an unknown one added
                body.pop(rng.choice(list(body)), None)
                body[rng.choice(["n", "stream", "tools", "temperature", "stop", "x"])] = rng.choice(odd)
            elif kind == 3:  # not an object at all
                body = rng.choice(odd)
            raw = json.dumps(body).encode("utf-8", "surrogatepass")
            if kind == 4:  # broken JSON or UTF-8
                raw = rng.choice([raw[: rng.randrange(len(raw))], b"\xff\xfe" + raw, raw + b"}", b"{\"a\": nan}"])
            r = http.post(path, content=raw)
            codes.append(r.status_code)
            if r.status_code == 200 and chat:  # the next valid body extends the conversation as served
                reply = r.json()["choices"][0]["message"]["content"]
                valid["messages"] = body["messages"] + [{"role": "assistant", "content": reply},
                                                        {"role": "user", "content": "go on"}]
    return 1.0


def test_fuzzed_requests_get_a_4xx_and_never_end_another_episode(tiny, tasks):
    """The endpoint's request parser under 100 seeded malformed requests per API: every one answered 2xx
    or 4xx (never 5xx: that would be the shared engine or the server failing), the fuzzing episodes end
    normally, and a normal agent beside them on the same engine makes its 3 calls."""
    model, codec = tiny
    envs = [make_environment("agent", {"path": str(tasks), "agent": f"test_agent_env:{a}"}, seed=0)
            for a in ("fuzz_chat_agent", "fuzz_completions_agent", "late_three_calls")]
    picked = [t for t, _ in zip(envs[0].train_tasks(), range(3))]
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)
    limits = EpisodeLimits(max_turns=40, max_action_tokens=4, max_episode_tokens=4000, step_timeout_s=120)

    async def go():
        try:
            return await asyncio.gather(*(run_episode(e.new_episode(EpisodeContext()), t, engine, codec, SamplingParams(),
                                                      limits) for e, t in zip(envs, picked)))
        finally:
            await engine.close()

    *fuzzing, normal = asyncio.run(go())
    for task, traj in zip(picked, fuzzing):
        codes = FUZZ[task.id]
        print(sorted(collections.Counter(codes).items()))  # shown with pytest -s
        assert len(codes) == 100 and all(c < 500 for c in codes), sorted(set(codes))
        assert 400 in codes and traj.metrics["agent/calls"] >= 1  # refusals, and mutations the engine served
        assert traj.status in (Status.OK, Status.TRUNCATED), traj.status_reason
    assert normal.status == Status.OK and normal.metrics["agent/calls"] == 3, normal.status_reason
