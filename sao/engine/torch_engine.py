"""The built-in torch engine: continuous batching with a KV cache and in-flight weight swaps.

Every `generate` call is a request; one decode loop serves all of them. Each loop iteration
(1) swaps in newer weights if the weight source has them, (2) prefills newly arrived requests and
merges their KV caches into the running batch (left padding, explicit position ids), (3) decodes
one token for every running sequence, recording for each token its log-prob under the
distribution it was sampled from and the policy version of the weights that produced it, and
(4) retires finished sequences. Sequences in flight survive a weight swap: their later tokens carry
the new version, exactly as docs/algorithm.md §6 describes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from sao.engine.base import WeightSource
from sao.types import Generation, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) logits -> sampled ids (N,) and their log-probs (N,) under the sampling distribution.

    Greedy rows (temperature 0) report the log-prob of the argmax under the model's softmax.
    """
    logits = logits.float()
    out_ids = torch.empty(logits.shape[0], dtype=torch.long)
    out_lp = torch.empty(logits.shape[0])
    exact = [i for i, p in enumerate(params) if p.is_exact]
    if len(exact) == len(params):  # the common training path: one vectorized draw
        logp = torch.log_softmax(logits, dim=-1)
        ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
    for i, p in enumerate(params):
        row = logits[i]
        if p.temperature == 0:
            tok = int(row.argmax())
            out_ids[i], out_lp[i] = tok, torch.log_softmax(row, -1)[tok]
            continue
        row = row / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) > p.top_p
            row = row.masked_fill(torch.zeros_like(row, dtype=torch.bool).scatter(0, order, drop), float("-inf"))
        logp = torch.log_softmax(row, -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
        out_ids[i], out_lp[i] = tok, logp[tok]
    return out_ids, out_lp


class TorchEngine:
    """Async batched generation over one HF causal LM. Use from a single asyncio event loop."""

    def __init__(self, model, pad_id: int, max_batch: int = 64, seed: int = 0, version: int = 0,
                 weight_source: WeightSource | None = None):
        self.model = model.eval()
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.version = version
        self.weight_source = weight_source
        self.generator = torch.Generator().manual_seed(seed)
        self._pending: list[_Request] = []
        self._admitting: list[_Request] = []  # being prefilled right now
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        # running batch
        self._active: list[_Request] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (B, L) 1 = real token, 0 = left padding
        self._next_pos: torch.Tensor | None = None  # (B,)
        self._last: torch.Tensor | None = None  # (B,) token fed at the next step
        self.stats = {"decode_steps": 0, "tokens": 0, "weight_swaps": 0, "busy_s": 0.0}

    # -- public API -------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("generate: empty prompt")
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        req = _Request(list(prompt_ids), params, asyncio.get_running_loop().create_future())
        self._pending.append(req)
        self._wake.set()
        return await req.future

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
            for req in self._active + self._admitting + self._pending:
                if not req.future.done():
                    req.future.set_exception(exc)
            self._active, self._admitting, self._pending = [], [], []
            self._cache = self._mask = self._next_pos = self._last = None
            raise

    async def _loop(self) -> None:
        import time

        while True:
            if not self._active and not self._pending:
                self._wake.clear()
                await self._wake.wait()
            t0 = time.perf_counter()
            self.update_weights()
            with torch.no_grad():
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
        ids, lps = sample_tokens(logits, [r.params for r in reqs], self.generator)
        for r, tok, lp in zip(reqs, ids.tolist(), lps.tolist()):
            r.token_ids.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self.version)
        self.stats["tokens"] += len(reqs)
        return ids

    def _prefill(self, reqs: list[_Request]) -> None:
        n, length = len(reqs), max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, length - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, length - len(r.prompt_ids):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
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
        mask = torch.cat([self._mask, torch.ones((len(self._active), 1), dtype=torch.long)], 1)
        out = self.model(input_ids=self._last[:, None], attention_mask=mask,
                         position_ids=self._next_pos[:, None], cache=self._cache, use_cache=True)
        self._mask = mask
        self._next_pos = self._next_pos + 1
        self._last = self._record(self._active, out.logits[:, -1])
        self.stats["decode_steps"] += 1

    def _retire(self) -> None:
        keep = []
        for i, r in enumerate(self._active):
            stop = r.token_ids[-1] in r.params.stop_token_ids
            if stop or len(r.token_ids) >= r.params.max_new_tokens:
                if not r.future.done():
                    r.future.set_result(Generation(r.token_ids, r.logprobs, r.versions, "stop" if stop else "length"))
            else:
                keep.append(i)
        if len(keep) == len(self._active):
            return
        if not keep:
            self._active, self._cache, self._mask, self._next_pos, self._last = [], None, None, None, None
            return
        idx = torch.tensor(keep)
        mask = self._mask[idx]
        start = int(mask.argmax(dim=1).min())  # drop columns that are padding in every row
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self._mask = mask[:, start:]
        self._next_pos, self._last = self._next_pos[idx], self._last[idx]
        self._active = [self._active[i] for i in keep]
