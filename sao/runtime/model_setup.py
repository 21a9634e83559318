"""The starting policy: a local HF model, or the built-in tiny model warm-started by SFT.

The built-in model is cached on disk under a hash of everything that shapes it (model config, SFT
config, environment and its options), so the second run starts at once.

    .sao_cache/tiny-<key>/        the model, its tokenizer, and sft.json (written last: the manifest)
    .sao_cache/tiny-<key>.lock    held (flock) by the one process building that entry

An entry is built by one process at a time: a second run with the same config waits on the lock
and then uses what the first built. It is built in a folder of its own, fsynced, and renamed into
place, so an interrupted SFT leaves no half-written entry. A hit is an entry whose every file in the
manifest is there with its recorded size; anything else (an entry an older sao left without its
tokenizer, a file truncated) is rebuilt, with a message.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from sao.config import Config, ConfigError
from sao.envs import make_environment
from sao.envs.latency import LatencyOptions
from sao.models.chat import ChatCodec
from sao.models.tiny import build_tiny_model, load_model
from sao.models.tokenizer import load_tokenizer
from sao.runtime.preflight import model_path_of
from sao.runtime.run_dir import fsync_tree, write_failure
from sao.runtime.threads import ThreadPlan, spinning_env
from sao.trainer.sft import Example, sft_train

# bump when the demo tokenization, SFT recipe, held-out split or an env's demos change
# (2: split by data_seed; 3: textworld facts sorted)
SFT_FORMAT = 3


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


def cache_entry_problem(path: Path) -> str | None:
    """Why the cache entry at `path` cannot be used, or None when every file of its manifest is there."""
    try:
        manifest = json.loads((path / "sft.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest (sft.json)"
    for name, size in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
    return None


def prepare_base_model(cfg: Config, on_step: Callable[[int, float], None] | None = None,
                       force: bool = False, log: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """Return (path, built_now). Builds and SFT-trains the tiny model on a cache miss (one builder at a
    time per entry: see the module docstring)."""
    user = model_path_of(cfg)
    if user is not None:
        return user, False
    log = log or (lambda message: print(f"sao: {message}", file=sys.stderr))
    out = Path(cfg.model.cache_dir) / f"tiny-{base_model_key(cfg)}"
    if not force and cache_entry_problem(out) is None:
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another sao process building the SFT model {out}")
            fcntl.flock(lock, fcntl.LOCK_EX)
            force = False  # what that process built is this config's model: use it
        problem = cache_entry_problem(out)
        if problem is None and not force:
            return out, False
        if out.exists() and problem is not None:
            log(f"SFT cache entry {out} is unusable ({problem}); rebuilding it")
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
        try:
            _build_entry(cfg, tmp, on_step)
            fsync_tree(tmp)
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=out.name + ".old-", dir=out.parent))
                os.replace(out, old / "entry")
                shutil.rmtree(old)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out, True


def _build_entry(cfg: Config, tmp: Path, on_step) -> None:
    """`_build` here, or in a child interpreter that spins (an async run's PASSIVE OpenMP policy is read
    once, when torch loads, and makes SFT ~1.3x slower: sao/runtime/threads.py). The child only writes
    into `tmp`; the lock, the checks and the rename stay here, so the cache is as safe either way. A
    plain `python -c` child, not multiprocessing's spawn, which would re-run a user's unguarded script."""
    env = spinning_env()
    if env is None:
        _build(cfg, tmp, on_step)
        return
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this process's sao, wherever it came from
    child = subprocess.Popen([sys.executable, "-c", "from sao.runtime.model_setup import build_child; build_child()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        child.stdin.write(pickle.dumps((cfg, str(tmp))))
        child.stdin.close()
        for line in child.stdout:  # one pickled, hex-encoded message per line
            kind, *rest = pickle.loads(bytes.fromhex(line.decode()))
            if kind == "step" and on_step is not None:
                on_step(*rest)
            elif kind == "error":
                raise rest[0]
            elif kind == "done":
                return
        raise RuntimeError(f"the SFT build process died (exit code {child.wait()})")  # killed: OOM, a signal
    finally:  # also on Ctrl-C here: the child ignores SIGINT and is stopped by this process
        if child.poll() is None:
            child.terminate()
        child.wait()
        child.stdout.close()


def build_child() -> None:
    """The child of `_build_entry`: (config, folder) pickled on stdin; steps, then done or the error, on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what a Ctrl-C does
    cfg, tmp = pickle.loads(sys.stdin.buffer.read())
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the messages

    def send(*message) -> None:
        channel.write(pickle.dumps(message).hex() + "\n")
        channel.flush()

    from sao.models.quiet import quiet_transformers

    quiet_transformers()
    ThreadPlan(cfg.runtime).setup()  # the parent's setup phase: nothing else runs yet
    try:
        _build(cfg, Path(tmp), lambda step, loss: send("step", step, loss))
    except BrokenPipeError:  # the parent is gone
        return
    except BaseException as exc:  # noqa: BLE001 - raised again in the parent, as if the build ran there
        try:
            send("error", exc)
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            send("error", RuntimeError(f"SFT build: {type(exc).__name__}: {exc}"))
        return
    send("done")


def demo_tasks(environment):
    """The tasks the SFT warm start learns from: the environment's demo_tasks() where it keeps some apart from
    RL's (textworld's sft_games), else its training stream."""
    return environment.demo_tasks() if hasattr(environment, "demo_tasks") else environment.train_tasks()


BPE_DEMOS = 512  # training demonstrations a model.tokenizer=bpe vocabulary is learned from


def bpe_from_demos(environment, vocab_size: int, seed: int):
    """model.tokenizer=bpe: a byte-level BPE learned from the chat-rendered demonstrations of the first
    BPE_DEMOS tasks of the SFT's stream (a game repeats after its split's size; held-out tasks are never read)."""
    from sao.models.tokenizer import build_bpe_tokenizer, build_char_tokenizer

    render, rng, tasks = build_char_tokenizer().apply_chat_template, random.Random(seed), demo_tasks(environment)
    texts = [render(environment.demo(next(tasks), rng), tokenize=False) for _ in range(BPE_DEMOS)]
    return build_bpe_tokenizer(texts, vocab_size)


def _build(cfg: Config, tmp: Path, on_step) -> None:
    """The tiny model, SFT-trained, into `tmp`; sft.json (the manifest of every other file) last."""
    # demos drawn with sft.seed: the cached model must not depend on the train.seed of the run that built it
    environment = make_environment(cfg.env.name, cfg.env.options, cfg.sft.seed)
    if not hasattr(environment, "demo"):
        raise ConfigError(f"env.name: environment {cfg.env.name!r} has no demo() for the SFT warm start; "
                          "give model.path")
    m = cfg.model
    tokenizer = bpe_from_demos(environment, m.bpe_vocab_size, cfg.sft.seed) if m.tokenizer == "bpe" else None
    try:
        build_tiny_model(tmp, m.arch, m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size,
                         m.max_positions, seed=cfg.sft.seed, tokenizer=tokenizer)
    except Exception as exc:  # a full disk: OSError, or safetensors' own error
        raise write_failure(f"SFT cache entry {tmp}", exc) from None
    model, codec = load_model(tmp), ChatCodec(load_tokenizer(tmp))
    tasks = demo_tasks(environment)

    def sample(rng: random.Random) -> Example:
        return demo_example(codec, environment.demo(next(tasks), rng))

    losses = sft_train(model, sample, cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr,
                       codec.tokenizer.pad_token_id, cfg.sft.seed, on_step, cfg.sft.pack)
    try:
        model.save_pretrained(tmp)
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / "sft.json").write_text(json.dumps({"steps": cfg.sft.steps, "final_loss": losses[-1] if losses else None,
                                                  "key": base_model_key(cfg), "files": files}))
    except Exception as exc:
        raise write_failure(f"SFT cache entry {tmp}", exc) from None
