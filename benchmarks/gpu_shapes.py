"""Trainer steps and torch-engine decoding on randomly initialized models of realistic shape (no download).

    python benchmarks/gpu_shapes.py [--device cuda] [--shapes qwen2-0.5b qwen2-1.5b] [--algos sao grpo]
                                    [--steps 3] [--batch 8] [--prompt 256] [--action 256]
                                    [--engine-batches 1 8 32] [--engine-tokens 64] [--out FILE]

Each shape is a Qwen2-style config built here (`transformers.Qwen2Config`, the published sizes of
Qwen2-0.5B and Qwen2-1.5B; `tiny` for a CPU run of the same code), randomly initialized in float32 and
saved to a temporary folder, then:
  - per algorithm, a `Learner` as `sao train` builds it (critic from the actor's first critic.depth of
    its layers, attention frozen; bf16 autocast over float32 master weights on CUDA, float32 on CPU)
    takes `--steps` steps on batches of `--batch` single-turn trajectories (`--prompt` + `--action`
    tokens, behavior log-probs from the model itself, rewards 0/1, GRPO groups of 4); the first step is
    a warm-up and not timed. Reported per step: the wall, the critic's part (v0 and K updates, v2, GAE)
    and the actor's, from the learner's own timers; on CUDA the peak allocated memory against
    docs/ranks.md's formula 16 x trained + 4 x frozen parameters (bytes; fp32 master weight, gradient and
    two AdamW moments), the rest being activations and the bf16 working copies;
  - the torch engine (sao/engine/torch_engine.py, bf16 on CUDA) decoding `--engine-tokens` tokens for each
    of `--engine-batches` concurrent requests of 64-token prompts: sampled tokens per second.
Each result prints one line; all are written as JSON (default $OUT/gpu_shapes.json, else
benchmarks/results/gpu_shapes.json). benchmarks/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sao.algo.registry import get_algorithm  # noqa: E402
from sao.config import AlgoConfig, CriticConfig, TrainConfig  # noqa: E402
from sao.models.critic import build_critic, critic_layers  # noqa: E402
from sao.models.quiet import quiet_transformers  # noqa: E402
from sao.models.tiny import load_model  # noqa: E402
from sao.trainer.batch import collate  # noqa: E402
from sao.trainer.learner import Learner  # noqa: E402
from sao.types import SamplingParams, Trajectory  # noqa: E402

SHAPES = {  # Qwen2's published configs (hidden, layers, heads, kv heads, MLP, vocab); tiny: the code path on CPU
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024),
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936),
    "qwen2-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936),
}
GROUP = 4


def build_shape(name: str, folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[name], tie_word_embeddings=True, max_position_embeddings=4096,
                         rope_theta=1_000_000.0, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def batches(model, n: int, size: int, prompt: int, action: int, vocab: int, device, seed: int = 0):
    from sao.models.actor import sequence_logprobs

    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        ids = torch.randint(2, vocab, (size, prompt + action), generator=gen)
        with torch.no_grad():
            lp = sequence_logprobs(model, ids.to(device), torch.ones_like(ids).to(device)).float().cpu()
        trajs = []
        for i in range(size):
            mask = [0] * prompt + [1] * action
            trajs.append(Trajectory(f"{b}-{i}", f"g{b}-{i // GROUP}", ids[i].tolist(), mask,
                                    [x * m for x, m in zip(lp[i].tolist(), mask)], [0 if m else -1 for m in mask],
                                    prompt, reward=float((i + b) % 3 == 0), turns=1))
        out.append(collate(trajs, 0))
    return out


def params(model) -> tuple[int, int]:
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in model.parameters()) - trained


def train_steps(path: Path, algo_name: str, args, device, dtype) -> dict:
    algo = get_algorithm(algo_name)
    actor = load_model(path).to(device)
    ccfg = CriticConfig(warmup_steps=0)
    critic = build_critic(path, depth=ccfg.depth).to(device) if algo.uses_critic else None
    learner = Learner(actor, critic, algo, AlgoConfig(group_size=GROUP, ppo_minibatches=1), ccfg, TrainConfig(),
                      dtype=dtype)
    data = batches(actor, args.steps + 1, args.batch, args.prompt, args.action, actor.config.vocab_size, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for n, batch in enumerate(data):
        t = time.perf_counter()
        m = learner.step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        if n:  # the first step warms up kernels and allocators
            rows.append({"step_s": wall, "actor_s": m.get("perf/actor_s", 0.0),
                         "critic_s": sum(m.get(k, 0.0) for k in ("perf/critic_forward_s", "perf/critic_backward_s",
                                                                  "perf/critic_v2_s", "perf/gae_s"))})
    a_trained, a_frozen = params(actor)
    c_trained, c_frozen = params(critic) if critic is not None else (0, 0)
    formula = 16 * (a_trained + c_trained) + 4 * (a_frozen + c_frozen)
    out = {"algo": algo_name, "steps": rows, "actor_params": a_trained + a_frozen,
           "critic_params": c_trained + c_frozen, "critic_layers": critic_layers(actor.config.num_hidden_layers, None,
                                                                                  ccfg.depth) if critic else 0,
           "step_s_median": statistics.median(r["step_s"] for r in rows),
           "actor_s_median": statistics.median(r["actor_s"] for r in rows),
           "critic_s_median": statistics.median(r["critic_s"] for r in rows),
           "formula_gb": formula / 1e9,
           "tokens_per_step": args.batch * (args.prompt + args.action)}
    if device.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    del learner, actor, critic
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def engine_rate(path: Path, batch: int, tokens: int, device, dtype) -> dict:
    from sao.engine.torch_engine import TorchEngine

    model = load_model(path).to(device)
    engine = TorchEngine(model, pad_id=0, max_batch=batch, dtype=dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, vocab, (64,), generator=gen).tolist() for _ in range(batch)]
    params_ = SamplingParams(max_new_tokens=tokens)

    async def go():
        await asyncio.gather(*(engine.generate(p, params_) for p in prompts[:1]))  # warm-up
        t = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params_) for p in prompts))
        return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)

    wall, sampled = asyncio.run(go())
    return {"batch": batch, "tokens": sampled, "wall_s": wall, "tokens_per_s": sampled / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="+", default=["qwen2-0.5b", "qwen2-1.5b"], choices=sorted(SHAPES))
    ap.add_argument("--algos", nargs="+", default=["sao", "grpo"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--action", type=int, default=256)
    ap.add_argument("--engine-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--engine-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(os.environ["OUT"]) / "gpu_shapes.json") if os.environ.get("OUT")
                    else str(ROOT / "benchmarks" / "results" / "gpu_shapes.json"))
    args = ap.parse_args()
    quiet_transformers()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "args": vars(args), "shapes": {}}
    for name in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            path = build_shape(name, Path(tmp) / name)
            shape = result["shapes"][name] = {"train": [], "engine": []}
            for algo in args.algos:
                r = train_steps(path, algo, args, device, dtype)
                shape["train"].append(r)
                peak = f", peak {r['peak_gb']:.1f} GB vs formula {r['formula_gb']:.1f} GB" if "peak_gb" in r else ""
                print(f"{name} {algo}: step {r['step_s_median'] * 1e3:.0f} ms (critic {r['critic_s_median'] * 1e3:.0f}, "
                      f"actor {r['actor_s_median'] * 1e3:.0f}; {r['tokens_per_step'] / r['step_s_median']:.0f} "
                      f"train tokens/s){peak}", flush=True)
            for b in args.engine_batches:
                e = engine_rate(path, b, args.engine_tokens, device, dtype)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the engine's model copy is gone with engine_rate's frame
                shape["engine"].append(e)
                print(f"{name} torch engine, {b} requests: {e['tokens_per_s']:.0f} tokens/s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
