"""Output text decoded while a request decodes, a chunk of tokens at a time, so that the answer after its last token
decodes only each row's tail.

The engine answers every /generate with `text`. Decoding 256 rows x 512 tokens at the end took 3-7 ms on a 2-core
CPU and about twice that on the H200's host, all of it after the last token, where nothing else runs. The scheduler
thread instead advances a few rows' text each decode step, while the device computes the step it just launched.

The text is built as SGLang's detokenizer builds it (and vLLM's): each chunk is decoded with the chunk before it as
context, and the chunk's text is what extends that context's. The context keeps a decoder's word-start handling
(SentencePiece's leading space) the same as in one decode of the whole row, and a chunk whose text ends in U+FFFD
(a character whose bytes are not all sampled yet) waits for more tokens. A chunk whose text does not extend its
context's cannot be cut this way; that row's answer decodes it whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CHUNK_TOKENS", "RowText", "TextDecoder", "decode_ids", "decoder_of"]

# Tokens a row gathers before its text advances: a decode call costs about a microsecond plus 30 ns a token, and
# each advance decodes the chunk twice with its context, so chunks much shorter spend more on calls than on tokens.
CHUNK_TOKENS = 32
_INCOMPLETE = "\ufffd"  # what a UTF-8 decoder writes for bytes that do not make a whole character (yet)


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    """`tokenizer.decode(ids, skip_special_tokens=True)` for a list of ints, as `decoder_of` decodes."""
    return decoder_of(tokenizer)(ids)


def decoder_of(tokenizer: Any) -> Callable[[list[int]], str]:
    """A function that decodes a list of ints as `tokenizer.decode(ids, skip_special_tokens=True)`, without
    transformers' conversion of the argument first: that checks every id's type in Python, 0.04 s of the 0.05 s it
    took to write a 256 x 512 answer on a CPU. transformers' own `decode` hands such a list straight to `_decode`,
    so this calls `_decode` itself, but only where `decode` is that method: a tokenizer class that overrides
    `decode` gets its own. Chosen once: the choice took 1.5 us a call, more than decoding a short chunk."""
    if _decode_is_transformers_own(type(tokenizer)) and hasattr(tokenizer, "_decode"):
        return lambda ids: str(tokenizer._decode(token_ids=ids, skip_special_tokens=True))
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))


def _decode_is_transformers_own(cls: type) -> bool:
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return False
    return getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode


@dataclass
class RowText:
    """One row's text so far: `parts` hold the text of its first `read` output tokens, and `context` is the text of
    tokens [start, read), which the next chunk is decoded after."""

    parts: list[str] = field(default_factory=list)
    start: int = 0
    read: int = 0
    context: str = ""
    whole: bool = False  # a chunk did not extend its context: the row is decoded whole at the end


class TextDecoder:
    """Decodes rows' output text in chunks (`advance`, on the scheduler thread) and finishes it (`text`, once the
    row is done; the answering thread's, while the scheduler no longer touches the row)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = decoder_of(tokenizer)

    def advance(self, row: RowText, ids: list[int]) -> None:
        """Move the row's text up to its last token, unless fewer than CHUNK_TOKENS are new or the last character is
        incomplete."""
        end = len(ids)
        if row.whole or end - row.read < CHUNK_TOKENS:
            return
        text = self._decode(ids[row.start : end])
        if text.endswith(_INCOMPLETE):
            return
        if not text.startswith(row.context):
            row.whole = True
            return
        row.parts.append(text[len(row.context) :])
        row.context = self._decode(ids[row.read : end])
        row.start, row.read = row.read, end

    def text(self, row: RowText, ids: list[int]) -> str:
        """The row's whole text: the chunks so far and the tail's."""
        if row.whole or not row.parts:
            return self._decode(ids)
        tail = self._decode(ids[row.start :])
        if not tail.startswith(row.context):
            return self._decode(ids)
        return "".join(row.parts) + tail[len(row.context) :]
