"""The built-in torch engine: continuous batching with a KV cache, episode caches kept across turns,
in-flight weight swaps.

Every `generate` call is a request; one decode loop serves all of them. Each loop iteration
(1) swaps in newer weights if the weight source has them, (2) prefills newly arrived requests and
merges their KV caches into the running batch (explicit attention masks and position ids), (3) decodes
one token for every running sequence, recording for each token its log-prob under the distribution it
was sampled from and the policy version of the weights that produced it, and (4) retires finished
sequences. Sequences in flight survive a weight swap: their later tokens carry the new version, exactly
as docs/algorithm.md §6 describes.

Cross-turn reuse: a request that names its episode (`session`) leaves that episode's KV cache behind
when it finishes; the episode's next turn (the same tokens plus the sampled action and the new
observation) prefills only the tokens the cache does not hold. Versions: a token's version is the
version of the weights that ran the forward pass which sampled it. Its context's KV entries may come
from older weights, both after an in-flight swap and when a kept cache is reused after a swap: the KV
cache then mixes versions. `recompute_after_swap=True` drops a kept cache computed under older weights
and re-prefills the conversation under the current ones (the KV of a request already decoding is never
recomputed). The trainer recomputes log-probs itself, so the behavior log-prob stays what was sampled.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from sao.device import autocast
from sao.engine.base import EngineError, UnsupportedModelError, WeightSource, check_prompt
from sao.engine.sampling import sample_tokens
from sao.types import Generation, SamplingParams

__all__ = ["TorchEngine", "sample_tokens", "check_cache_layout"]


@dataclass
class _Kept:
    """An episode's KV cache between turns: K/V of `tokens`, one (1, H, L, D) pair per layer."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    oldest_version: int  # the oldest weights that computed any of these entries


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    session: str | None
    max_new: int
    oldest_version: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def check_cache_layout(model) -> None:
    """Refuse models whose cache is not one full-attention K/V per layer (sliding window, hybrid)."""
    config = model.config
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if kinds != {DynamicLayer.__name__}:
        raise UnsupportedModelError(f"model {config.model_type!r}: the torch engine serves full-attention caches "
                                    f"only, this model's cache has {sorted(kinds)} layers (use engine.name=vllm)")


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 1 << 30))


class TorchEngine:
    """Async batched generation over one HF causal LM. Use from a single asyncio event loop."""

    def __init__(self, model, pad_id: int, max_batch: int = 64, seed: int = 0, version: int = 0,
                 weight_source: WeightSource | None = None, kv_reuse: bool = True,
                 recompute_after_swap: bool = False, dtype: torch.dtype = torch.float32,
                 max_sessions: int | None = None):
        check_cache_layout(model)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = dtype
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.version = version
        self.weight_source = weight_source
        self.kv_reuse = kv_reuse
        self.recompute_after_swap = recompute_after_swap
        self.context_length = context_length(model)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._max_kept = max_sessions or 4 * max_batch
        self._pending: list[_Request] = []
        self._admitting: list[_Request] = []  # being prefilled right now
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        # running batch
        self._active: list[_Request] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (B, L) 1 = real token, 0 = padding
        self._next_pos: torch.Tensor | None = None  # (B,)
        self._last: torch.Tensor | None = None  # (B,) token fed at the next step
        self.stats = {"decode_steps": 0, "tokens": 0, "weight_swaps": 0, "busy_s": 0.0,
                      "prefill_tokens": 0, "reused_tokens": 0}

    # -- public API -------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, session: str | None = None) -> Generation:
        check_prompt(prompt_ids, self.context_length)
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        max_new = min(params.max_new_tokens, self.context_length - len(prompt_ids))
        req = _Request(list(prompt_ids), params, asyncio.get_running_loop().create_future(),
                       session if self.kv_reuse else None, max_new)
        self._pending.append(req)
        self._wake.set()
        return await req.future

    def release(self, session: str) -> None:
        """The episode is over: drop its kept KV cache."""
        self._kept.pop(session, None)

    def update_weights(self, source: WeightSource | None = None) -> bool:
        """Swap in newer weights now if the source has them (between decode steps)."""
        source = source or self.weight_source
        if source is None or source.poll(self.version) is None:
            return False
        with torch.no_grad():
            self.version = source.load_into([p.data for p in self.model.parameters()])
        self.stats["weight_swaps"] += 1
        return True

    async def close(self) -> None:
        self._kept.clear()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            except Exception:  # already delivered to the requests that were waiting
                pass
            self._loop_task = None

    # -- decode loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:  # a failed forward pass must fail the waiting episodes, not hang them
            err = EngineError(f"torch engine: {type(exc).__name__}: {exc}"[:500])
            for req in self._active + self._admitting + self._pending:
                if not req.future.done():
                    req.future.set_exception(err)
            self._active, self._admitting, self._pending = [], [], []
            self._cache = self._mask = self._next_pos = self._last = None
            self._kept.clear()
            raise err from exc

    async def _loop(self) -> None:
        while True:
            if not self._active and not self._pending:
                self._wake.clear()
                await self._wake.wait()
            t0 = time.perf_counter()
            self.update_weights()
            with torch.no_grad(), autocast(self.device, self.dtype):
                if self._pending and len(self._active) < self.max_batch:
                    room = self.max_batch - len(self._active)
                    self._admitting, self._pending = self._pending[:room], self._pending[room:]
                    self._prefill(self._admitting)
                    self._admitting = []
                elif self._active:
                    self._decode_step()
                self._retire()
            self.stats["busy_s"] += time.perf_counter() - t0
            await asyncio.sleep(0)  # let episodes step their environments and submit new turns

    def _record(self, reqs: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        ids, lps = sample_tokens(logits, [r.params for r in reqs], self.generator,
                                 [len(r.prompt_ids) + len(r.token_ids) for r in reqs])
        for r, tok, lp in zip(reqs, ids.tolist(), lps.tolist()):
            r.token_ids.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self.version)
        self.stats["tokens"] += len(reqs)
        return ids

    def _claim(self, req: _Request) -> _Kept | None:
        """The episode's kept cache if it covers a strict prefix of this prompt (and is fresh enough)."""
        kept = self._kept.pop(req.session, None) if req.session is not None else None
        if kept is None or len(kept.tokens) >= len(req.prompt_ids) or req.prompt_ids[:len(kept.tokens)] != kept.tokens:
            return None
        if self.recompute_after_swap and kept.oldest_version != self.version:
            return None
        return kept

    def _prefill(self, reqs: list[_Request]) -> None:
        """One forward pass over the tokens of `reqs` that no kept cache holds; logits of the last only.

        Layout per row: [left-padded kept K/V (width P) | left-padded new tokens (width S)]; the holes
        are masked out and position ids continue each row's own sequence."""
        kept = [self._claim(r) for r in reqs]
        past = [len(k.tokens) if k else 0 for k in kept]
        new = [r.prompt_ids[p:] for r, p in zip(reqs, past)]
        n, width_p, width_s = len(reqs), max(past), max(len(s) for s in new)
        dev = self.device
        ids = torch.full((n, width_s), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width_p + width_s), dtype=torch.long)
        pos = torch.zeros((n, width_s), dtype=torch.long)
        for i, (p, s) in enumerate(zip(past, new)):
            ids[i, width_s - len(s):] = torch.tensor(s)
            mask[i, width_p - p: width_p] = 1
            mask[i, width_p + width_s - len(s):] = 1
            pos[i, width_s - len(s):] = torch.arange(p, p + len(s))
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        cache = DynamicCache(config=self.model.config)
        if width_p:
            for layer in range(len(cache.layers)):
                ref = next(k for k in kept if k is not None).keys[layer]
                shape = (n, ref.shape[1], width_p, ref.shape[3])
                keys, values = ref.new_zeros(shape), ref.new_zeros(shape)
                for i, k in enumerate(kept):
                    if k is not None:
                        keys[i, :, width_p - past[i]:] = k.keys[layer][0]
                        values[i, :, width_p - past[i]:] = k.values[layer][0]
                cache.update(keys, values, layer)
        for r, k in zip(reqs, kept):
            r.oldest_version = min(k.oldest_version, self.version) if k else self.version
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)
        self.stats["prefill_tokens"] += sum(len(s) for s in new)
        self.stats["reused_tokens"] += sum(past)
        last = self._record(reqs, out.logits[:, -1])
        self._merge(reqs, cache, mask, pos[:, -1] + 1, last)

    def _merge(self, reqs, cache: DynamicCache, mask, next_pos, last) -> None:
        if not self._active:
            self._active, self._cache, self._mask, self._next_pos, self._last = reqs, cache, mask, next_pos, last
            return
        la, lb = self._mask.shape[1], mask.shape[1]
        width = max(la, lb)

        def lpad(x: torch.Tensor, dim_len: int, dim: int) -> torch.Tensor:
            if dim_len == width:
                return x
            shape = list(x.shape)
            shape[dim] = width - dim_len
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        for layer_a, layer_b in zip(self._cache.layers, cache.layers):
            layer_a.keys = torch.cat([lpad(layer_a.keys, la, 2), lpad(layer_b.keys, lb, 2)], 0)
            layer_a.values = torch.cat([lpad(layer_a.values, la, 2), lpad(layer_b.values, lb, 2)], 0)
        self._mask = torch.cat([lpad(self._mask, la, 1), lpad(mask, lb, 1)], 0)
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._last = torch.cat([self._last, last])
        self._active = self._active + reqs

    def _decode_step(self) -> None:
        n = len(self._active)
        mask = torch.cat([self._mask, torch.ones((n, 1), dtype=torch.long, device=self.device)], 1)
        out = self.model(input_ids=self._last[:, None], attention_mask=mask,
                         position_ids=self._next_pos[:, None], cache=self._cache, use_cache=True)
        self._mask = mask
        self._next_pos = self._next_pos + 1
        self._last = self._record(self._active, out.logits[:, -1])
        self.stats["decode_steps"] += 1

    def _keep(self, i: int, req: _Request) -> None:
        """Keep row i's K/V (prompt + all sampled tokens but the last, which was never fed) for the next turn."""
        cols = self._mask[i].nonzero().squeeze(-1)
        tokens = req.prompt_ids + req.token_ids[:-1]
        if len(cols) != len(tokens):  # a bookkeeping bug must not corrupt the next turn: recompute instead
            return
        self._kept[req.session] = _Kept(tokens, [layer.keys[i: i + 1, :, cols] for layer in self._cache.layers],
                                        [layer.values[i: i + 1, :, cols] for layer in self._cache.layers],
                                        req.oldest_version)
        while len(self._kept) > self._max_kept:
            self._kept.popitem(last=False)

    def _retire(self) -> None:
        keep = []
        for i, r in enumerate(self._active):
            stop = r.token_ids[-1] in r.params.stop_token_ids
            if stop or len(r.token_ids) >= r.max_new:
                if r.session is not None:
                    self._keep(i, r)
                if not r.future.done():
                    r.future.set_result(Generation(r.token_ids, r.logprobs, r.versions, "stop" if stop else "length"))
            else:
                keep.append(i)
        if len(keep) == len(self._active):
            return
        if not keep:
            self._active, self._cache, self._mask, self._next_pos, self._last = [], None, None, None, None
            return
        idx = torch.tensor(keep, device=self.device)
        mask = self._mask[idx]
        start = int(mask.argmax(dim=1).min())  # drop columns that are padding in every row
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self._mask = mask[:, start:]
        self._next_pos, self._last = self._next_pos[idx], self._last[idx]
        self._active = [self._active[i] for i in keep]
