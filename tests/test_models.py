"""Tokenizer round trips, chat-template codec, critic construction and freezing."""

import pytest
import torch

from sao.models.chat import ChatCodec
from sao.models.critic import build_critic, critic_values, freeze_parameters
from sao.models.tokenizer import build_char_tokenizer, load_tokenizer
from sao.runtime.model_setup import demo_example


def test_char_tokenizer_round_trips_spaces_newlines_and_tags(tiny_model_dir):
    text = "What is 2 + 3?\n\t<calc>37*12</calc>  <result>444</result>\n"
    for tok in (build_char_tokenizer(), load_tokenizer(tiny_model_dir)):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert len(tok.encode("<calc>", add_special_tokens=False)) == 1  # tool tags are one token


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_built_in_tokenizer_round_trips_through_auto_tokenizer(tmp_path, arch):
    """AutoTokenizer on a Qwen2 folder rebuilds Qwen2's own tokenizer around the saved vocabulary; the
    built-in vocabulary must still decode to the same text (spaces, newlines, tabs, tags)."""
    from transformers import AutoTokenizer

    from sao.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / arch, arch=arch, hidden_size=16, num_layers=1, num_heads=2,
                              intermediate_size=16)
    text = "What is 2 + 3?\n\t<calc>37*12</calc>  <result>444</result>\n<answer>449</answer>"
    reference = build_char_tokenizer().encode(text, add_special_tokens=False)
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and ids == reference
    assert tok.eos_token == "<|im_end|>" and tok.chat_template is not None


def test_observation_tokens_follow_the_chat_template(tiny_model_dir):
    codec = ChatCodec(load_tokenizer(tiny_model_dir))
    conv = [{"role": "user", "content": "2+3"}]
    prompt = codec.prompt_ids(conv)
    action = codec.action_ids("<calc>2+3</calc>")
    obs = codec.observation_ids("<result>5</result>")
    # appending tokens turn by turn gives exactly the template's rendering of the whole conversation
    full = conv + [{"role": "assistant", "content": "<calc>2+3</calc>"}, {"role": "tool", "content": "<result>5</result>"}]
    assert prompt + action + obs == codec.prompt_ids(full)
    assert codec.decode(obs) == "\n<|im_start|>tool\n<result>5</result><|im_end|>\n<|im_start|>assistant\n"
    assert codec.action_text(action) == "<calc>2+3</calc>"


def test_demo_example_masks_only_assistant_tokens(tiny_model_dir):
    codec = ChatCodec(load_tokenizer(tiny_model_dir))
    msgs = [{"role": "user", "content": "7*8"}, {"role": "assistant", "content": "<calc>7*8</calc>"},
            {"role": "tool", "content": "<result>56</result>"}, {"role": "assistant", "content": "<answer>56</answer>"}]
    ids, mask = demo_example(codec, msgs)
    acted = codec.decode([i for i, m in zip(ids, mask) if m])
    assert acted == "<calc>7*8</calc><|im_end|><answer>56</answer><|im_end|>"
    assert codec.decode(ids) == codec.render(msgs, add_generation_prompt=False).rstrip("\n")


def test_critic_starts_at_zero_and_freezes_attention(tiny_model_dir):
    critic = build_critic(tiny_model_dir)
    ids = torch.tensor([[1, 5, 6, 7]])
    v = critic_values(critic, ids, torch.ones_like(ids))
    assert v.shape == (1, 4) and torch.all(v == 0)  # zero-initialized value head
    n = freeze_parameters(critic, r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.")
    assert n == 2 * 4  # 2 layers x 4 projections (no biases in Llama attention)
    frozen = {name for name, p in critic.named_parameters() if not p.requires_grad}
    assert all("self_attn" in name for name in frozen)
    assert critic.score.weight.requires_grad and critic.model.layers[0].mlp.up_proj.weight.requires_grad


def test_freeze_pattern_that_matches_nothing_is_an_error(tiny_model_dir):
    with pytest.raises(ValueError, match="matches no parameter"):
        freeze_parameters(build_critic(tiny_model_dir), r"attention\.query")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_critic_of_the_actors_first_layers(tmp_path, arch):
    """critic.num_layers=1 keeps the actor's first decoder layer, weights and all; saved, it reloads as it
    is (a saved critic keeps its depth whatever num_layers says)."""
    from sao.models.critic import load_critic
    from sao.models.tiny import build_tiny_model, load_model

    path = build_tiny_model(tmp_path / arch, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64,
                            max_positions=64, seed=0, arch=arch)
    actor = load_model(path)
    critic = build_critic(path, num_layers=1)
    assert len(critic.model.layers) == 1 and critic.config.num_hidden_layers == 1
    for (name, p), q in zip(critic.model.layers[0].named_parameters(), actor.model.layers[0].parameters()):
        assert torch.equal(p, q), name
    assert sum(p.numel() for p in critic.parameters()) < sum(p.numel() for p in build_critic(path).parameters())
    critic.save_pretrained(tmp_path / "critic")
    again = load_critic(tmp_path / "critic", num_layers=2)
    assert len(again.model.layers) == 1
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(critic_values(critic, ids, None), critic_values(again, ids, None))


# -- model.tokenizer=bpe ---------------------------------------------------------------------------
_BPE_TEXTS = ["<|im_start|>user\nYou are in the kitchen. To the North you see the pantry.\ncan: 1 move east, "
              f"2 move north, 3 take coin<|im_end|>\n<|im_start|>assistant\n{k % 3 + 1}<|im_end|>\n" for k in range(40)]


def test_bpe_tokenizer_keeps_words_whole_and_round_trips_any_text(tmp_path):
    from sao.models.tiny import build_tiny_model
    from sao.models.tokenizer import build_bpe_tokenizer

    tok = build_bpe_tokenizer(_BPE_TEXTS, 400)
    folder = build_tiny_model(tmp_path / "m", hidden_size=16, num_layers=1, num_heads=2, intermediate_size=16,
                              tokenizer=tok)
    loaded = load_tokenizer(folder)
    assert loaded.convert_ids_to_tokens(loaded.encode(" move north, 2", add_special_tokens=False)) == [
        "Ġmove", "Ġnorth", ",", "Ġ2"]  # a word (and a number) is one token
    for text in ("héllo ünïcode ²\x00 \t end\n", "<calc>37*12</calc>  <result>444</result>", _BPE_TEXTS[0]):
        assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text  # bytes never seen: still exact
    assert len(loaded.encode("<calc><|im_end|>", add_special_tokens=False)) == 2  # tags and specials: one token
    codec = ChatCodec(loaded)
    assert codec.eos_text == "<|im_end|>" and codec.action_text(codec.action_ids("2")) == "2"
    from transformers import AutoTokenizer  # what vLLM loads: the same tokens (a qwen2 folder would not be)

    text = _BPE_TEXTS[0] + " 12 34 héllo"
    assert AutoTokenizer.from_pretrained(str(folder)).encode(text, add_special_tokens=False) == loaded.encode(
        text, add_special_tokens=False)
    from sao.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="tokenizer=bpe needs arch=llama"):
        load_config(None, ["model.tokenizer=bpe", "model.arch=qwen2"])


def test_bpe_tokenizer_is_the_same_in_every_process(tmp_path):
    """The SFT cache key holds the settings, not the vocabulary: two processes (string hashing seeded
    differently) must learn the same merges from the same texts."""
    import json
    import os
    import subprocess
    import sys

    script = ("import json, sys; from sao.models.tokenizer import build_bpe_tokenizer; "
              "texts = json.loads(sys.stdin.read()); "
              "print(build_bpe_tokenizer(texts, 400).backend_tokenizer.to_str())")
    out = [subprocess.run([sys.executable, "-c", script], input=json.dumps(_BPE_TEXTS), capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
           for seed in ("1", "2")]
    assert out[0] == out[1] and '"Ġnorth"' in out[0]


def test_a_bpe_model_is_sft_trained_on_shorter_episodes_under_its_own_cache_key(tmp_path):
    import random

    from sao.config import load_config
    from sao.envs import make_environment
    from sao.runtime.model_setup import base_model_key, prepare_base_model

    small = ["sft.steps=2", "sft.batch_size=2", "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1",
             "model.intermediate_size=64", f"model.cache_dir={tmp_path}"]
    char, bpe = load_config(None, small), load_config(None, [*small, "model.tokenizer=bpe", "model.bpe_vocab_size=400"])
    assert base_model_key(char) != base_model_key(bpe)
    path, built = prepare_base_model(bpe)
    assert built and len(load_tokenizer(path)) == 400
    env = make_environment(bpe.env.name, bpe.env.options, 0)
    demo = env.demo(next(env.train_tasks()), random.Random(0))
    lengths = [len(demo_example(ChatCodec(t), demo)[0]) for t in (build_char_tokenizer(), load_tokenizer(path))]
    assert lengths[1] < 0.7 * lengths[0], lengths
