"""An agent that talks to an OpenAI-compatible model with the `openai` client, exactly as it would to a
hosted model: `OpenAI()` reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment. sao sets both
per episode (env.name=agent, env.options.command), plus SAO_TASK (the task as JSON); the last line
printed is the result sao trains on.

Run by hand against any server:  SAO_TASK='{"prompt": "add 2 and 3", "answer": "5"}' python openai_agent.py
"""

import json
import os
import re

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def solve(client: OpenAI, prompt: str, max_calls: int = 3) -> str:
    messages = [{"role": "system", "content": "Use the add tool, then answer with the number only."},
                {"role": "user", "content": prompt}]
    answer = ""
    for _ in range(max_calls):
        reply = client.chat.completions.create(model=os.environ.get("MODEL", "sao"), messages=messages, tools=TOOLS,
                                               max_tokens=32)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = msg.content or ""
            messages.append({"role": "user", "content": "Is that your final answer? Reply with the number only."})
            continue
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) + int(args["b"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer


def main() -> None:
    task = json.loads(os.environ["SAO_TASK"])
    answer = solve(OpenAI(max_retries=0), task["prompt"])
    found = re.findall(r"-?\d+", answer)
    print(json.dumps({"reward": float(bool(found) and found[-1] == str(task["answer"])), "answer_chars": len(answer)}))


if __name__ == "__main__":
    main()
