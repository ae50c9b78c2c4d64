"""What the grammar backends need of a tokenizer, as plain data a worker process can take.

The grammar engines run in worker processes (``worker.py``) that must start fast and import
neither torch nor transformers: llguidance builds its token tables from the tokenizer's JSON,
xgrammar from its own serialized ``TokenizerInfo`` (made here, in the engine's process, where
the Hugging Face tokenizer is). ``JsonTokenizer`` gives the few calls of a Hugging Face fast
tokenizer that the xgrammar backend's fast-forward makes, over the same JSON.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["JsonTokenizer", "TokenizerData"]


@dataclass(frozen=True)
class TokenizerData:
    tokenizer_json: str  # the fast tokenizer's own serialization (padding and truncation off)
    vocab_size: int  # the model's logits width: ids past the tokenizer's vocabulary are never allowed
    eos_token_ids: tuple[int, ...]
    special_ids: tuple[int, ...] = ()  # special tokens below vocab_size (xgrammar must not read them as text)
    xgrammar_info: str | None = None  # xgrammar.TokenizerInfo.serialize_json(), once xgrammar is used

    @classmethod
    def from_hf(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None) -> "TokenizerData":
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("the grammar backends need a fast (Rust) Hugging Face tokenizer")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        for t in eos_token_ids or ():
            if int(t) not in eos:
                eos.append(int(t))
        if not eos:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids")
        special = set(getattr(tokenizer, "all_special_ids", ()))
        special.update(
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        )
        return cls(
            backend.to_str(), int(vocab_size), tuple(eos), tuple(sorted(i for i in special if 0 <= i < vocab_size))
        )

    def with_xgrammar_info(self, tokenizer: Any) -> "TokenizerData":
        """A copy carrying xgrammar's view of the vocabulary (imports xgrammar here)."""
        if self.xgrammar_info is not None:
            return self
        from .xgrammar_vocab import tokenizer_info

        info = tokenizer_info(tokenizer, self.vocab_size, list(self.eos_token_ids), set(self.special_ids))
        return replace(self, xgrammar_info=info.serialize_json())


class JsonTokenizer:
    """The Hugging Face fast tokenizer calls ``detokenizer.encode_continuation`` makes, on the
    ``tokenizers`` library alone (a fast tokenizer delegates exactly these to it)."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(tokenizer_json)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("JsonTokenizer does not clean up tokenization spaces")
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
