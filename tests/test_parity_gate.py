"""The step-0 parity gate: engine and trainer log-probs must agree, or the run refuses to start."""

import pytest
import torch

from sao.envs import make_environment
from sao.models.tiny import load_model
from sao.rollout.agent_loop import EpisodeLimits
from sao.runtime.train import ParityError, parity_check
from sao.runtime.weight_sync import SharedWeights


def test_gate_passes_when_weights_travel_through_shared_memory(tiny, tiny_model_dir):
    model, codec = tiny
    engine_model = load_model(tiny_model_dir)
    with torch.no_grad():  # the trainer's weights differ from the checkpoint on disk ...
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    weights = SharedWeights.for_model(model)  # ... and reach the engine through the real transport
    weights.publish(list(model.parameters()), 0)
    weights.load_into([p.data for p in engine_model.parameters()])
    env = make_environment("calc", {}, seed=0)
    diff = parity_check(model, engine_model, codec, env, EpisodeLimits(max_action_tokens=12), tol=1e-4)
    assert diff <= 1e-4


def test_gate_refuses_when_engine_and_trainer_disagree(tiny, tiny_model_dir):
    model, codec = tiny
    engine_model = load_model(tiny_model_dir)
    with torch.no_grad():
        engine_model.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # a 1% drift, e.g. a botched sync
    env = make_environment("calc", {}, seed=0)
    with pytest.raises(ParityError, match="refusing to train"):
        parity_check(model, engine_model, codec, env, EpisodeLimits(max_action_tokens=12), tol=1e-4)
