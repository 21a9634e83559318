"""`engine.name=vllm`: the engine protocol implemented against a vLLM server.

Token ids only: prompts go to vLLM's token-in/token-out endpoint (`/inference/v1/generate`) and
sampled ids come back; nothing is detokenized or re-tokenized. Sampling is temperature 1, top-p 1, no
top-k, no repetition/presence/frequency penalty, no min-p, `ignore_eos` (sao passes its own stop ids),
and the server runs with `--logprobs-mode processed_logprobs`, so each log-prob is that of the
distribution actually sampled. A reply whose token and log-prob lists differ in length raises.

Weights (docs/engines.md): the engine polls its weight source like the torch engine; a newer version
is written as safetensors to /dev/shm (`reload`) or shared as CUDA IPC handles (`ipc`), then applied
with `pause(mode=keep)` -> load -> `update_weight_version` -> `resume`: requests in flight are frozen,
not aborted, and continue under the new weights. Versions: the server reports, per request, which
output tokens each weight version sampled (`weight_versions` spans); sao records them exactly. A server
that reports no spans gets the conservative version: the engine's version when the request was sent
(the oldest version any of its tokens may have).

Failures: a request that cannot reach the server, or a server that exited, raises `EngineError` (the
episode ends `engine_error` and the trainer re-runs it). A server sao started is restarted (up to
`engine.max_restarts` times) and given the current weights; a server at `engine.url` is not ours to restart.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import torch

from sao.config import EngineConfig
from sao.engine.base import EngineError, WeightSource, check_prompt
from sao.engine.sampling import position_seed
from sao.engine.vllm_process import EXTENSION_CLS, VLLMServer
from sao.types import Generation, SamplingParams

WEIGHT_POLL_S = 0.05


def server_args(cfg: EngineConfig, max_batch: int, seed: int, context: int) -> list[str]:
    args = ["--dtype", cfg.dtype, "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
            "--skip-tokenizer-init", "--worker-extension-cls", EXTENSION_CLS, "--max-num-seqs", str(max_batch),
            "--max-model-len", str(context), "--seed", str(seed), "--served-model-name", "sao"]
    if cfg.weight_transport == "ipc":
        args += ["--weight-transfer-config", '{"backend": "ipc"}']
    return args + list(cfg.server_args)


class VLLMEngine:
    def __init__(self, cfg: EngineConfig, model_path: str | Path, *, max_batch: int, seed: int, version: int = 0,
                 weight_source: WeightSource | None = None):
        from sao.models.tiny import load_model

        self.cfg, self.model_path, self.seed = cfg, str(Path(model_path).resolve()), seed
        self.version, self.weight_source = version, weight_source
        # the weights the server holds, in the model's parameter order (what WeightSource.load_into fills)
        self.model = load_model(self.model_path)
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.stats = {"tokens": 0, "requests": 0, "busy_s": 0.0, "weight_swaps": 0, "weight_update_ms": 0.0,
                      "restarts": 0, "engine_errors": 0}
        self._shm = Path(tempfile.mkdtemp(prefix="sao-weights-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self._labels: dict[str, int] = {}
        self._requests = 0
        self._inflight = 0
        self._busy_since = 0.0
        self._client: httpx.AsyncClient | None = None
        self._client_loop = None
        self._poller: asyncio.Task | None = None
        self._restart_lock = asyncio.Lock()
        self.server = None
        self._closed = False
        self._restarting = False
        atexit.register(self.shutdown)
        if cfg.url:
            self.url = cfg.url.rstrip("/")
        else:
            env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if cfg.weight_transport == "ipc" else {}
            self.server = VLLMServer(cfg.python, self.model_path,
                                     server_args(cfg, max_batch, seed, self.context_length), env)
            self.url = self.server.url
            self.server.start()
            self.server.wait_healthy(cfg.startup_timeout_s)
        self._http = httpx.Client(base_url=self.url, timeout=cfg.request_timeout_s)
        if cfg.weight_transport == "ipc":
            self._post("/init_weight_transfer_engine", json={"init_info": {"packed": False}})
        self._label(version)

    # -- plumbing ---------------------------------------------------------------------------
    def _post(self, path: str, **kw) -> dict:
        try:
            r = self._http.post(path, **kw)
        except httpx.HTTPError as exc:
            raise EngineError(f"vLLM server at {self.url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise EngineError(f"vLLM server at {self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else {}

    def _label(self, version: int) -> None:
        """Name the weights the server now holds; spans of later tokens carry this label."""
        self._post("/update_weight_version", json={"new_version": str(version)})
        self._labels[str(version)] = version

    def _aclient(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()  # one client per event loop (sync mode runs one loop per batch)
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(base_url=self.url, timeout=self.cfg.request_timeout_s,
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
            self._client_loop, self._poller = loop, None
            self._restart_lock = asyncio.Lock()
        if self.weight_source is not None and (self._poller is None or self._poller.done()):
            self._poller = loop.create_task(self._poll_weights())
        return self._client

    # -- generate ---------------------------------------------------------------------------
    def request_body(self, prompt_ids: list[int], params: SamplingParams, max_new: int) -> dict:
        # a seeded request (evaluation) draws from its episode's seed and where this turn starts: the same
        # tokens whichever requests the server batches it with (sao/engine/sampling.py)
        seed = (position_seed(params.seed, len(prompt_ids)) if params.seed is not None
                else self.seed * 1_000_003 + self._requests) % (1 << 31)
        body = {"token_ids": list(prompt_ids), "output_mode": "tokens", "sampling_params": {
            "max_tokens": max_new, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True, "logprobs": 0, "detokenize": False,
            "skip_special_tokens": False, "seed": seed}}
        if self.cfg.recompute_after_swap:  # never reuse prefix-cache blocks that older weights computed
            body["cache_salt"] = f"sao-v{self.version}"
        return body

    async def generate(self, prompt_ids: list[int], params: SamplingParams, session: str | None = None) -> Generation:
        check_prompt(prompt_ids, self.context_length)
        client = self._aclient()
        await self._ensure_server()
        max_new = min(params.max_new_tokens, self.context_length - len(prompt_ids))
        body = self.request_body(prompt_ids, params, max_new)
        self._requests += 1
        sent_version = self.version
        if self._inflight == 0:
            self._busy_since = time.perf_counter()
        self._inflight += 1
        try:
            r = await client.post("/inference/v1/generate", json=body)
        except httpx.HTTPError as exc:
            self.stats["engine_errors"] += 1
            raise EngineError(f"vLLM server at {self.url}: {type(exc).__name__}: {exc}"[:500]) from exc
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self.stats["busy_s"] += time.perf_counter() - self._busy_since
        if r.status_code != 200:
            self.stats["engine_errors"] += 1
            raise EngineError(f"vLLM generate: HTTP {r.status_code}: {r.text[:300]}")
        gen = self.parse(r.json(), sent_version)
        self.stats["tokens"] += len(gen.token_ids)
        return gen

    def parse(self, reply: dict, sent_version: int) -> Generation:
        choice = reply["choices"][0]
        ids = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids) or any(c["token_id"] != t for c, t in zip(content, ids)):
            raise EngineError(f"vLLM reply: {len(ids)} tokens but {len(content)} log-probs (or different ids)")
        if choice.get("finish_reason") not in ("stop", "length"):
            raise EngineError(f"vLLM request ended with finish_reason={choice.get('finish_reason')!r}")
        versions = [sent_version] * len(ids)  # conservative: the oldest version a token may have
        for span in choice.get("weight_versions") or []:
            v = self._labels.get(span["version"])
            if v is None:
                continue  # a label sao did not set (another client): keep the conservative version
            for i in range(span["start"], min(span["end"], len(ids))):
                versions[i] = v
        return Generation(ids, [float(c["logprob"]) for c in content], versions,
                          "stop" if choice["finish_reason"] == "stop" else "length")

    def release(self, session: str) -> None:
        """vLLM's prefix cache finds an episode's earlier turns by itself; nothing is held per episode."""

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, source: WeightSource | None = None) -> bool:
        """Push newer weights to the server now (blocking; the poller calls it off the event loop)."""
        source = source or self.weight_source
        if source is None or source.poll(self.version) is None:
            return False
        t0 = time.perf_counter()
        with torch.no_grad():
            version = source.load_into([p.data for p in self.model.parameters()])
        self._post("/pause", params={"mode": "keep", "clear_cache": str(self.cfg.recompute_after_swap).lower()})
        try:
            if self.cfg.weight_transport == "ipc":
                self._send_ipc()
            else:
                self._reload()
            self._label(version)
        finally:
            self._post("/resume")
        self.version = version
        self.stats["weight_swaps"] += 1
        self.stats["weight_update_ms"] = (time.perf_counter() - t0) * 1000
        return True

    def _reload(self) -> None:
        """safetensors on /dev/shm, reloaded in place by the server (the CPU transport)."""
        target = self._shm / "current"
        tmp = self._shm / "next"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        self._post("/collective_rpc", json={"method": "sao_reload", "kwargs": {"weights_path": str(target)}})

    def _send_ipc(self) -> None:
        """CUDA IPC handles of GPU copies of the weights (vLLM's `ipc` backend; server on the same GPU)."""
        from sao.engine.vllm_ipc import ipc_update_info

        self._ipc_refs, info = ipc_update_info(self.model)  # the copies must outlive the update
        self._post("/start_weight_update")
        self._post("/update_weights", json={"update_info": info})
        self._post("/finish_weight_update", json={})

    async def _poll_weights(self) -> None:
        while True:
            await asyncio.sleep(WEIGHT_POLL_S)
            if self.weight_source is None or self.weight_source.poll(self.version) is None:
                continue
            try:
                async with self._restart_lock:
                    await asyncio.to_thread(self.update_weights)
            except EngineError:
                await self._ensure_server()  # a dead server gets the new weights when it is back

    # -- failures ---------------------------------------------------------------------------
    async def _ensure_server(self) -> None:
        """Restart a server sao started that has exited, then give it the current weights."""
        if self.server is None or (self.server.alive() and not self._restarting):
            return
        async with self._restart_lock:  # requests wait here while another one restarts the server
            if self.server.alive():
                return
            if self.stats["restarts"] >= self.cfg.max_restarts:
                raise EngineError(f"vLLM server died {self.stats['restarts'] + 1} times "
                                  f"(engine.max_restarts={self.cfg.max_restarts}): {self.server.log_tail()}")
            self.stats["restarts"] += 1
            self._restarting = True
            try:
                self.server.stop()
                self.server.start()  # from the event-loop thread: the server's parent-death signal follows it
                await asyncio.to_thread(self.server.wait_healthy, self.cfg.startup_timeout_s)
                await asyncio.to_thread(self._restore)
            finally:
                self._restarting = False

    def _restore(self) -> None:
        if self.cfg.weight_transport == "ipc":
            self._post("/init_weight_transfer_engine", json={"init_info": {"packed": False}})
            self._send_ipc()
        else:
            self._reload()
        self._label(self.version)

    async def close(self) -> None:
        """This event loop is done with the engine (the server keeps running: `shutdown` stops it)."""
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if self._client is not None:
            try:
                await self._client.aclose()
            except RuntimeError:  # its event loop is gone already
                pass
            self._client = None

    def shutdown(self) -> None:
        """Stop a server sao started and remove the weight files (also at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_http"):
            self._http.close()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self._shm, ignore_errors=True)
