"""The torch engine: log-prob parity with the trainer, continuous batching, in-flight weight swaps."""

import asyncio

import torch

from sao.engine.torch_engine import TorchEngine, sample_tokens
from sao.models.actor import sequence_logprobs
from sao.models.tiny import load_model
from sao.types import SamplingParams


class _Weights:
    """An in-memory weight source holding one newer version."""

    def __init__(self, params, version):
        self.params, self.v = [p.detach().clone() for p in params], version

    def poll(self, current):
        return self.v if self.v > current else None

    def load_into(self, params):
        for dst, src in zip(params, self.params):
            dst.copy_(src)
        return self.v


def _prompts(codec, n):
    return [codec.prompt_ids([{"role": "user", "content": "12+3" * (i % 5 + 1)}]) for i in range(n)]


def test_engine_logprobs_match_trainer_with_staggered_requests(tiny):
    model, codec = tiny
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=8, seed=0)
    prompts = _prompts(codec, 12)
    params = SamplingParams(max_new_tokens=20)

    async def one(i):
        await asyncio.sleep(0.002 * i)  # arrive while others are mid-decode: caches get merged
        return await engine.generate(prompts[i], params)

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(12)))
        finally:
            await engine.close()

    gens = asyncio.run(main())
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == 20 and g.finish_reason == "length"
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            lp = sequence_logprobs(model, ids, torch.ones_like(ids))[0, len(p):]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4)
        assert g.versions == [0] * 20


def test_weights_swap_between_decode_steps_while_sequences_are_in_flight(tiny, tiny_model_dir):
    model, codec = tiny
    other = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)
    prompt = _prompts(codec, 1)[0]

    async def main():
        task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_new_tokens=30)))
        while engine.stats["tokens"] < 10:
            await asyncio.sleep(0)
        engine.weight_source = _Weights(other.parameters(), version=1)
        gen = await task
        await engine.close()
        return gen

    gen = asyncio.run(main())
    assert gen.versions[0] == 0 and gen.versions[-1] == 1  # one trajectory spans two versions
    k = gen.versions.index(1)
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        lp_new = sequence_logprobs(other, ids, torch.ones_like(ids))[0, len(prompt):]
    # the engine now holds the new weights; tokens from index k on were sampled with them (over a KV cache
    # of earlier tokens computed by the old weights, so they need not match a fresh forward pass exactly)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert torch.isfinite(lp_new[k:]).all()
    assert engine.stats["weight_swaps"] == 1 and engine.version == 1


def test_stop_token_ends_generation_and_greedy_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    ids, lps = sample_tokens(logits, [SamplingParams(temperature=0)] * 2, gen)
    assert ids.tolist() == [1, 0]
    assert torch.allclose(lps, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1))
    # top_k=1 at any temperature is the argmax too, with log-prob 0 under the truncated distribution
    ids, lps = sample_tokens(logits, [SamplingParams(top_k=1)] * 2, gen)
    assert ids.tolist() == [1, 0] and torch.allclose(lps, torch.zeros(2))


def test_a_failing_forward_pass_fails_the_waiting_requests(tiny):
    model, codec = tiny
    engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=4, seed=0)
    bad = [len(codec.tokenizer) + 1000]  # an id outside the vocabulary: the embedding lookup raises

    async def main():
        results = await asyncio.gather(engine.generate(bad, SamplingParams(max_new_tokens=3)),
                                       return_exceptions=True)
        await engine.close()
        return results

    (result,) = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(result, Exception)
