"""Incremental detokenization: new text per generated token, never half a character.

The window scheme of vLLM/TGI: decode a few tokens before the last emitted one together with the
new ones and emit only what the window added, holding back text that still ends in U+FFFD (an
incomplete multi-byte character, e.g. byte-fallback tokens). Decoding a short window keeps a
step O(1) in the answer's length; the whole answer is decoded once, at its end.
"""

from __future__ import annotations

from collections.abc import Sequence

_WINDOW = 6
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Tracks one row's generated ids and returns the text each new token completes."""

    def __init__(self, tokenizer, prior_ids: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prior_ids)
        # A resumed row (continuation) starts where its earlier run's text was complete.
        read = len(self.ids)
        while read > 0 and self._decode(max(0, read - _WINDOW), read).endswith(_INCOMPLETE):
            read -= 1
        self.read = read
        self.prefix = max(0, read - _WINDOW)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tok.decode(self.ids[start:end], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add a token; the newly completed text (may be empty)."""
        self.ids.append(token_id)
        before = self._decode(self.prefix, self.read)
        after = self._decode(self.prefix)
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self.prefix, self.read = max(self.prefix, self.read - _WINDOW), len(self.ids)
        return after[len(before):]

    def text(self) -> str:
        """The whole answer so far (one full decode)."""
        return self._decode(0)
