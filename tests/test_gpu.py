"""What only a CUDA GPU can show (marker `gpu`; skipped without one, so CI and CPU machines pass them by).
benchmarks/gpu_check.sh runs them on a lent GPU (`pytest -m gpu`): device placement, bf16 autocast over
float32 master weights on the GPU, the torch engine's bf16 log-probs against the trainer's, CUDA-IPC weight
handles read by another process, and LoRA on CUDA. The same code paths on CPU: tests/test_device.py.
`SAO_GPU_TEST_DEVICE=cpu` runs them on the CPU instead (all but the CUDA-IPC one): how gpu_check.sh --device
cpu checks the tests themselves on a machine without a GPU."""

import copy
import os

import pytest
import torch
from test_learner import _batch  # two on-policy trajectories

from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, LoraSettings, TrainConfig
from sao.device import autocast, to_device
from sao.models.critic import build_critic
from sao.trainer.learner import Learner

CUDA = torch.device(os.environ.get("SAO_GPU_TEST_DEVICE", "cuda:0"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]


def test_a_bf16_step_on_the_gpu_keeps_float32_master_weights_there(tiny, tiny_model_dir):
    model, codec = tiny
    actor, critic = copy.deepcopy(model).to(CUDA), build_critic(tiny_model_dir).to(CUDA)
    learner = Learner(actor, critic, get_algorithm("sao"), AlgoConfig(), CriticConfig(warmup_steps=0),
                      TrainConfig(lr=1e-3), dtype=torch.bfloat16)
    batch = _batch(codec, model)  # behavior log-probs from the fp32 CPU model
    assert learner.device == CUDA
    with autocast(learner.device, torch.bfloat16):
        assert actor(input_ids=batch.input_ids.to(CUDA)).logits.dtype == torch.bfloat16
    m = learner.step(batch)
    params = list(actor.parameters()) + list(critic.parameters())
    assert all(p.device == CUDA and p.dtype == torch.float32 for p in params)
    assert all(s["exp_avg"].device == CUDA for s in learner.actor_opt.state.values())
    assert learner.actor_version == 1 and all(torch.isfinite(torch.tensor(v)) for v in m.values() if isinstance(v, float))
    assert m["dis/masked_low_frac"] == 0.0 and m["dis/masked_high_frac"] == 0.0
    assert abs(m["dis/ratio_mean"] - 1.0) < 1e-2, m["dis/ratio_mean"]


def test_the_bf16_torch_engine_on_the_gpu_matches_the_trainer(tiny):
    """The engine's recorded log-probs of what it sampled against the trainer's forward of the same tokens
    (fp32 weights, bf16 autocast): within the bound measured on CPU (1.4e-3 nats; tests/test_engine.py)."""
    import asyncio

    from sao.engine.torch_engine import TorchEngine
    from sao.models.actor import sequence_logprobs
    from sao.types import SamplingParams

    model, codec = tiny
    gpu = copy.deepcopy(model).to(CUDA)
    engine = TorchEngine(gpu, pad_id=codec.tokenizer.pad_token_id, dtype=torch.bfloat16, seed=0)
    prompt = codec.prompt_ids([{"role": "user", "content": "2+3"}])

    async def go():
        return await asyncio.gather(*(engine.generate(prompt, SamplingParams(max_new_tokens=16)) for _ in range(4)))

    worst = 0.0
    for out in asyncio.run(go()):
        ids = torch.tensor([prompt + out.token_ids], device=CUDA)
        with torch.no_grad(), autocast(CUDA, torch.bfloat16):
            lp = sequence_logprobs(gpu, ids, torch.ones_like(ids))[0, len(prompt):].float().cpu()  # at each token
        worst = max(worst, float((lp - torch.tensor(out.logprobs)).abs().max()))
    assert worst < 1e-2, worst


def _read_handles(handles: list, out) -> None:
    """Another process: rebuild each tensor from its CUDA IPC handle (as vLLM's receiver does) and sum it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    out.put([float(rebuild_cuda_tensor(*h[uuid]).double().sum()) for h in handles])


def test_cuda_ipc_weight_handles_are_read_by_another_process(tiny):
    """engine.weight_transport=ipc (sao/engine/vllm_ipc.py): the handles sao sends to a vLLM server on the same
    GPU map the trainer's weights in another process, no host copy; the values read there are the weights."""
    import base64
    import pickle

    import torch.multiprocessing as mp

    from sao.engine.vllm_ipc import ipc_update_info

    if not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs a CUDA GPU")
    model, _ = tiny
    refs, info = ipc_update_info(model)
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    assert info["names"] == [n for n, _ in model.named_parameters()] and len(refs) == len(handles)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_read_handles, args=(handles, queue))
    proc.start()
    sums = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    expected = [float(p.detach().double().sum()) for p in model.parameters()]
    assert sums == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_lora_actor_and_critic_train_on_the_gpu_and_export_merged(tiny, tiny_model_dir):
    from sao.models.lora import engine_parameters, with_lora

    model, codec = tiny
    torch.manual_seed(0)
    actor = with_lora(copy.deepcopy(model), LoraSettings(r=4)).to(CUDA)
    critic = with_lora(build_critic(tiny_model_dir), LoraSettings(r=4), value_head=True).to(CUDA)
    learner = Learner(actor, critic, get_algorithm("sao"), AlgoConfig(), CriticConfig(warmup_steps=0),
                      TrainConfig(lr=1e-2), dtype=torch.bfloat16)
    before = [t.detach().clone() for t in engine_parameters(actor)]
    batch = to_device(_batch(codec, model), torch.device("cpu"))
    learner.step(batch)
    after = learner.export_weights()
    assert len(after) == len(before) and all(t.device == CUDA for t in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the merged weights moved
    trained = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
