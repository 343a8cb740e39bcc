"""Incremental detokenization that never emits half a UTF-8 character.

Text is produced by decoding a short window of recent tokens and emitting only what the
newest token added; while the window ends in a replacement character (a byte-level token
that completes a character only with the next one), nothing is emitted.
"""

from __future__ import annotations

from tandem.core.llm.tokenizer import Tokenizer

# Tokens before the emitted point kept in the window, so merges at the boundary decode right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = [
            t for t in prompt_ids[-_CONTEXT_TOKENS:] if not tokenizer.is_special(t)
        ]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ('' if none yet)."""
        if self.tokenizer.is_special(token_id):
            return ""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        self.text += new
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if self.prefix_offset > 64:
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return new

    def flush(self) -> str:
        """At the end of a sequence: whatever text the pending tokens decode to."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        new = new.rstrip("\ufffd")
        self.text += new
        self.read_offset = len(self.ids)
        return new
