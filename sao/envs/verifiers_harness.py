"""sao's harness for `verifiers` environments: each segment of a rollout is one chat call, in process.

A verifiers `Harness` is the program that talks to the model; verifiers allows one that runs its loop in
process as long as every model call goes through the rollout's interception `endpoint` with its `secret`
(the trace is then the record of what ran). This one sends the segment's conversation as one
`/chat/completions` request, without streaming and without sampling fields (sao's endpoint samples as the
rollout does); the interception server relays it to the episode's sao endpoint, which records the tokens.
Multi-turn environments resume it on the accreted conversation (the default `resume`). Tool servers
(`Task.toolsets`) are not wired in: sao refuses such tasksets (sao/envs/verifiers_env.py).
"""

from __future__ import annotations

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult


class SaoHarnessConfig(vf.HarnessConfig):
    pass


class SaoHarness(vf.Harness[SaoHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt stays a system message
    SUPPORTS_RESUME = True  # the default resume() relaunches on the accreted conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     tool_interception_url=None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                     else [message_to_wire(m) for m in prompt or []])
        async with httpx.AsyncClient(timeout=None) as client:
            r = await client.post(f"{endpoint.rstrip('/')}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                                  json={"model": ctx.model, "messages": messages})
        return ProgramResult(exit_code=0 if r.status_code < 400 else 1, stdout=r.text[-2000:], stderr="")


__all__ = ["SaoHarness"]
