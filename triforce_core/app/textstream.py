"""Incremental detokenisation for streamed output."""
from __future__ import annotations


class TextStream:
    """Feed token ids one at a time; `push` returns the newly printable text.

    Decoding the whole answer each time keeps multi-token characters and the tokenizer's spacing
    rules right; text ending in a replacement character is held back until it completes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)
