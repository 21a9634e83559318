"""One `env.name=agent` episode's calls, matched against its tokens: `AgentSession`.

The worker's HTTP server (sao/rollout/agent_server.py) routes each call to its episode's session by
API key; the session appends through the episode's `TrajectoryBuilder` (sao/rollout/trajectory.py):

    first call     prompt = chat template of the messages (+ tools)          action_mask 0
    each call      sampled tokens (engine.generate, session = the episode)   action_mask 1, logprobs, versions
    later calls    messages[:n] equal the n messages and replies so far (compared as messages, not
                   text) and the template renders them as before: only messages[n:] are rendered, the
                   template text after the last reply's end-of-turn, tokenized alone   action_mask 0
                   anything else is a rewritten history (a thinking model's template drops the earlier
                   <think> parts; an agent that trims its context), counted in agent/rewrites:
                     options.on_rewrite=segment  a new segment of the episode: its prompt is the whole
                                                 request rendered and tokenized         action_mask 0
                     options.on_rewrite=refuse   HTTP 409, nothing appended
    sample_unit=turn  every call after the first is a new segment (one training sample per call)

Earlier tokens are never re-tokenized, so the trainer sees exactly what the engine sampled; a segment's
prompt is new tokens, never trained on (docs/algorithm.md §2). Tool calls: `tools` are passed to the chat template; a reply's
`<tool_call>{json}</tool_call>` blocks come back as OpenAI `tool_calls` (options.tool_parser).
Sampling is the rollout's (temperature 1 etc.), whatever the request asks, so behavior log-probs
stay exact; `max_tokens` is capped by rollout.max_action_tokens. `/v1/completions` works the same
on raw text (or token-id) prompts that extend the episode's text so far.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

from sao.engine.base import EngineError
from sao.models.chat import ChatCodec
from sao.rollout.trajectory import CHARS_PER_TOKEN_BOUND, TrajectoryBuilder
from sao.types import SamplingParams

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


def _content_ok(content) -> bool:
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content)


def same_message(m: dict) -> tuple:
    """What must stay equal when an agent sends a message back (ids and null fields aside)."""
    calls = tuple((c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
                  for c in m.get("tool_calls") or ())
    return m.get("role"), _text(m.get("content")), calls, m.get("tool_call_id") or ""


class AgentSession:
    """One episode's tokens and messages; every call is matched against them."""

    def __init__(self, build: TrajectoryBuilder, engine, codec: ChatCodec, params: SamplingParams, limits,
                 options) -> None:
        self.build, self.engine, self.codec, self.limits, self.options = build, engine, codec, limits, options
        self.traj = build.traj
        self.params = replace(params, stop_token_ids=(codec.eos_id,))
        self.messages: list[tuple] = []  # same_message() of every message so far, replies included
        self.text = ""  # /v1/completions: the episode's text so far
        self.mode: str | None = None
        self.calls = self.rewrites = self.tool_calls = 0
        self.turn_unit = options.sample_unit == "turn"
        self.busy = self.closed = False
        self.truncated = ""  # why a call was refused for a limit
        self.engine_error = ""
        self.overhead_s = 0.0  # time in calls outside engine.generate

    def _render(self, messages: list[dict], tools, generation: bool) -> str:
        extra = {"tools": tools} if tools else {}
        try:
            return self.codec.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                                            **extra)
        except Exception as exc:  # jinja's TemplateError, a template's raise_exception(...), a bad message shape
            raise Refused(400, f"the chat template cannot render these messages: {exc}"[:500], "invalid_request") from None

    def _encode(self, text: str) -> list[int]:
        """The tokens of untrusted text, refused unread when it is longer than the episode's token budget
        could hold: an 8 MB message would block the worker's event loop for seconds in the tokenizer."""
        if len(text) > self.limits.max_episode_tokens * CHARS_PER_TOKEN_BOUND + 256:
            self.truncated = "token limit"
            raise Refused(400, f"token limit: {len(text)} characters cannot fit in rollout.max_episode_tokens="
                          f"{self.limits.max_episode_tokens}", "token_limit")
        return self.codec.encode(text)

    def _rewritten(self, why: str) -> None:
        """Count a call that does not extend the episode; unless it may start a new segment, refuse it."""
        self.rewrites += 1
        if self.options.on_rewrite == "refuse":
            raise Refused(409, f"history rewritten: {why}; an episode's calls must extend its earlier messages and "
                          "replies exactly (env.options.on_rewrite=segment continues it as a new segment; a new "
                          "episode is a new base_url/api_key)", "history_rewritten")

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

    def chat_prompt(self, messages: list[dict], tools) -> tuple[list[int], bool]:
        """(the tokens this call adds, whether they start a new segment): the new messages' tokens, or the
        whole prompt on the first call and on a new segment; nothing is appended before the call is accepted."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and _content_ok(m.get("content"))
                for m in messages):
            raise Refused(400, "messages: a non-empty list of {role, content} objects (content: a string, null "
                          "or a list of {type, text} parts)", "invalid_request")
        n = len(self.messages)
        whole = self._render(messages, tools, True)
        if n == 0 or self.turn_unit:
            return self._encode(whole), n > 0
        if len(messages) <= n or [same_message(m) for m in messages[:n]] != self.messages:
            self._rewritten("the first messages differ from the episode's so far")
            return self._encode(whole), True
        before = self._render(messages[:n], tools, False)
        end = before.rfind(self.codec.eos_text)
        cut = end + len(self.codec.eos_text)
        if end < 0 or whole[:cut] != before[:cut]:
            self._rewritten("the chat template renders the earlier turns differently (a thinking model's template, "
                            "tools changed?)")
            return self._encode(whole), True
        close = [] if self.traj.token_ids[-1] == self.codec.eos_id else [self.codec.eos_id]  # a reply cut at
        return close + self._encode(whole[cut:]), False  # max_tokens: its turn is closed by an unsampled eos

    def text_prompt(self, prompt) -> tuple[list[int], bool]:
        """As `chat_prompt`, for a raw prompt that extends the current segment's text or token ids."""
        first = not self.traj.token_ids
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            vocab = len(self.codec.tokenizer)
            if not all(0 <= i < vocab for i in prompt):  # checked here: out of range, it would fail the engine's
                raise Refused(400, f"prompt: token ids must be in [0, {vocab})", "invalid_request")  # shared batch
            if first or self.turn_unit:
                return list(prompt), not first
            have = self.build.token_ids
            if prompt[: len(have)] != have or len(prompt) <= len(have):
                self._rewritten("the prompt's token ids do not extend the episode's")
                return list(prompt), True
            return prompt[len(have):], False
        if isinstance(prompt, str):
            if first or self.turn_unit:
                return self._encode(prompt), not first
            if not prompt.startswith(self.text) or len(prompt) == len(self.text):
                self._rewritten("the prompt does not extend the episode's text")
                return self._encode(prompt), True
            return self._encode(prompt[len(self.text):]), False
        raise Refused(400, "prompt: one string or one list of token ids", "invalid_request")

    async def generate(self, prompt: tuple[list[int], bool], max_tokens: int | None):
        """Append the call's new prompt tokens (to the current segment, or as a new one) and sample; a call
        over the sequence's budget appends nothing."""
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise Refused(400, f"max_tokens: a positive integer, not {str(max_tokens)[:40]!r}", "invalid_request")
        t, (new_ids, new_segment) = self.traj, prompt
        have = 0 if new_segment else len(self.build.token_ids)  # rollout.max_episode_tokens bounds each sequence
        budget = min(max_tokens or self.limits.max_action_tokens, self.limits.max_action_tokens,
                     self.limits.max_episode_tokens - have - len(new_ids))
        if budget <= 0:
            self.truncated = "token limit"
            raise Refused(400, f"token limit: rollout.max_episode_tokens={self.limits.max_episode_tokens}", "token_limit")
        if new_segment:
            self.build.segment(new_ids)
        else:
            self.build.context(new_ids)
        started = time.perf_counter()
        try:
            gen = await self.engine.generate(self.build.token_ids, replace(self.params, max_new_tokens=budget),
                                             session=t.id)
        except EngineError as exc:
            self.engine_error = str(exc)[:500]
            raise Refused(500, f"engine error: {exc}"[:500], "engine_error") from None
        finally:
            self.overhead_s -= time.perf_counter() - started
        self.build.sampled(gen)  # one turn per call; a reply cut at max_tokens is the agent's to handle
        self.calls += 1
        return gen

    async def chat(self, body: dict) -> dict:
        self._enter("chat")
        self.busy = True
        try:
            messages, tools = body.get("messages") or [], body.get("tools") or None
            prompt = self.chat_prompt(messages, tools)
            gen = await self.generate(prompt, body.get("max_completion_tokens") or body.get("max_tokens"))
            self.mode, self.messages = "chat", [same_message(m) for m in messages]
            text = self.codec.action_text(gen.token_ids)
            content, calls = (text, []) if self.options.tool_parser == "none" else parse_tool_calls(text, self.tool_calls)
            self.tool_calls += len(calls)
            reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            self.messages.append(same_message(reply))
            finish = "tool_calls" if calls else ("stop" if gen.finish_reason == "stop" else "length")
            return _completion(self.traj.id, self.calls, body, "chat.completion",
                               {"index": 0, "message": reply, "finish_reason": finish, "logprobs": None},
                               len(self.build.token_ids) - len(gen.token_ids), len(gen.token_ids))
        finally:
            self.busy = False

    async def complete(self, body: dict) -> dict:
        self._enter("completion")
        self.busy = True
        try:
            prompt = body.get("prompt")
            new = self.text_prompt(prompt)
            gen = await self.generate(new, body.get("max_tokens") or 16)
            text = self.codec.action_text(gen.token_ids)
            self.mode = "completion"
            self.text = (prompt if isinstance(prompt, str) else "" if new[1] else self.text) + text
            finish = "stop" if gen.finish_reason == "stop" else "length"
            return _completion(self.traj.id, self.calls, body, "text_completion",
                               {"index": 0, "text": text, "finish_reason": finish, "logprobs": None},
                               len(self.build.token_ids) - len(gen.token_ids), len(gen.token_ids))
        finally:
            self.busy = False


def _completion(traj_id: str, n: int, body: dict, kind: str, choice: dict, prompt: int, completion: int) -> dict:
    return {"id": f"{traj_id}-{n}", "object": kind, "created": int(time.time()), "model": body.get("model") or "sao",
            "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                           "total_tokens": prompt + completion}}
