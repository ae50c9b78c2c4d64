"""Incremental detokenization that is correct for multi-byte characters.

Decoding token by token breaks characters whose UTF-8 bytes span tokens (and SentencePiece
spacing). As in vLLM/TGI we decode a short window twice — up to the last emitted token and up
to the newest — and emit the difference only once it no longer ends in an incomplete
character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ANCHORS = ("\n", ".")


def batch_decoder(tokenizer: Any) -> Callable[[list[list[int]]], list[str]]:
    """``decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`` of many
    sequences in one call: the Rust tokenizer's own ``decode`` for each, where the Hugging Face
    tokenizer's ``_decode`` is the plain one that delegates to it (its wrapper costs ~10 us of
    Python around ~0.5 us of decoding: 5 ms a step at 256 rows), else the wrapper's.

    Not ``decode_batch``: unless TOKENIZERS_PARALLELISM says no, it hands the few-token
    sequences of a step to a rayon thread pool, which is slower than a loop for them (0.36 vs
    0.24 ms for 512 on the CI machine) and spins on the cores the mask workers and the
    forward need (host_overhead.py: the grammar advance it overlaps came back ~0.3 ms later)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        plain = type(tokenizer)._decode is TokenizersBackend._decode
    except (ImportError, AttributeError):
        plain = False
    if backend is not None and plain:
        decode = backend.decode
        return lambda seqs: [decode(s, skip_special_tokens=True) for s in seqs]
    return lambda seqs: [
        tokenizer.decode(s, skip_special_tokens=True, clean_up_tokenization_spaces=False) for s in seqs
    ]


def cut_at_stop(text: str, stops: Sequence[str], *, final: bool) -> str:
    """The part of an output's text a user may see: everything before the first stop string.
    While the output can still grow (``final=False``), a tail that could be the start of a
    stop string is held back too, so a stream never shows text the result leaves out."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut]
    if final:
        return text
    hold = max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_tail: list[int] | None = None) -> None:
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
        prefix, full = self.append(new_ids)
        return self.advance(self._decode(prefix), self._decode(full))

    @staticmethod
    def push_many(
        items: Sequence[tuple["IncrementalDetokenizer", list[int]]], decode: Callable[[list[list[int]]], list[str]]
    ) -> None:
        """``push`` for many detokenizers (of one tokenizer) with one batched ``decode``
        (``batch_decoder``): the same texts, at a fraction of the cost per step."""
        seqs: list[list[int]] = []
        for d, new_ids in items:
            seqs.extend(d.append(new_ids))
        texts = decode(seqs) if seqs else []
        for k, (d, _) in enumerate(items):
            d.advance(texts[2 * k], texts[2 * k + 1])

    def append(self, new_ids: list[int]) -> tuple[list[int], list[int]]:
        """Add tokens without decoding; returns the two windows of ids whose decodes
        ``advance`` takes: up to the last emitted token, and up to the newest."""
        self.ids.extend(new_ids)
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def advance(self, prefix: str, full: str) -> str:
        """Take the decodes of ``append``'s windows: the newly completed text (possibly ''),
        held back while it ends in an incomplete character."""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def mark(self) -> tuple[int, int, int, int]:
        """The state to ``restore`` if the tokens pushed next are taken back."""
        return len(self.ids), self.prefix_offset, self.read_offset, len(self.text)

    def restore(self, mark: tuple[int, int, int, int]) -> None:
        n, self.prefix_offset, self.read_offset, chars = mark
        del self.ids[n:]
        self.text = self.text[:chars]

    def flush(self) -> str:
        """At the end: emit whatever is held back, even an incomplete character."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def encode_continuation(
    tokenizer: PreTrainedTokenizerBase, text: str, context: Sequence[int] | None = None
) -> list[int] | None:
    """Token ids that read as ``text`` right after the tokens ``context`` (None: after any
    text); None when no tokenization tried does. A byte-level BPE tokenizes a text the same
    wherever it stands; a SentencePiece one reads it as the start of a text and adds a space
    ("▁n" for "n"), which its decoder hides at the start of a decode. So the text is also
    tokenized after an anchor ("\n") whose tokens are dropped, and each candidate is checked
    by decoding it after the context (the anchor's tokens when there is none)."""
    ctx = list(context) if context is not None else encode(tokenizer, _ANCHORS[0])
    before = _decode(tokenizer, ctx)

    def reads_right(ids: list[int]) -> bool:
        return _decode(tokenizer, ctx + ids) == before + text

    plain = encode(tokenizer, text)
    if reads_right(plain):
        return plain
    for anchor in _ANCHORS:
        head, ids = encode(tokenizer, anchor), encode(tokenizer, anchor + text)
        if ids[: len(head)] == head and reads_right(ids[len(head) :]):
            return ids[len(head) :]
    return None
