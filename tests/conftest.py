import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialized built-in model (Llama architecture, char tokenizer), built once."""
    from sao.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, num_heads=2,
                            intermediate_size=64, max_positions=256, seed=0)


@pytest.fixture()
def tiny(tiny_model_dir):
    from sao.models.chat import ChatCodec
    from sao.models.tiny import load_model
    from sao.models.tokenizer import load_tokenizer

    torch.manual_seed(0)
    return load_model(tiny_model_dir), ChatCodec(load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="session")
def ray_address():
    """One local Ray cluster for the whole test run (small object store); CLI runs join it with
    runtime.ray_address, so each test pays for actors, not for starting Ray."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False,
             logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def pytest_terminal_summary(terminalreporter):
    """Say why the real-vLLM tests did not run (CI installs the vLLM environment, so they should)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "vllm" in getattr(r, "keywords", {})]
    if skipped:
        reason = skipped[0].longrepr[2] if isinstance(skipped[0].longrepr, tuple) else ""
        terminalreporter.write_line(f"vllm: {len(skipped)} real-vLLM tests skipped: {reason}")
