"""The step-0 parity gate: engine and trainer log-probs must agree, or the run refuses to start."""

import pytest
import torch

from sao.engine.torch_engine import TorchEngine
from sao.envs import make_environment
from sao.models.tiny import load_model
from sao.rollout.agent_loop import EpisodeLimits
from sao.runtime.parity import ParityError, parity_check
from sao.runtime.weight_sync import SharedWeights


def _engine(engine_model, codec):
    return TorchEngine(engine_model, codec.tokenizer.pad_token_id, max_batch=16, seed=0)


def _trainer(model):
    """The trainer side of the gate: the seam's logprobs (sao/trainer/protocol.py) on `model`."""
    from sao.algo.registry import get_algorithm
    from sao.config import AlgoConfig, CriticConfig, TrainConfig
    from sao.trainer.learner import Learner

    return Learner(model, None, get_algorithm("running_mean"), AlgoConfig(), CriticConfig(), TrainConfig())


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
    diff = parity_check(_trainer(model), _engine(engine_model, codec), codec, env, EpisodeLimits(max_action_tokens=12), tol=1e-4)
    assert diff <= 1e-4


def test_gate_says_why_when_no_episode_sampled_a_token(tiny, tiny_model_dir):
    """Prompts longer than rollout.max_episode_tokens: no episode samples anything; the gate used to die in
    collate with `max() arg is an empty sequence`."""
    model, codec = tiny
    env = make_environment("calc", {}, seed=0)
    with pytest.raises(ParityError, match=r"none of 16 episodes sampled a token \(env_error: \d+ tokens, over "
                                          r"rollout.max_episode_tokens=8\)"):
        parity_check(_trainer(model), _engine(load_model(tiny_model_dir), codec), codec, env,
                     EpisodeLimits(max_action_tokens=4, max_episode_tokens=8), tol=1e-4)


def test_gate_refuses_when_engine_and_trainer_disagree(tiny, tiny_model_dir):
    model, codec = tiny
    engine_model = load_model(tiny_model_dir)
    with torch.no_grad():
        engine_model.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # a 1% drift, e.g. a botched sync
    env = make_environment("calc", {}, seed=0)
    with pytest.raises(ParityError, match="refusing to train"):
        parity_check(_trainer(model), _engine(engine_model, codec), codec, env, EpisodeLimits(max_action_tokens=12), tol=1e-4)


def _engine_batch(model, engine_model, codec, n=8):
    """n calc episodes sampled by a torch engine on `engine_model`, collated for the learner."""
    from sao.runtime.episodes import generate_batch
    from sao.trainer.batch import collate
    from sao.types import SamplingParams

    env = make_environment("calc", {}, seed=0)
    engine = TorchEngine(engine_model, codec.tokenizer.pad_token_id, max_batch=n, seed=0)
    trajs = generate_batch(engine, env, codec, iter(env.eval_tasks(n)), EpisodeLimits(max_action_tokens=12), n,
                           SamplingParams())
    return collate([t for t in trajs if t.num_action_tokens], codec.tokenizer.pad_token_id)


@pytest.mark.parametrize("algo", ["sao", "vapo"])
def test_live_parity_on_tokens_of_the_current_weights(tiny, tiny_model_dir, algo):
    """Every actor step reports engine vs trainer on the tokens sampled with the weights it holds:
    numerical noise for a faithful engine (DIS and PPO paths alike), nothing once weights moved on."""
    from sao.algo.registry import get_algorithm
    from sao.config import AlgoConfig, CriticConfig, TrainConfig
    from sao.models.critic import build_critic
    from sao.trainer.learner import Learner

    model, codec = tiny
    batch = _engine_batch(model, model, codec)  # the untrained model's rewards are all 0: train anyway
    critic = build_critic(tiny_model_dir) if get_algorithm(algo).uses_critic else None
    learner = Learner(model, critic, get_algorithm(algo), AlgoConfig(skip_uniform_rewards=False), CriticConfig(warmup_steps=0),
                      TrainConfig(lr=1e-3))
    m = learner.step(batch)
    assert m["parity/live_tokens"] == float(batch.action_mask.sum())
    assert m["parity/live_max_abs_diff"] <= 1e-4
    assert learner.actor_version == 1
    assert "parity/live_max_abs_diff" not in learner.step(batch)  # version-0 tokens, version-1 weights


def test_live_parity_sees_an_engine_on_other_weights(tiny, tiny_model_dir):
    """The check the vLLM engine is gated by in `sao train`: an engine whose weights drifted (a botched
    transfer, a stale tied head) shows up on the first step, and the run refuses to go on."""
    from sao.algo.registry import get_algorithm
    from sao.config import AlgoConfig, CriticConfig, TrainConfig, load_config
    from sao.models.critic import build_critic
    from sao.runtime.parity import LiveParity
    from sao.trainer.learner import Learner

    model, codec = tiny
    engine_model = load_model(tiny_model_dir)
    with torch.no_grad():
        engine_model.model.layers[0].mlp.up_proj.weight.mul_(1.1)
    batch = _engine_batch(model, engine_model, codec)
    learner = Learner(model, build_critic(tiny_model_dir), get_algorithm("sao"), AlgoConfig(skip_uniform_rewards=False),
                      CriticConfig(warmup_steps=0), TrainConfig(lr=1e-3))
    m = learner.step(batch)
    assert m["parity/live_max_abs_diff"] > 1e-3
    with pytest.raises(ParityError, match="engine.name=vllm .* refusing to train on"):
        LiveParity(load_config(None, ["engine.name=vllm"]))(m)
    LiveParity(load_config(None, []))(m)  # the torch engine is gated at step 2 instead
