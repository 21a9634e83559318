"""Overhead of the two integrations, apart from the model: the agent endpoint per call, and OpenEnv per step.

    PYTHONPATH=.:examples/openenv_letters:examples/verifiers_envs python benchmarks/integrations.py [--episodes 20]

1. env.name=agent: a sync `openai` client agent makes `calls` chat calls per episode (a growing history,
   one new user message per call) against the rollout worker's endpoint. The engine is an instant one
   (a fixed 8-token reply, no model), so each call's wall time at the agent is all overhead: the
   openai client, HTTP on 127.0.0.1, the server, matching the messages and rendering the new ones.
   `server` is the part spent inside the endpoint (the trajectory's agent/overhead_ms_per_call); the
   same calls as plain httpx POSTs show the openai client's own share.
   The same with env.options.sample_unit=turn (every call a new segment: the whole history rendered and
   tokenized each call).
2. env.name=verifiers on examples/verifiers_envs/sao_vf_guess (three calls per episode through verifiers'
   own loop, interception server and sao's harness): an episode's wall time, beside the same three calls
   made by a plain agent function.
3. env.name=harbor on examples/harbor_tasks/count-lines: one shell command in the sandbox on the task's
   workspace (`wc -l < data.txt`), and the task's verifier (bash /tests/test.sh, reward.json read back).
4. env.name=openenv on examples/openenv_letters: one step's wall time as the agent loop sees it
   (text -> Action -> step -> Observation -> text), in process and over the server's WebSocket
   session, beside the bare `env.step` of the same Environment.

Writes JSON (default benchmarks/results/integrations.json) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "openenv_letters"), str(ROOT / "examples" / "verifiers_envs")]

import openai  # noqa: E402

from sao.envs import make_environment  # noqa: E402
from sao.envs.base import EpisodeContext  # noqa: E402
from sao.models.chat import ChatCodec  # noqa: E402
from sao.models.tiny import build_tiny_model  # noqa: E402
from sao.models.tokenizer import load_tokenizer  # noqa: E402
from sao.rollout.agent_loop import EpisodeLimits, run_episode  # noqa: E402
from sao.types import Generation, SamplingParams  # noqa: E402

CALL_TIMES: list[float] = []


class InstantEngine:
    """No model: a fixed reply at once, so what is timed is everything around the engine."""

    def __init__(self, codec):
        self.ids, self.version = codec.action_ids("ok done"), 0

    async def generate(self, prompt_ids, params, session=None):
        return Generation(list(self.ids), [-1.0] * len(self.ids), [0] * len(self.ids), "stop")

    def release(self, session):
        pass


def chatty_agent(task, base_url, api_key, calls=8):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    for i in range(calls):
        t = time.perf_counter()
        reply = client.chat.completions.create(model="sao", messages=messages, max_tokens=8)
        CALL_TIMES.append(time.perf_counter() - t)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"observation {i}: " + "x" * 40}]
    client.close()
    return 1.0


def raw_agent(task, base_url, api_key, calls=8):
    """The same calls as plain httpx POSTs: the openai client's own share is the difference."""
    import httpx

    messages = [{"role": "user", "content": task["prompt"]}]
    with httpx.Client(headers={"Authorization": f"Bearer {api_key}"}) as client:
        for i in range(calls):
            t = time.perf_counter()
            reply = client.post(f"{base_url}/chat/completions", json={"model": "sao", "messages": messages,
                                                                       "max_tokens": 8}).json()
            CALL_TIMES.append(time.perf_counter() - t)
            messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"observation {i}: " + "x" * 40}]
    return 1.0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(seconds: list[float]) -> dict:
    ms = [1000 * s for s in seconds]
    return {"n": len(ms), "mean_ms": statistics.mean(ms), "p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95)}


def three_calls(task, base_url, api_key):
    return chatty_agent(task, base_url, api_key, calls=3)


def bench_agent(codec, episodes: int, tmp: Path, agent: str, **options) -> dict:
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"task {i}", "answer": "0"}) + "\n" for i in range(50)))
    sys.modules["bench_integrations"] = sys.modules[__name__]
    environment = make_environment("agent", {"path": str(tasks), "agent": f"bench_integrations:{agent}", **options},
                                   seed=0)
    limits = EpisodeLimits(max_turns=64, max_action_tokens=16, max_episode_tokens=100_000)
    stream = environment.train_tasks()

    async def go():
        out = []
        for _ in range(episodes):
            out.append(await run_episode(environment.new_episode(EpisodeContext()), next(stream), InstantEngine(codec),
                                         codec, SamplingParams(), limits))
        return out

    CALL_TIMES.clear()
    trajs = asyncio.run(go())
    assert all(t.status.value == "ok" for t in trajs), [t.status_reason for t in trajs]
    warm = CALL_TIMES[8:]  # the first episode's calls include starting the server
    return {"client_wall": summary(warm),
            "server_ms_mean": statistics.mean(t.metrics["agent/overhead_ms_per_call"] for t in trajs[1:]),
            "calls_per_episode": 8, "episodes": episodes}


def bench_episodes(codec, environment, episodes: int) -> list[float]:
    """Wall time of each episode after the first (which starts the endpoint), one at a time."""
    limits = EpisodeLimits(max_turns=64, max_action_tokens=16, max_episode_tokens=100_000)
    stream = environment.train_tasks()

    async def go():
        times = []
        for _ in range(episodes + 1):
            t = time.perf_counter()
            traj = await run_episode(environment.new_episode(EpisodeContext()), next(stream), InstantEngine(codec), codec,
                                     SamplingParams(), limits)
            times.append(time.perf_counter() - t)
            assert traj.status.value == "ok" and traj.metrics["agent/calls"] == 3, traj.status_reason
        return times[1:]

    return asyncio.run(go())


def bench_verifiers(codec, episodes: int, tmp: Path) -> dict:
    os.environ["HOME"] = str(tmp)  # verifiers keeps a cache under $HOME
    verifiers = make_environment("verifiers", {"environment": "sao_vf_guess"}, seed=0)
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"task {i}", "answer": "0"}) + "\n" for i in range(50)))
    sys.modules["bench_integrations"] = sys.modules[__name__]
    plain = make_environment("agent", {"path": str(tasks), "agent": "bench_integrations:three_calls"}, seed=0)
    return {"verifiers_episode": summary(bench_episodes(codec, verifiers, episodes)),
            "plain_agent_episode": summary(bench_episodes(codec, plain, episodes)), "calls_per_episode": 3}


def bench_harbor(episodes: int) -> dict:
    from sao.sandbox.shell import run_shell

    environment = make_environment("harbor", {"path": str(ROOT / "examples" / "harbor_tasks")}, seed=0)
    task = environment.tasks["example/count-lines"]

    async def go():
        command, verifier = [], []
        for _ in range(episodes + 1):
            t = time.perf_counter()
            result = await run_shell("wc -l < data.txt", workspace=task.workspace)
            command.append(time.perf_counter() - t)
            assert result.exit_code == 0 and result.output.strip() == "4", result
            t = time.perf_counter()
            await environment.verify(task, result.workspace)
            verifier.append(time.perf_counter() - t)
        return command[1:], verifier[1:]  # the first run probes the sandbox mechanism

    command, verifier = asyncio.run(go())
    return {"command": summary(command), "verifier": summary(verifier)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_openenv(codec, episodes: int) -> dict:
    from letters_env.models import LetterAction
    from letters_env.server.letters_environment import LettersEnvironment

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "examples" / "openenv_letters"), str(ROOT)])}
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "letters_env.server.app:app", "--port", str(port),
                               "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        rounds = 8
        results = {}
        bare = LettersEnvironment(rounds=rounds)
        times = []
        for e in range(episodes):
            bare.reset(seed=e)
            for _ in range(rounds):
                t = time.perf_counter()
                bare.step(LetterAction(text="aaaa bbb"))
                times.append(time.perf_counter() - t)
        results["bare env.step"] = summary(times)
        common = {"action_field": "text", "action_tag": "", "env_kwargs": {"rounds": rounds}}
        for name, opts in [("in process", {"env_class": "letters_env.server.letters_environment:LettersEnvironment",
                                           **common}),
                           ("server (WebSocket)", {"url": url, "action_field": "text", "action_tag": ""})]:
            environment = make_environment("openenv", opts, seed=0)
            results[name] = summary(asyncio.run(step_times(environment, episodes, rounds if "env_class" in opts else 2)))
        return results
    finally:
        server.terminate()
        server.wait(10)


async def step_times(environment, episodes: int, rounds: int) -> list[float]:
    """Each step's wall time through the episode's own methods, as the agent loop calls them."""
    from sao.rollout.env_calls import call_env as _call

    times, stream = [], environment.train_tasks()
    for _ in range(episodes):
        ep = environment.new_episode(EpisodeContext())
        await _call(ep.reset, next(stream), timeout=30)
        for _ in range(rounds):
            t = time.perf_counter()
            result = await _call(ep.step, "aaaa bbb", timeout=30)
            times.append(time.perf_counter() - t)
            if result.done:
                break
        await _call(ep.close, timeout=30)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "integrations.json"))
    ap.add_argument("--only-agent", action="store_true", help=(
        "the agent endpoint's per-call figures only (a copy of this file in an older checkout measures its endpoint)"))
    args = ap.parse_args()
    if args.only_agent:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_tiny_model(Path(tmp) / "m", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
            codec = ChatCodec(load_tokenizer(model_dir))
            agent = bench_agent(codec, args.episodes, Path(tmp), "chatty_agent")
        a = agent["client_wall"]
        print(f"agent call at the openai client: mean {a['mean_ms']:.2f} ms, p50 {a['p50_ms']:.2f} ms, "
              f"p95 {a['p95_ms']:.2f} ms; inside the endpoint {agent['server_ms_mean']:.2f} ms")
        Path(args.out).write_text(json.dumps({"agent_endpoint_per_call": agent}, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
        codec = ChatCodec(load_tokenizer(model_dir))
        agent = bench_agent(codec, args.episodes, Path(tmp), "chatty_agent")
        raw = bench_agent(codec, args.episodes, Path(tmp), "raw_agent")
        turn = bench_agent(codec, args.episodes, Path(tmp), "chatty_agent", sample_unit="turn")
        verifiers = bench_verifiers(codec, args.episodes, Path(tmp))
    harbor = bench_harbor(args.episodes)
    openenv = bench_openenv(codec, args.episodes)
    out = {"agent_endpoint_per_call": agent, "agent_endpoint_per_call_raw_httpx": raw,
           "agent_endpoint_per_call_sample_unit_turn": turn, "verifiers_per_episode": verifiers,
           "harbor_sandboxed": harbor,
           "openenv_per_step": openenv,
           "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "openai": openai.__version__},
           "command": "PYTHONPATH=.:examples/openenv_letters:examples/verifiers_envs python benchmarks/integrations.py"}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{'what':42s} {'n':>5s} {'mean ms':>8s} {'p50 ms':>8s} {'p95 ms':>8s}")
    a = agent["client_wall"]
    print(f"{'agent call, at the openai client':42s} {a['n']:5d} {a['mean_ms']:8.2f} {a['p50_ms']:8.2f} {a['p95_ms']:8.2f}")
    r = raw["client_wall"]
    print(f"{'agent call, plain httpx POST':42s} {r['n']:5d} {r['mean_ms']:8.2f} {r['p50_ms']:8.2f} {r['p95_ms']:8.2f}")
    print(f"{'agent call, inside the endpoint':42s} {'':5s} {agent['server_ms_mean']:8.2f}")
    t = turn["client_wall"]
    print(f"{'agent call, sample_unit=turn':42s} {t['n']:5d} {t['mean_ms']:8.2f} {t['p50_ms']:8.2f} {t['p95_ms']:8.2f}")
    print(f"{'agent call, sample_unit=turn, in endpoint':42s} {'':5s} {turn['server_ms_mean']:8.2f}")
    for name in ("verifiers_episode", "plain_agent_episode"):
        v = verifiers[name]
        label = name.replace("_", " ") + " (3 calls)"
        print(f"{label:42s} {v['n']:5d} {v['mean_ms']:8.2f} {v['p50_ms']:8.2f} {v['p95_ms']:8.2f}")
    for name, h in harbor.items():
        label = "harbor " + name + ", sandboxed run"
        print(f"{label:42s} {h['n']:5d} {h['mean_ms']:8.2f} {h['p50_ms']:8.2f} {h['p95_ms']:8.2f}")
    for name, s in openenv.items():
        print(f"{'openenv step, ' + name:42s} {s['n']:5d} {s['mean_ms']:8.3f} {s['p50_ms']:8.3f} {s['p95_ms']:8.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
