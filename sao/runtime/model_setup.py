"""The starting policy: a local HF model, or the built-in tiny model warm-started by SFT.

The built-in model is cached on disk under a hash of everything that shapes it (model config, SFT
config, environment and its options), so the second run starts at once. It is written to a
temporary folder and renamed into place, so an interrupted SFT never leaves a half-written cache.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

from sao.config import Config, ConfigError
from sao.envs import make_environment
from sao.envs.latency import LatencyOptions
from sao.models.chat import ChatCodec
from sao.models.tiny import build_tiny_model, load_model
from sao.models.tokenizer import load_tokenizer
from sao.runtime.preflight import model_path_of
from sao.trainer.sft import Example, sft_train

SFT_FORMAT = 2  # bump when the demo tokenization, SFT recipe or held-out split changes (2: split by data_seed)


def demo_example(codec: ChatCodec, messages: list[dict[str, str]]) -> Example:
    """Token ids and loss mask of a solved episode, built exactly as the agent loop builds them."""
    first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = codec.prompt_ids(messages[:first_reply])
    mask = [0] * len(ids)
    for m in messages[first_reply:]:
        piece = codec.action_ids(m["content"]) if m["role"] == "assistant" else codec.observation_ids(m["content"], m["role"])
        ids += piece
        mask += [1 if m["role"] == "assistant" else 0] * len(piece)
    return ids, mask


def base_model_key(cfg: Config) -> str:
    # the latency knobs only delay environment steps: the same demos, so the same SFT model (an experiment
    # with tool latency must not rebuild it)
    env = cfg.env.model_dump()
    env["options"] = {k: v for k, v in env["options"].items() if k not in LatencyOptions.model_fields}
    blob = json.dumps({"fmt": SFT_FORMAT, "model": cfg.model.model_dump(exclude={"path", "cache_dir", "lora"}),
                       "sft": cfg.sft.model_dump(), "env": env}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_base_model(cfg: Config, on_step: Callable[[int, float], None] | None = None,
                       force: bool = False) -> tuple[Path, bool]:
    """Return (path, built_now). Builds and SFT-trains the tiny model on a cache miss."""
    user = model_path_of(cfg)
    if user is not None:
        return user, False
    out = Path(cfg.model.cache_dir) / f"tiny-{base_model_key(cfg)}"
    if (out / "sft.json").is_file() and not force:
        return out, False
    # demos drawn with sft.seed: the cached model must not depend on the train.seed of the run that built it
    environment = make_environment(cfg.env.name, cfg.env.options, cfg.sft.seed)
    if not hasattr(environment, "demo"):
        raise ConfigError(f"env.name: environment {cfg.env.name!r} has no demo() for the SFT warm start; "
                          "give model.path")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    m = cfg.model
    build_tiny_model(tmp, m.arch, m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size,
                     m.max_positions, seed=cfg.sft.seed)
    model, codec = load_model(tmp), ChatCodec(load_tokenizer(tmp))
    tasks = environment.train_tasks()

    def sample(rng: random.Random) -> Example:
        return demo_example(codec, environment.demo(next(tasks), rng))

    losses = sft_train(model, sample, cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr,
                       codec.tokenizer.pad_token_id, cfg.sft.seed, on_step)
    model.save_pretrained(tmp)
    (tmp / "sft.json").write_text(json.dumps({"steps": cfg.sft.steps, "final_loss": losses[-1] if losses else None,
                                              "key": base_model_key(cfg)}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, True
