"""HumanEval held-out pass@1 of a model folder, as `sao eval MODEL CONFIG` computes it (the same
environment, codec, built-in torch engine and `sao.runtime.evaluate.evaluate`), run in chunks so a
partial result is written after each chunk, with every episode's outcome and a few decoded replies.

    .venv/bin/python benchmarks/humaneval.py models/smollm2 examples/configs/smollm2_humaneval.yaml

Writes benchmarks/results/humaneval/smollm2_135m.json (`--out`). `--rejudge FILE` then runs the stored
reply of every episode that ended in an environment fault (env_error, timeout) through a fresh episode
of the same environment, one at a time, and adds the outcomes beside the as-run figures (a check on the
as-run verdicts: runs before 2026-12-03 06:00 lost 60 of 123 episodes to a sandbox fault, ProcessLookupError
when the engine's steps held the event loop past a run's wall-clock limit, fixed in sao/sandbox/namespace.py).
Greedy decoding in chunks of
`--chunk` problems: a different batch (`sao eval` runs up to 128 at once) pads differently, which
can flip a greedy token where two are within float rounding, so the two can differ by a problem or so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("config", nargs="?")
    ap.add_argument("--rejudge", metavar="FILE", help="re-judge the environment faults of a written result")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--chunk", type=int, default=41)
    ap.add_argument("--out", default="benchmarks/results/humaneval/smollm2_135m.json")
    args = ap.parse_args()
    if args.rejudge:
        return rejudge(Path(args.rejudge))

    import torch

    from sao.api import as_config
    from sao.envs import make_environment
    from sao.models.chat import ChatCodec
    from sao.models.quiet import quiet_transformers
    from sao.models.tiny import load_model
    from sao.models.tokenizer import load_tokenizer
    from sao.runtime.episodes import limits_of
    from sao.runtime.evaluate import evaluate

    cfg = as_config(args.config, args.overrides)
    quiet_transformers()
    torch.set_num_threads(2)  # what `sao eval` uses
    environment = make_environment(cfg.env.name, cfg.env.options, cfg.train.seed)
    codec, model = ChatCodec(load_tokenizer(args.model)), load_model(args.model)
    tasks = environment.eval_tasks(cfg.eval.num_tasks)
    out, episodes, t0 = Path(args.out), [], time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(tasks), args.chunk):
        res = evaluate(model, codec, environment, tasks[start:start + args.chunk], limits_of(cfg),
                       greedy=cfg.eval.greedy, seed=cfg.train.seed)
        episodes += [{"task_id": t.task_id, "reward": t.reward, "status": t.status.value, "reason": t.status_reason,
                      "metrics": t.metrics, "reply": codec.decode(t.token_ids[t.prompt_len:])}
                     for t in res.trajectories]
        write(out, args, cfg, episodes, len(tasks), time.time() - t0)
        print(f"{len(episodes)}/{len(tasks)} problems, {sum(e['reward'] for e in episodes):.0f} passed", flush=True)


def write(out: Path, args, cfg, episodes: list[dict], total: int, wall_s: float) -> None:
    passed = [e for e in episodes if e["reward"] == 1.0]
    mean = lambda key: sum(e["metrics"].get(key, 0.0) for e in episodes) / len(episodes)  # noqa: E731
    samples = [e for e in episodes[:3]] + passed[:3]
    result = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "equivalent": f"sao eval {args.model} {args.config} {' '.join(args.overrides)}".strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model, "engine": "torch (sao's built-in engine, what `sao eval` uses), CPU, fp32",
        "greedy": cfg.eval.greedy, "problems_run": len(episodes), "problems_total": total,
        "complete": len(episodes) == total, "passed": len(passed),
        "pass_at_1": len(passed) / len(episodes),
        "passed_ids": [e["task_id"] for e in passed],
        "statuses": {s: sum(e["status"] == s for e in episodes) for s in sorted({e["status"] for e in episodes})},
        "truncated_at_action_limit": sum(e["reason"] == "action token limit" for e in episodes),
        "format_errors": mean("format_errors"), "syntax_error": mean("syntax_error"),
        "rollout": cfg.rollout.model_dump(include={"max_turns", "max_action_tokens", "max_episode_tokens"}),
        "env_options": cfg.env.options,
        "wall_s": round(wall_s),  # on a shared machine: see the run's "load" note where one was added
        "samples": [{k: e[k] for k in ("task_id", "reward", "status", "reply")} for e in samples],
        "episodes": [{k: e[k] for k in ("task_id", "reward", "status", "reason", "reply")} for e in episodes],
    }
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")


def rejudge(path: Path) -> None:
    import asyncio

    from sao.envs import make_environment

    result = json.loads(path.read_text())
    environment = make_environment("code", result["env_options"], 0)
    tasks = {t.id: t for t in environment.eval_tasks(result["problems_total"])}

    async def judge(episode: dict) -> float:
        live = environment.new_episode(None)
        live.reset(tasks[episode["task_id"]])
        step = await live.step(episode["reply"].removesuffix("<|im_end|>"))
        return step.reward if step.done else 0.0

    faults = [e for e in result["episodes"] if e["status"] in ("env_error", "timeout")]
    outcomes = {e["task_id"]: asyncio.run(judge(e)) for e in faults}  # one at a time
    passed = result["passed"] + sum(r == 1.0 for r in outcomes.values())
    result.update({"rejudged": {"command": " ".join([".venv/bin/python", *sys.argv]), "episodes": len(faults),
                                "passed_ids": [k for k, r in outcomes.items() if r == 1.0]},
                   "passed_after_rejudge": passed, "pass_at_1_after_rejudge": passed / result["problems_run"]})
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"re-judged {len(faults)} episodes: {passed}/{result['problems_run']} passed")


if __name__ == "__main__":
    main()
