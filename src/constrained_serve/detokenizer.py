"""Incremental detokenization that is correct for multi-byte characters.

Decoding token by token breaks characters whose UTF-8 bytes span tokens (and SentencePiece
spacing). As in vLLM/TGI we decode a short window twice — up to the last emitted token and up
to the newest — and emit the difference only once it no longer ends in an incomplete
character (U+FFFD).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_tail: list[int] | None = None) -> None:
        self.tok = tokenizer
        # A few prompt tokens give the first output token its context (leading-space rules).
        self.ids: list[int] = list(prompt_tail or [])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly '')."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: emit whatever is held back, even an incomplete character."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
