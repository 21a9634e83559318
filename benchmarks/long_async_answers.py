"""What a vs_trl addition run answers (benchmarks/results/long_async/collapse_repro.json, docs/performance.md).

    python benchmarks/long_async_answers.py RUN_DIR            every-10-step metrics + answer counts, last-50 summary
    python benchmarks/long_async_answers.py --probe CHECKPOINT  per-prompt p("4"), the critic's values, how much the
                                                                actor's state at the answer position depends on the prompt

RUN_DIR is a `sao train` run of benchmarks/vs_trl_task.py (dump all 16 trajectories: output.trajectories_per_dump=16).
A reply's answer is its last integer, counted only when it ended with EOS. Collapse = the first step from which the
entropy stays below 0.3 to the end.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch

KEYS = ["reward/mean", "actor/entropy", "critic/explained_variance", "critic/value_mean", "async/lag_mean",
        "dis/masked_low_frac", "dis/masked_high_frac", "rollout/truncated_frac", "rollout/action_tokens_mean"]
PROMPTS = [(a, b) for a in range(5) for b in range(5)]


def run_summary(run: Path) -> dict:
    from transformers import AutoTokenizer

    cfg = (run / "config.yaml").read_text()
    tok = AutoTokenizer.from_pretrained(re.search(r"^\s+path: (\S+)", cfg, re.M).group(1))
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r}
    table = []
    for step in sorted(s for s in rows if s % 10 == 0):
        e = {"step": step, **{k: None if rows[step].get(k) is None else round(rows[step][k], 4) for k in KEYS}}
        dump = run / "trajectories" / f"step_{step:06d}.jsonl"
        if dump.is_file():
            got = []
            for t in map(json.loads, dump.read_text().splitlines()):
                text = tok.decode([i for i, m in zip(t["token_ids"], t["action_mask"]) if m])
                a, b = map(int, re.search(r"What is (\d)\+(\d)", tok.decode(t["token_ids"][:t["prompt_len"]])).groups())
                nums = re.findall(r"-?\d+", text)
                got.append((a + b, nums[-1] if nums and text.endswith(tok.eos_token) else None))
            wrong = [g for s, g in got if s != 4]
            e.update(answers_n=len(got), answer_4_frac=round(sum(g == "4" for _, g in got) / len(got), 3),
                     answer_4_on_wrong_prompt_frac=round(sum(g == "4" for g in wrong) / max(1, len(wrong)), 3),
                     modal_answer=list(Counter(g for _, g in got).most_common(1)[0]))
        table.append(e)
    last = max(rows)
    summary = {k: round(sum(v) / len(v), 4) if (v := [rows[s][k] for s in rows if s > last - 50
                                                     and rows[s].get(k) is not None]) else None
               for k in ["reward/mean", "actor/entropy", "critic/explained_variance", "critic/value_mean"]}
    ent = [(s, rows[s]["actor/entropy"]) for s in sorted(rows) if rows[s].get("actor/entropy") is not None]
    summary["collapse_step"] = next((s for i, (s, _) in enumerate(ent) if all(v < 0.3 for _, v in ent[i:])
                                     and len(ent) - i >= 10), None)
    summary["last_step"] = last
    return {"summary": summary, "every_10_steps": table}


def probe(ckpt: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sao.models.critic import critic_values, load_critic

    actor_dir = ckpt / "actor" if (ckpt / "actor").is_dir() else ckpt  # a checkpoint, or the starting model
    tok = AutoTokenizer.from_pretrained(actor_dir)
    actor = AutoModelForCausalLM.from_pretrained(actor_dir).eval()
    critic = load_critic(ckpt / "critic").eval() if (ckpt / "critic").is_dir() else None
    four = tok.convert_tokens_to_ids("4")
    p4, values, states, dists = [], [], [], []
    for a, b in PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": f"What is {a}+{b}?"}], tokenize=False,
                                         add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = actor(input_ids=ids, output_hidden_states=True)
            if critic is not None:  # V of the state in which the answer's first token is chosen
                values.append(float(critic_values(critic, torch.cat([ids, ids[:, :1]], 1), None)[0, -1]))
        dists.append(out.logits[0, -1].softmax(-1))
        p4.append(float(dists[-1][four]))
        states.append(out.hidden_states[-1][0, -1])
    h = torch.stack(states)
    spread = float((h - h.mean(0)).norm(dim=1).mean() / h.norm(dim=1).mean())
    v = torch.tensor(values) if values else None
    d = torch.stack(dists)
    top = int(d.mean(0).argmax())
    return {"first_token_top": tok.convert_ids_to_tokens(top), "p_top_min_max": [round(float(d[:, top].min()), 4),
                                                                                 round(float(d[:, top].max()), 4)],
            "mean_pairwise_tv": round(float(0.5 * (d[:, None] - d[None]).abs().sum(-1).mean()), 4),
            "p_answer_4_min_max": [round(min(p4), 4), round(max(p4), 4)],
            "critic_value_mean_std": None if v is None else [round(float(v.mean()), 4), float(v.std())],
            "answer_state_spread_over_norm": round(spread, 4)}


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        print(json.dumps(probe(Path(sys.argv[2]))))
    else:
        print(json.dumps(run_summary(Path(sys.argv[1]))))
