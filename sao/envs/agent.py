"""`agent`: train an agent program that runs its own loop and calls an OpenAI-compatible endpoint.

For each episode sao starts the user's agent with a base URL and an API key of its own; the rollout
worker serves `/v1/chat/completions` and `/v1/completions` there from its engine and records every
sampled token (sao/rollout/agent_session.py). The agent is either

    agent   = "module:func"   called as func(task: dict, base_url: str, api_key: str); plain (run in its
                              own thread, e.g. with the sync `openai` client) or async
    command = "python my_agent.py --flag"   run with OPENAI_BASE_URL, OPENAI_API_KEY and SAO_TASK (the
                              task as JSON) in its environment; its last stdout line is its result

Its return value (or last stdout line, parsed as JSON when it can be) is the result: a number is
the reward, a dict's `reward` key is the reward and its other numbers become trajectory metrics.
With `reward` set, `func(task: dict, result) -> float` judges the result after the episode instead.
Tasks come from a file like `env.name=math`'s (env.options.path; the `sao.envs.dataset` options).

This module holds only options, tasks and the per-episode record; the endpoint and the episode
itself live in `sao.rollout` (environments never import the engine).
"""

from __future__ import annotations

import http.server
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Literal

from pydantic import Field, model_validator

from sao.envs.base import EnvOptions, EpisodeContext, import_path, register_environment
from sao.envs.dataset import DatasetOptions, load_task_split
from sao.types import Task


class EndpointOptions(EnvOptions):
    """The per-episode OpenAI-compatible endpoint's options: every environment whose episodes are driven by
    an agent through it (env.name=agent, verifiers) has them."""

    timeout_s: float = Field(300.0, gt=0, description="an episode whose agent runs longer ends with status timeout")
    tool_parser: Literal["hermes", "none"] = Field("hermes", description=(
        "how tool calls are read from sampled text: hermes = <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> "
        "blocks (Qwen, Hermes, SmolLM2 templates); none: never"))
    on_rewrite: Literal["segment", "refuse"] = Field("segment", description=(
        "a call whose prompt does not extend the episode's tokens (a thinking model's template drops earlier "
        "<think> parts; an agent trims its history): segment = the episode goes on as a new token sequence whose "
        "prompt is the request as rendered (earlier tokens stay as sampled; the trainer carries the return across "
        "segments); refuse = HTTP 409. Counted either way (agent/rewrites)"))
    sample_unit: Literal["episode", "turn"] = Field("episode", description=(
        "episode: the calls extend one sequence where they can; turn: every call is its own segment (its prompt "
        "as rendered, one training sample per call, the episode's reward and GAE carried across them); a batch "
        "counts episodes either way"))
    host: str = Field("127.0.0.1", description="address the worker's endpoint listens on")
    max_connections: int = Field(256, ge=2, description=(
        "open connections to a worker's endpoint, all episodes together (held under a quarter of the process's "
        "descriptor limit); past it, the oldest connection that has sent no request is closed"))
    max_connections_per_episode: int = Field(16, ge=1, description=(
        "connections one episode's agent may hold; a request on one more is answered 429 and the connection closed"))
    first_request_s: float = Field(10.0, gt=0, description=(
        "a connection that sends no request within this many seconds is closed"))


class AgentOptions(DatasetOptions, EndpointOptions):
    agent: str | None = Field(None, description="`module:func` called once per episode as func(task, base_url, api_key)")
    command: str | None = Field(None, description=(
        "a command run once per episode with OPENAI_BASE_URL, OPENAI_API_KEY and SAO_TASK set (shell-style quoting)"))
    reward: str | None = Field(None, description=(
        "`module:func` (task dict, agent result) -> float, run after the episode; default: the result itself"))
    start_timeout_s: float = Field(600.0, gt=0, description=(
        "command agents, before the run: how long the first run of the command (against a stub endpoint) may "
        "prepare (clone a repository, start a container) before its first model call; sao stops it after that "
        "and refuses the run"))

    @model_validator(mode="after")
    def _one_agent(self) -> AgentOptions:
        if (self.agent is None) == (self.command is None):
            raise ValueError("give exactly one of agent (module:func) and command")
        return self


class _StubEndpoint:
    """A server on 127.0.0.1 that answers every request with HTTP 503 and notes that one came."""

    def __enter__(self) -> _StubEndpoint:
        called = self.called = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _refuse(self) -> None:
                called.set()
                body = b'{"error": {"message": "sao preflight: no model here", "code": "preflight"}}'
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _refuse

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class AgentEpisode:
    """What one agent episode needs (options: an EndpointOptions; agent: a function, or None for
    options.command); `sao.rollout.agent_loop.run_episode` drives it by its type, through the endpoint
    (sao/rollout/agent_episode.py; it has no reset/step: the agent owns the loop)."""

    def __init__(self, options: AgentOptions, agent, reward_fn, ctx: EpisodeContext) -> None:
        self.options, self.agent, self.reward_fn, self.ctx = options, agent, reward_fn, ctx


class AgentEnvironment:
    Options = AgentOptions

    def __init__(self, options: AgentOptions, seed: int = 0):
        self.options, self.seed = options, seed
        self.split = load_task_split(options)
        self.agent = import_path(options.agent, "agent", need_callable=True) if options.agent else None
        if options.command:
            argv = shlex.split(options.command)
            if not argv or shutil.which(argv[0]) is None:
                raise ValueError(f"env.options.command: {argv[0] if argv else ''!r} is not an executable on PATH")
        self.reward_fn = import_path(options.reward, "reward", need_callable=True) if options.reward else None

    def check_start(self) -> None:
        """A command agent is run once on the first training task against a stub endpoint that answers
        every call with HTTP 503: exiting non-zero before any call is a broken command (a ValueError, one
        line), refused before the run starts instead of failing every episode. Once it calls, it is stopped;
        one that makes no call within `start_timeout_s` is stopped by sao and refused, saying so (it used to
        be killed after 60 s and reported as "exited with -9", as if the agent had died)."""
        if not self.options.command:
            return
        limit = self.options.start_timeout_s
        task = next(iter(self.split.train))
        with _StubEndpoint() as stub:
            env = {**os.environ, "OPENAI_BASE_URL": stub.base_url, "OPENAI_API_KEY": "sao-preflight",
                   "SAO_TASK": json.dumps({"id": task.id, "prompt": task.prompt, "answer": task.answer,
                                           "meta": task.meta}, default=str)}
            proc = subprocess.Popen(shlex.split(self.options.command), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            t0 = time.monotonic()
            said = False
            while proc.poll() is None and not stub.called.is_set() and time.monotonic() - t0 < limit:
                if not said and time.monotonic() - t0 > 10:
                    said = True
                    print(f"sao: waiting for the agent command's first model call (it has {limit:g}s: "
                          "env.options.start_timeout_s)", file=sys.stderr, flush=True)
                time.sleep(0.02)
            stopped = proc.poll() is None  # sao stops it: it called (the check is done) or ran out of time
            if stopped:
                proc.kill()
            err = proc.communicate()[1]
        if stub.called.is_set():
            return
        last = (err.strip().splitlines() or [""])[-1][:200]
        if stopped:
            raise ValueError(f"env.options.command: made no model call within {limit:g}s, so sao stopped it "
                             f"(raise env.options.start_timeout_s if it prepares longer){': ' + last if last else ''}")
        if proc.returncode:
            raise ValueError(f"env.options.command: exited by itself with {proc.returncode} before calling the "
                             f"model: {last}")

    def train_tasks(self) -> Iterator[Task]:
        return self.split.train_stream(self.seed)

    def eval_tasks(self, n: int) -> list[Task]:
        return self.split.eval_tasks(n)

    def new_episode(self, ctx: EpisodeContext) -> AgentEpisode:
        return AgentEpisode(self.options, self.agent, self.reward_fn, ctx)


register_environment("agent", AgentEnvironment)
