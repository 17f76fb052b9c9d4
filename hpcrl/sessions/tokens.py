"""A family bound to a tokenizer: the token ids of turn 1, of an appended tail, and of the splice between them.

The stored history is never re-rendered: a tail's text is the difference between rendering a fixed stand-in
history with and without the tail, so it cannot depend on how the real history (with its sampled turns) would
render, and it is checked to be a pure extension there and then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpcrl.sessions.families import ModelFamily
from hpcrl.sessions.messages import Message

# A stand-in history ending, like every stored one, with an assistant turn.
_BASE = [
    Message(role="system", content="S"),
    Message(role="user", content="U"),
    Message(role="assistant", content="A"),
]


@dataclass(frozen=True)
class Unencodable:
    """A character of `texts[index]` at `offset` that the tokenizer can only map to its unknown token `unk`."""

    index: int
    offset: int
    char: str
    unk: str

    def describe(self) -> str:
        return (
            f"the character {self.char!r} (U+{ord(self.char[0]):04X}) at character {self.offset}, which the model's "
            f"tokenizer cannot encode: it would become its unknown token {self.unk!r}"
        )


def first_unencodable(tokenizer: Any, texts: Sequence[str]) -> Unencodable | None:
    """The first character of `texts` the tokenizer can only map to its unknown token (which, for hpcrl's character
    tokenizer, is also the pad token: training on it would teach nothing true); None when all encode. The run's data
    check and the session server both ask this, so a character refused in a dataset is refused in a request too."""
    unk = unknown_token(tokenizer)
    if unk is None or not texts:
        return None  # byte-level tokenizers (Qwen, Llama) encode every character
    unk_id = tokenizer.convert_tokens_to_ids(unk)
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    for index, (text, ids, offsets) in enumerate(zip(texts, enc["input_ids"], enc["offset_mapping"], strict=True)):
        for token_id, (start, end) in zip(ids, offsets, strict=True):
            if token_id == unk_id and text[start:end] != unk:
                return Unencodable(index, start, text[start:end] or "?", unk)
    return None


def unknown_token(tokenizer: Any) -> str | None:
    """The token that characters outside the vocabulary become, None when there is none. A fast
    tokenizer's wrapper may not name it (hpcrl's character tokenizer does not) while its model does."""
    if getattr(tokenizer, "unk_token", None):
        return str(tokenizer.unk_token)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    token = getattr(getattr(backend, "model", None), "unk_token", None)
    return str(token) if token else None


class TemplateError(RuntimeError):
    """The family's rendering is not append-only for this tail: a family bug (`hpcrl family check` finds them)."""


class Renderer:
    def __init__(self, family: ModelFamily, tokenizer: Any) -> None:
        self.family = family
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(self._special_id(t) for t in family.stop_tokens)
        self.end_of_turn_id = self._special_id(family.end_of_turn)

    def _special_id(self, token: str) -> int:
        ids = self.encode(token)
        if len(ids) != 1:
            raise ValueError(
                f"model family {self.family.name!r}: the tokenizer does not have {token!r} as one token "
                f"(it encodes to {ids}); this checkpoint is not of that family"
            )
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def prompt_ids(self, messages: list[Message], tools: tuple[dict[str, Any], ...]) -> list[int]:
        """Turn 1: the whole conversation rendered, with the generation prompt."""
        return self.encode(self.family.render(messages, tools, add_generation_prompt=True))

    def tail_text(self, tail: list[Message]) -> str:
        before = self.family.render(_BASE, add_generation_prompt=False)
        after = self.family.render(_BASE + tail, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                f"model family {self.family.name!r} is not append-only for appended roles "
                f"{[m.role for m in tail]}: rendering them changes the history before them"
            )
        return after[len(before) :]

    def tail_ids(self, tail: list[Message]) -> list[int]:
        return self.encode(self.tail_text(tail))

    def close_ids(self, output_ids: list[int]) -> list[int]:
        """What closes a sampled turn so the template's next message can follow: the family's turn_close minus the
        end-of-turn token when the model sampled it (the "\\n" after <|im_end|>), all of it when it was cut off."""
        close = self.encode(self.family.turn_close)
        if output_ids and output_ids[-1] == self.end_of_turn_id and close and close[0] == self.end_of_turn_id:
            return close[1:]
        return close

    def assistant_text(self, output_ids: list[int]) -> str:
        """The sampled text without its trailing stop token (what the parsers read)."""
        if output_ids and output_ids[-1] in self.stop_token_ids:
            output_ids = output_ids[:-1]
        return self.decode(output_ids)
