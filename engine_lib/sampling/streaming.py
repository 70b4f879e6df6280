"""Turning a stream of token ids into a stream of text, correct on multi-byte UTF-8.

Defined in chapter 09 (beyond greedy). Byte-level BPE can split one character (an emoji,
a CJK character) over several tokens; decoding a token alone then gives U+FFFD. The
decoder holds text back until it decodes to whole characters.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """push(token_id) -> the new text that is now complete ('' while a character is unfinished)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: decoding from here gives a stable prefix text
        self.read = 0  # tokens up to here have been emitted
        # a server decodes twice per token and row: straight through the Rust tokenizer where that gives
        # the same text (no clean-up of spaces), not through transformers' wrapper, which costs ~4x as
        # much per call (measured on a 2-core CPU: 7 against 1.6 us)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = None if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""  # an unfinished character: wait for its next byte(s)
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is left at the end (an unfinished character comes out as U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]
