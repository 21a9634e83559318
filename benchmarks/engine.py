"""Engines on the built-in multi-turn rollout workload: same model, same episodes.

    python benchmarks/engine.py [--episodes 64] [--concurrency 32] [--engines torch torch_noreuse generate vllm]
                                [--model DIR | --random 512x8] [--out benchmarks/results/engine.json] [key=value ...]
                                [--workload scripted --turns 6 --action-tokens 24 --observation-tokens 96]

The workload is what the rollout worker runs: `calc` episodes (the default config's tasks, up to
rollout.max_turns turns, the model calling the calculator and reading its result) driven by the real
agent loop, `--concurrency` episodes in flight. The model is the default run's starting policy (the
cached SFT warm start, built if missing) unless --model is given. The built-in policy answers most
`calc` tasks in one or two turns; `--workload scripted` runs what long tool-using episodes look like
to an engine instead: exactly --turns turns per episode, each appending --observation-tokens of tool
output, so the conversation grows every turn (the prefill that cross-turn reuse saves grows with it).
Engines:
  torch           the built-in engine with each episode's KV cache kept across turns (the default)
  torch_noreuse   the same engine re-prefilling the whole conversation every turn (engine.kv_reuse=false)
  generate        `transformers` `model.generate` on left-padded batches of the turns waiting at that
                  moment, re-prefilling each conversation every turn (log-probs from its scores)
  vllm            a vLLM server sao starts from .venv-vllm (engine.name=vllm; start-up not timed)
Reported per engine: wall seconds for all episodes, sampled tokens/s, episodes/s, turns, and for the
torch engines the prompt positions prefilled vs reused. Writes JSON and prints a table. Run it under
`flock /tmp/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from sao.config import load_config
from sao.engine import make_engine
from sao.envs import make_environment
from sao.envs.base import EpisodeContext
from sao.models.chat import ChatCodec
from sao.models.tiny import load_model
from sao.models.tokenizer import load_tokenizer
from sao.rollout.agent_loop import run_episode
from sao.runtime.episodes import limits_of
from sao.types import Generation, SamplingParams


class GenerateEngine:
    """`model.generate` behind the engine protocol: turns that arrive together run as one static batch."""

    def __init__(self, model, pad_id: int, seed: int, window_s: float = 0.002):
        self.model, self.pad_id, self.version, self.window_s = model.eval(), pad_id, 0, window_s
        self.stats = {"tokens": 0, "prefill_tokens": 0, "batches": 0}
        torch.manual_seed(seed)
        self._queue: list = []
        self._task = None

    async def generate(self, prompt_ids, params: SamplingParams, session=None) -> Generation:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((list(prompt_ids), params, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._batcher())
        return await fut

    def release(self, session) -> None:
        pass

    def update_weights(self, source=None) -> bool:
        return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _batcher(self) -> None:
        while self._queue:
            await asyncio.sleep(self.window_s)  # let the other episodes' turns arrive
            batch, self._queue = self._queue, []
            for group in _by_params(batch):
                self._run(group)
            await asyncio.sleep(0)

    def _run(self, batch) -> None:
        prompts, params = [b[0] for b in batch], batch[0][1]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                      top_k=0, max_new_tokens=params.max_new_tokens, eos_token_id=list(params.stop_token_ids),
                                      pad_token_id=self.pad_id, output_scores=True, return_dict_in_generate=True)
        new = out.sequences[:, width:]
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # (B, steps, V)
        picked = logp.gather(-1, new[:, : logp.shape[1], None]).squeeze(-1)
        self.stats["prefill_tokens"] += int(mask.sum())
        self.stats["batches"] += 1
        for i, (_, _, fut) in enumerate(batch):
            toks = new[i].tolist()
            stop = next((k for k, t in enumerate(toks) if t in params.stop_token_ids), None)
            n = len(toks) if stop is None else stop + 1
            self.stats["tokens"] += n
            fut.set_result(Generation(toks[:n], picked[i, :n].tolist(), [0] * n, "stop" if stop is not None else "length"))


def _by_params(batch):
    groups: dict = {}
    for item in batch:
        groups.setdefault(item[1].max_new_tokens, []).append(item)
    return list(groups.values())


def drive(engine, items: list, episode, concurrency: int) -> tuple[list, float]:
    """Run `await episode(item)` for every item, `concurrency` at a time, on one engine; closes it.
    Returns the results and the wall seconds."""
    async def main():
        queue, done = list(items), []

        async def slot():
            while queue:
                done.append(await episode(queue.pop(0)))

        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(slot() for _ in range(concurrency)))
        finally:
            await engine.close()
        return done, time.perf_counter() - t0

    return asyncio.run(main())


def run_workload(engine, environment, codec, tasks, limits, concurrency: int) -> dict:
    async def episode(task):
        env = environment.new_episode(EpisodeContext(0, 0))
        return await run_episode(env, task, engine, codec, SamplingParams(), limits)

    trajs, wall = drive(engine, tasks, episode, concurrency)
    tokens = sum(t.num_action_tokens for t in trajs)
    return {"episodes": len(trajs), "wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "episodes_per_s": round(len(trajs) / wall, 3), "turns_mean": round(sum(t.turns for t in trajs) / len(trajs), 3),
            "reward_mean": round(sum(t.reward for t in trajs) / len(trajs), 3),
            "failed": sum(t.status.value not in ("ok", "truncated") for t in trajs)}


def run_scripted(engine, codec, prompts: list[list[int]], turns: int, action_tokens: int, observation: list[int],
                 concurrency: int) -> dict:
    """Long agentic episodes as the engine sees them: every episode runs exactly `turns` turns, each
    sampling up to `action_tokens` tokens and then appending the same tool observation, so the
    conversation grows by action + observation every turn whatever the (random) model writes."""
    params = SamplingParams(stop_token_ids=(codec.eos_id,), max_new_tokens=action_tokens)

    async def episode(item):
        i, ids = item
        ids, sampled = list(ids), 0
        for _ in range(turns):
            gen = await engine.generate(ids, params, session=f"s{i}")
            ids += gen.token_ids + observation
            sampled += len(gen.token_ids)
        engine.release(f"s{i}")
        return sampled, len(ids)

    done, wall = drive(engine, list(enumerate(prompts)), episode, concurrency)
    tokens = sum(d[0] for d in done)
    return {"episodes": len(done), "wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "episodes_per_s": round(len(done) / wall, 3), "turns_mean": float(turns),
            "final_context_mean": round(sum(d[1] for d in done) / len(done), 1)}


def build(name: str, cfg, model_path: Path, pad_id: int, concurrency: int, seed: int):
    if name == "generate":
        return GenerateEngine(load_model(model_path), pad_id, seed)
    engine_cfg = cfg.engine.model_copy(update={"name": "vllm" if name == "vllm" else "torch",
                                               "kv_reuse": name != "torch_noreuse", "device": "cpu"})
    return make_engine(engine_cfg, model_path, pad_id=pad_id, max_batch=concurrency, seed=seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--engines", nargs="+", default=["torch", "torch_noreuse", "generate", "vllm"])
    ap.add_argument("--model", default=None, help="model folder (default: the default run's SFT starting policy)")
    ap.add_argument("--random", metavar="HIDDENxLAYERS", default=None,
                    help="a randomly initialized built-in Llama of that size instead (head_dim 64, MLP 4x hidden)")
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    ap.add_argument("--workload", choices=["calc", "scripted"], default="calc",
                    help="calc: the real agent loop; scripted: exactly --turns turns per episode")
    ap.add_argument("--turns", type=int, default=6, help="scripted: turns per episode")
    ap.add_argument("--action-tokens", type=int, default=24, help="scripted: max sampled tokens per turn")
    ap.add_argument("--observation-tokens", type=int, default=96, help="scripted: tool-output tokens per turn")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a rollout worker
    cfg = load_config(None, args.overrides)
    if args.random:
        import tempfile

        from sao.models.tiny import build_tiny_model

        hidden, layers = map(int, args.random.split("x"))
        model_path = build_tiny_model(Path(tempfile.mkdtemp(prefix="sao-engine-")) / "m", hidden_size=hidden,
                                      num_layers=layers, num_heads=max(hidden // 64, 1), intermediate_size=4 * hidden,
                                      max_positions=1024)
    elif args.model:
        model_path = Path(args.model)
    else:
        from sao.runtime.model_setup import prepare_base_model

        model_path, _ = prepare_base_model(cfg)
    codec = ChatCodec(load_tokenizer(model_path))
    environment = make_environment(cfg.env.name, cfg.env.options, cfg.train.seed)
    stream = environment.train_tasks()
    tasks = [next(stream) for _ in range(args.episodes)]  # the same episodes for every engine
    prompts = [codec.prompt_ids(environment.new_episode(EpisodeContext(0, 0)).reset(t)) for t in tasks]
    tool_output = "result: " + " ".join(str(7919 * k % 10007) for k in range(64))  # a long tool output
    wrapper = len(codec.observation_ids(""))  # the tool turn's role markers
    observation = codec.observation_ids(tool_output[: max(args.observation_tokens - wrapper, 1)])
    rows = {}
    for name in args.engines:
        engine = build(name, cfg, model_path, codec.tokenizer.pad_token_id, args.concurrency, cfg.train.seed)
        try:
            if args.workload == "scripted":
                rows[name] = run_scripted(engine, codec, prompts, args.turns, args.action_tokens, observation,
                                          args.concurrency)
            else:
                rows[name] = run_workload(engine, environment, codec, tasks, limits_of(cfg), args.concurrency)
            for k in ("prefill_tokens", "reused_tokens"):
                if k in getattr(engine, "stats", {}):
                    rows[name][k] = int(engine.stats[k])
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()
        print(name, rows[name], flush=True)
    params = sum(p.numel() for p in load_model(model_path).parameters())
    result = {"model": f"random {args.random}" if args.random else str(model_path), "params_m": round(params / 1e6, 2),
              "workload": args.workload, "episodes": args.episodes,
              "concurrency": args.concurrency, "max_turns": cfg.rollout.max_turns, "threads": 1, "engines": rows}
    if args.workload == "scripted":
        result.update(turns=args.turns, action_tokens=args.action_tokens, observation_tokens=len(observation))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    cols = ["wall_s", "tokens", "tokens_per_s", "episodes_per_s", "turns_mean", "final_context_mean", "prefill_tokens",
            "reused_tokens"]
    print("| engine | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 1))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
