"""Chat-template codec: messages -> prompt token ids, tool observations -> token ids to append.

Tokens in, tokens out (docs/algorithm.md §2): sampled tokens are kept as sampled; an observation is rendered
through the model's own chat template and only its *new* tokens are appended. Earlier tokens are
never re-tokenized. The observation wrapper is derived once by rendering a dummy conversation with
and without a tool message and keeping the text that follows the assistant's end-of-turn token.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_MARK = "\x00OBSERVATION\x00"


class ChatCodec:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        if tokenizer.chat_template is None:
            raise ValueError("model.path: the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token
        self._wrappers: dict[str, tuple[str, str]] = {}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation so far plus the generation prompt for the assistant's first turn."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def action_ids(self, text: str) -> list[int]:
        """A demonstration action as the engine would have sampled it: text, then end-of-turn."""
        return self.encode(text) + [self.eos_id]

    def action_text(self, ids: list[int]) -> str:
        """Text of a sampled action, without its end-of-turn token."""
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return self.decode(ids)

    def _wrapper(self, role: str) -> tuple[str, str]:
        if role not in self._wrappers:
            base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
            before = self.render(base, add_generation_prompt=False)
            after = self.render(base + [{"role": role, "content": _MARK}], add_generation_prompt=True)
            cut = before.index(self.eos_text, before.rindex("a")) + len(self.eos_text)
            if not after.startswith(before[:cut]) or _MARK not in after:
                raise ValueError("model.path: cannot derive tool-message tokens from this chat template")
            head, _, tail = after[cut:].partition(_MARK)
            self._wrappers[role] = (head, tail)
        return self._wrappers[role]

    def observation_ids(self, content: str, role: str = "tool") -> list[int]:
        """Tokens that follow an assistant's end-of-turn: the tool message and the next prompt."""
        head, tail = self._wrapper(role)
        return self.encode(head + content + tail)
