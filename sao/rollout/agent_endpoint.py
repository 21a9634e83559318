"""The OpenAI-compatible endpoint of a rollout worker, and one `env.name=agent` episode run through it.

One HTTP server per rollout worker (its event loop), on 127.0.0.1 and a free port, started with the
first agent episode. Each episode gets its own API key; its calls build one `Trajectory`:

    first call     prompt = chat template of the messages (+ tools)          action_mask 0
    each call      sampled tokens (engine.generate, session = the episode)   action_mask 1, logprobs, versions
    later calls    messages[:n] must equal the n messages and replies so far (compared as messages, not
                   text); only messages[n:] are rendered: the template text after the last reply's
                   end-of-turn, tokenized alone                              action_mask 0
                   anything else is a rewritten history: HTTP 409, counted in agent/rewrites, nothing appended

Earlier tokens are never re-tokenized, so the trainer sees exactly what the engine sampled
(docs/algorithm.md §2). Tool calls: `tools` are passed to the chat template; a reply's
`<tool_call>{json}</tool_call>` blocks come back as OpenAI `tool_calls` (options.tool_parser).
Sampling is the rollout's (temperature 1 etc.), whatever the request asks, so behavior log-probs
stay exact; `max_tokens` is capped by rollout.max_action_tokens. `/v1/completions` works the same
on raw text (or token-id) prompts that extend the episode's text so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shlex
import socket
import time
import uuid
from dataclasses import replace

from sao.engine.base import EngineError
from sao.envs.agent import AgentEpisode
from sao.models.chat import ChatCodec
from sao.types import SamplingParams, Status, Task, Trajectory

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class Refused(Exception):
    """A call the episode cannot serve; answered with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def parse_tool_calls(text: str, n_before: int) -> tuple[str | None, list[dict]]:
    """Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks -> OpenAI tool_calls;
    a block that is not such JSON stays in the content."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        calls.append({"id": f"call_{n_before + len(calls)}", "type": "function",
                      "function": {"name": str(name), "arguments": args if isinstance(args, str) else json.dumps(args)}})
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    return (content or None), calls


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def same_message(m: dict) -> tuple:
    """What must stay equal when an agent sends a message back (ids and null fields aside)."""
    calls = tuple((c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
                  for c in m.get("tool_calls") or ())
    return m.get("role"), _text(m.get("content")), calls, m.get("tool_call_id") or ""


class AgentSession:
    """One episode's tokens and messages; every call is matched against them."""

    def __init__(self, traj: Trajectory, engine, codec: ChatCodec, params: SamplingParams, limits, options) -> None:
        self.traj, self.engine, self.codec, self.limits, self.options = traj, engine, codec, limits, options
        self.params = replace(params, stop_token_ids=(codec.eos_id,))
        self.messages: list[tuple] = []  # same_message() of every message so far, replies included
        self.text = ""  # /v1/completions: the episode's text so far
        self.mode: str | None = None
        self.calls = self.rewrites = self.tool_calls = 0
        self.busy = self.closed = False
        self.truncated = ""  # why a call was refused for a limit
        self.engine_error = ""
        self.overhead_s = 0.0  # time in calls outside engine.generate

    def _append(self, ids, logprobs=None, versions=None) -> None:
        t = self.traj
        t.token_ids += ids
        t.action_mask += [1 if logprobs is not None else 0] * len(ids)
        t.behavior_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        t.token_versions += versions if versions is not None else [-1] * len(ids)

    def _render(self, messages: list[dict], tools, generation: bool) -> str:
        extra = {"tools": tools} if tools else {}
        try:
            return self.codec.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                                            **extra)
        except Exception as exc:  # jinja's TemplateError, a template's raise_exception(...), a bad message shape
            raise Refused(400, f"the chat template cannot render these messages: {exc}"[:500], "invalid_request") from None

    def _rewritten(self, why: str) -> Refused:
        self.rewrites += 1
        return Refused(409, f"history rewritten: {why}; an episode's calls must extend its earlier messages and replies "
                       "exactly (a new episode is a new base_url/api_key)", "history_rewritten")

    def _enter(self, mode: str) -> None:
        if self.closed:
            raise Refused(410, "this episode has ended", "episode_ended")
        if self.busy:
            raise Refused(409, "one call at a time per episode (its tokens are one sequence)", "concurrent_call")
        if self.mode not in (None, mode):
            raise Refused(400, f"this episode uses the {self.mode} API; do not mix it with {mode}", "mixed_api")
        if self.calls >= self.limits.max_turns:
            self.truncated = "turn limit"
            raise Refused(400, f"turn limit: rollout.max_turns={self.limits.max_turns} calls per episode", "turn_limit")

    def chat_prompt(self, messages: list[dict], tools) -> list[int]:
        """The tokens of the messages this call adds (the whole prompt on the first call); nothing is
        appended before the call is accepted."""
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise Refused(400, "messages: a non-empty list of {role, content} objects", "invalid_request")
        n = len(self.messages)
        if n == 0:
            return self.codec.encode(self._render(messages, tools, True))
        if len(messages) <= n or [same_message(m) for m in messages[:n]] != self.messages:
            raise self._rewritten("the first messages differ from the episode's so far")
        before = self._render(messages[:n], tools, False)
        after = self._render(messages, tools, True)
        end = before.rfind(self.codec.eos_text)
        cut = end + len(self.codec.eos_text)
        if end < 0 or after[:cut] != before[:cut]:
            raise self._rewritten("the chat template renders the earlier turns differently (tools changed?)")
        close = [] if self.traj.token_ids[-1] == self.codec.eos_id else [self.codec.eos_id]  # a reply cut at
        return close + self.codec.encode(after[cut:])  # max_tokens: its turn is closed by an unsampled eos

    def text_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            have = self.traj.token_ids
            if prompt[: len(have)] != have or (have and len(prompt) <= len(have)):
                raise self._rewritten("the prompt's token ids do not extend the episode's")
            return prompt[len(have):]
        if isinstance(prompt, str):
            if not prompt.startswith(self.text) or (self.text and len(prompt) == len(self.text)):
                raise self._rewritten("the prompt does not extend the episode's text")
            return self.codec.encode(prompt[len(self.text):])
        raise Refused(400, "prompt: one string or one list of token ids", "invalid_request")

    async def generate(self, new_ids: list[int], max_tokens: int | None):
        """Append the call's new prompt tokens and sample; a call over the episode's budget appends nothing."""
        t = self.traj
        budget = min(max_tokens or self.limits.max_action_tokens, self.limits.max_action_tokens,
                     self.limits.max_episode_tokens - len(t.token_ids) - len(new_ids))
        if budget <= 0:
            self.truncated = "token limit"
            raise Refused(400, f"token limit: rollout.max_episode_tokens={self.limits.max_episode_tokens}", "token_limit")
        self._append(new_ids)
        if not t.prompt_len:
            t.prompt_len = len(t.token_ids)
        started = time.perf_counter()
        try:
            gen = await self.engine.generate(t.token_ids, replace(self.params, max_new_tokens=budget), session=t.id)
        except EngineError as exc:
            self.engine_error = str(exc)[:500]
            raise Refused(500, f"engine error: {exc}"[:500], "engine_error") from None
        finally:
            self.overhead_s -= time.perf_counter() - started
        self._append(gen.token_ids, gen.logprobs, gen.versions)
        self.calls += 1
        t.turns = self.calls  # a reply cut at max_tokens is the agent's to handle (finish_reason=length)
        return gen

    async def chat(self, body: dict) -> dict:
        self._enter("chat")
        self.busy = True
        try:
            messages, tools = body.get("messages") or [], body.get("tools") or None
            new_ids = self.chat_prompt(messages, tools)
            gen = await self.generate(new_ids, body.get("max_completion_tokens") or body.get("max_tokens"))
            self.mode, self.messages = "chat", [same_message(m) for m in messages]
            text = self.codec.action_text(gen.token_ids)
            content, calls = (text, []) if self.options.tool_parser == "none" else parse_tool_calls(text, self.tool_calls)
            self.tool_calls += len(calls)
            reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            self.messages.append(same_message(reply))
            finish = "tool_calls" if calls else ("stop" if gen.finish_reason == "stop" else "length")
            return _completion(self.traj.id, self.calls, body, "chat.completion",
                               {"index": 0, "message": reply, "finish_reason": finish, "logprobs": None},
                               len(self.traj.token_ids) - len(gen.token_ids), len(gen.token_ids))
        finally:
            self.busy = False

    async def complete(self, body: dict) -> dict:
        self._enter("completion")
        self.busy = True
        try:
            prompt = body.get("prompt")
            gen = await self.generate(self.text_prompt(prompt), body.get("max_tokens") or 16)
            text = self.codec.action_text(gen.token_ids)
            self.mode = "completion"
            self.text = (prompt if isinstance(prompt, str) else self.text) + text
            finish = "stop" if gen.finish_reason == "stop" else "length"
            return _completion(self.traj.id, self.calls, body, "text_completion",
                               {"index": 0, "text": text, "finish_reason": finish, "logprobs": None},
                               len(self.traj.token_ids) - len(gen.token_ids), len(gen.token_ids))
        finally:
            self.busy = False


def _completion(traj_id: str, n: int, body: dict, kind: str, choice: dict, prompt: int, completion: int) -> dict:
    return {"id": f"{traj_id}-{n}", "object": kind, "created": int(time.time()), "model": body.get("model") or "sao",
            "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                           "total_tokens": prompt + completion}}


# -- the HTTP server ---------------------------------------------------------------------------------


class Endpoint:
    """The worker's server: routes each call to its episode by API key."""

    def __init__(self) -> None:
        self.sessions: dict[str, AgentSession] = {}
        self.base_url = ""

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def handler(method: str):
            async def handle(request):
                started = time.perf_counter()
                key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
                session = self.sessions.get(key)
                if session is None:
                    return JSONResponse(_error("unknown API key (each episode has its own)", "invalid_api_key"), 401)
                try:
                    body = await request.json()
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                    if body.get("stream"):
                        raise Refused(400, "stream=true is not supported", "invalid_request")
                    if (body.get("n") or 1) != 1:
                        raise Refused(400, "n must be 1 (an episode is one token sequence)", "invalid_request")
                    reply = await getattr(session, method)(body)
                except Refused as exc:
                    return JSONResponse(_error(str(exc), exc.code), exc.status)
                except ValueError as exc:
                    return JSONResponse(_error(f"invalid request: {exc}", "invalid_request"), 400)
                finally:
                    session.overhead_s += time.perf_counter() - started
                return JSONResponse(reply)

            return handle

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "sao", "object": "model", "owned_by": "sao"}]})

        return Starlette(routes=[Route("/v1/chat/completions", handler("chat"), methods=["POST"]),
                                 Route("/v1/completions", handler("complete"), methods=["POST"]),
                                 Route("/v1/models", models)])

    async def start(self, host: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the rollout worker owns its process's signals
                yield

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets: without it
        # a keep-alive reply waits ~40 ms for a delayed ACK (measured: 44 ms -> 0.5 ms per call, benchmarks/integrations.py)
        sock.bind((host, 0))
        server = Server(uvicorn.Config(self.app(), lifespan="off", log_level="warning", access_log=False))
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self.base_url = f"http://{host}:{sock.getsockname()[1]}/v1"


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


_endpoints: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}


async def endpoint(host: str) -> Endpoint:
    """This event loop's endpoint, started on first use."""
    loop = asyncio.get_running_loop()
    for old in [lp for lp in _endpoints if lp.is_closed()]:  # asyncio.run per batch (sync mode): one server per loop
        del _endpoints[old]
    if loop not in _endpoints:
        ep = Endpoint()
        _endpoints[loop] = loop.create_task(ep.start(host))
        _endpoints[loop].endpoint = ep
    fut = _endpoints[loop]
    await asyncio.shield(fut)
    return fut.endpoint


# -- one episode ------------------------------------------------------------------------------------


class AgentFailed(RuntimeError):
    pass


async def run_command(argv: list[str], env: dict, timeout: float):
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise AgentFailed(f"agent command exited with {proc.returncode}: {err.decode(errors='replace')[-300:]}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        return lines[-1]


def reward_of(result, task_row: dict, reward_fn) -> tuple[float, dict[str, float]]:
    if reward_fn is not None:
        return float(reward_fn(task_row, result)), {}
    if isinstance(result, dict) and isinstance(result.get("reward"), (int, float)):
        extra = {f"agent/{k}": float(v) for k, v in result.items() if k != "reward" and isinstance(v, (int, float))}
        return float(result["reward"]), extra
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return float(result), {}
    raise AgentFailed(f"the agent returned {str(result)[:100]!r}, not a reward; return a number or "
                      "{'reward': x}, or set env.options.reward")


async def run_agent_episode(env: AgentEpisode, task: Task, engine, codec: ChatCodec, params: SamplingParams,
                            limits, traj_id: str | None = None) -> Trajectory:
    from sao.rollout.agent_loop import _call

    traj = Trajectory(id=traj_id or uuid.uuid4().hex[:12], task_id=task.id, token_ids=[], action_mask=[],
                      behavior_logprobs=[], token_versions=[], prompt_len=0, started_at=time.time())
    o = env.options
    session = AgentSession(traj, engine, codec, params, limits, o)
    key = "sao-" + secrets.token_hex(16)
    row = {"id": task.id, "prompt": task.prompt, "answer": task.answer, "meta": task.meta}
    ep = None
    try:
        ep = await endpoint(o.host)
        ep.sessions[key] = session
        if env.agent is not None:
            result = await _call(env.agent, row, ep.base_url, key, timeout=o.timeout_s)
        else:
            extra = {"OPENAI_BASE_URL": ep.base_url, "OPENAI_API_KEY": key, "SAO_TASK": json.dumps(row, default=str)}
            result = await run_command(shlex.split(o.command), {**os.environ, **extra}, o.timeout_s)
        traj.reward, metrics = reward_of(result, row, env.reward_fn)
        traj.metrics.update(metrics)
        traj.status, traj.status_reason = (Status.TRUNCATED, session.truncated) if session.truncated else (Status.OK, "")
    except asyncio.TimeoutError:
        traj.status, traj.status_reason = Status.TIMEOUT, f"agent ran over {o.timeout_s}s"
    except asyncio.CancelledError:
        traj.status, traj.status_reason = Status.ABORTED, "cancelled"
        raise
    except Exception as exc:  # the agent's own bug ends this episode only
        traj.status, traj.status_reason = Status.ENV_ERROR, f"{type(exc).__name__}: {exc}"[:500]
        if session.truncated:  # it failed on a call refused for a rollout limit: a truncated episode, reward 0
            traj.reward, traj.status, traj.status_reason = 0.0, Status.TRUNCATED, session.truncated
    finally:
        session.closed = True
        if ep is not None:
            ep.sessions.pop(key, None)
        engine.release(traj.id)
    if session.engine_error:
        traj.status, traj.status_reason = Status.ENGINE_ERROR, session.engine_error
    elif session.calls == 0 and traj.status in (Status.OK, Status.TRUNCATED):
        traj.status, traj.status_reason = Status.ENV_ERROR, "the agent made no model call"
    traj.metrics.update({"agent/calls": float(session.calls), "agent/rewrites": float(session.rewrites),
                         "agent/tool_calls": float(session.tool_calls),
                         "agent/overhead_ms_per_call": 1000 * session.overhead_s / max(session.calls, 1)})
    traj.finished_at = time.time()
    return traj
