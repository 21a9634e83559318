"""A multi-turn agent on a thinking model's chat template: the template drops the reasoning of earlier
assistant turns when a new user turn follows (as Qwen3's does), so each call's prompt is not the previous
call's tokens plus the new messages. sao continues the episode as a new segment (env.options.on_rewrite=
segment, the default) and trains every segment's sampled tokens with the episode's reward; with
env.options.sample_unit=turn every call is its own sample. docs/algorithm.md §2 and §4 say how.

    python examples/agent/thinking_agent.py [--steps 6] [--unit episode|turn]

runs it offline: a tiny model folder given a Qwen3-style template (THINKING_TEMPLATE below), a file of
addition tasks, and `sao train` on `agent` below; it prints the run folder and how many segments the
episodes had. With a real thinking model: `sao train env.name=agent env.options.path=tasks.jsonl
env.options.agent=examples.agent.thinking_agent:agent model.path=/path/to/Qwen3-0.6B`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

# Qwen3-style: the generation prompt opens the reasoning (`<think>\n`) and an assistant turn before the last
# user message is rendered without it (only the text after `</think>`)
THINKING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] or '' %}"
    "{% if m['role'] == 'assistant' %}"
    "{% if loop.index0 < ns.last_user %}{% set content = content.split('</think>')[-1].lstrip() %}"
    "{% else %}{% set content = '<think>\n' + content %}{% endif %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def agent(task: dict, base_url: str, api_key: str, calls: int = 3) -> float:
    """Ask, then ask twice more to check; the reward: the last number of the last reply is the answer."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"] + ". Answer with the number."}]
    reply = ""
    for _ in range(calls):
        reply = client.chat.completions.create(model="sao", messages=messages).choices[0].message.content or ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Sure? The number only."}]
    found = re.findall(r"-?\d+", reply.split("</think>")[-1])
    return float(bool(found) and found[-1] == str(task["answer"]))


def with_thinking_template(model_dir: Path) -> Path:
    """Give a model folder's tokenizer THINKING_TEMPLATE (a tiny model's, to run this offline)."""
    from sao.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(str(model_dir))
    return model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/thinking-agent-example", help="where the model, tasks and run go")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--unit", choices=["episode", "turn"], default="episode", help="env.options.sample_unit")
    args = ap.parse_args()
    from sao.models.tiny import build_tiny_model

    out = Path(args.out).resolve()
    model = with_thinking_template(build_tiny_model(out / "model", hidden_size=64, num_layers=1, num_heads=2,
                                                    intermediate_size=64, max_positions=256, seed=0))
    tasks = out / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"add {i} and {i + 1}", "answer": str(2 * i + 1)}) + "\n"
                             for i in range(40)))
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "sao.cli", "train", "env.name=agent", f"env.options.path={tasks}",
           "env.options.agent=examples.agent.thinking_agent:agent", f"env.options.sample_unit={args.unit}",
           f"model.path={model}", f"train.steps={args.steps}", "train.batch_size=4", "critic.warmup_steps=1",
           "rollout.max_turns=3", "rollout.max_action_tokens=8", "eval.num_tasks=4", "eval.every=0",
           "output.trajectories_every=1", f"output.root={out}", "output.name=run", "--quiet"]
    subprocess.run(cmd, check=True, cwd=repo)
    rows = [json.loads(line) for f in sorted((out / "run" / "trajectories").glob("step_*.jsonl"))
            for line in f.read_text().splitlines()]
    segments = [r["metrics"].get("agent/segments", 1) for r in rows]
    print(f"run: {out / 'run'}; {len(rows)} trained episodes, segments per episode: "
          f"{min(segments)}-{max(segments)} (sample_unit={args.unit})")


if __name__ == "__main__":
    main()
