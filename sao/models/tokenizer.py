"""The built-in character-level tokenizer: exact round trips, tool tags as single tokens.

A byte-level BPE with no merges over the printable ASCII characters (one token per character, in
GPT-2's byte-to-unicode spelling: space is `Ġ`, newline `Ċ`), saved as `tokenizer.json` with a chat
template. The byte-level spelling is what makes it load right everywhere: `AutoTokenizer` on a
Qwen2 folder ignores `tokenizer.json`'s pre-tokenizer and rebuilds Qwen2's own byte-level BPE around
the saved vocabulary, so a plain character vocabulary lost every space and newline that way; this
one decodes to the same text through `AutoTokenizer` and `PreTrainedTokenizerFast` alike
(tests/test_models.py). Token ids are the same as the earlier WordLevel vocabulary's, so cached
models keep working.

`build_bpe_tokenizer` (`model.tokenizer=bpe`) learns merges over every byte from an environment's
training texts: words and the numbers of a numbered command list become one token each, so an episode is
~4x shorter than in characters and a tiny model matches whole words. Still byte-level, so every text round
trips, and the same texts give the same vocabulary in every process.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, IM_END]
# Tags the built-in environments use, one token each (as real chat models have tool-call tokens).
TAG_TOKENS = [
    "<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>",
    "<run_tests>", "<submit>", "<style>", "</style>",
]
CHARS = [c for c in string.printable if c not in "\x0b\x0c"]

# ChatML: an assistant turn ends with <|im_end|>, the engine's stop token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the spelling of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    spelled = byte_to_unicode()
    chars = [spelled[ord(c)] for c in CHARS]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + TAG_TOKENS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=PAD))  # no merges: one token per character
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TAG_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=IM_END,
        unk_token=PAD,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens (special and tag tokens included) trained on `texts`; the
    character tokenizer's special tokens, tags and chat template. Deterministic for the same texts."""
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # words, numbers apart
    tok.decoder = decoders.ByteLevel()
    # every byte in the alphabet, so any text encodes
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + TAG_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TAG_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=IM_END,
                                   unk_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a model folder; the built-in one as PreTrainedTokenizerFast (folders cached
    before the byte-level vocabulary hold a WordLevel tokenizer that only loads right that way)."""
    path = Path(path)
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.exists():
        cfg = json.loads(cfg_file.read_text())
        if cfg.get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            tok = PreTrainedTokenizerFast.from_pretrained(str(path))
            if tok.chat_template is None:
                tok.chat_template = CHAT_TEMPLATE
            return tok
    return AutoTokenizer.from_pretrained(str(path))
