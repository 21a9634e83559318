"""The built-in character-level tokenizer: exact round trips, tool tags as single tokens.

Built with `tokenizers` (a WordLevel model over single characters) and saved as `tokenizer.json`
with a chat template, so any HF code can load it. Loading goes through `PreTrainedTokenizerFast`
directly: `AutoTokenizer` on some model folders swaps in the architecture's own tokenizer class and
silently drops spaces and newlines of a character vocabulary (field-notes.md).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
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


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + TAG_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char each
    tok.decoder = decoders.Fuse()  # join without spaces
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


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a model folder; the built-in one always as PreTrainedTokenizerFast."""
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
