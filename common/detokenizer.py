"""Incremental detokenization: one request's new token ids become streamed text deltas.

The engine keeps one `IncrementalDetokenizer` per request and calls `add` once per new token;
the delta goes to the stop checker and then to the client. Each step decodes only a small
window of recent tokens: ``ids[prefix_offset:read_offset]`` is text already emitted (kept as
context, so that a token's text is decoded as it reads after its neighbours) and
``ids[prefix_offset:]`` is the same plus the new tokens; the delta is the difference. While
the window's text ends in U+FFFD (a multi-byte character split across tokens, e.g. byte-
fallback tokens) nothing is emitted and the offsets stay, so the character comes out whole
once its last byte arrives. `flush` emits what is still held at the end of a request.

The deltas of the output tokens concatenate to
``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.
The last few prompt tokens serve as the first context, so for tokenizers that drop a word's
leading space at the start of a text, the first delta keeps the space that follows the
prompt (the text reads as a continuation of the prompt)."""

from __future__ import annotations

from typing import Any

# How many prompt tokens to decode as context before the first output token.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        self._ids: list[int] = list(prompt_token_ids[start:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        if self._decode(0, len(self._ids)).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: context would mis-align the first delta.
            self._prefix_offset = self._read_offset
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the text it completes ("" while a character is
        still incomplete or the token decodes to nothing, e.g. a skipped special token)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """Emit what is still held back (an incomplete character, as U+FFFD) at the end."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        return self._emit(new_text[len(prefix_text) :])

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(
            self._ids[start:end],
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )
