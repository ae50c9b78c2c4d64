"""xgrammar's view of a tokenizer's vocabulary (``TokenizerInfo``), made in the engine's process
where the Hugging Face tokenizer is. Its own module, importing nothing of the grammar package:
``tokenizer_data`` needs it, and the xgrammar backend (which needs ``tokenizer_data``) re-exports it.
"""

from __future__ import annotations

from typing import Any

import xgrammar as xgr

__all__ = ["tokenizer_info"]


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: list[int], special: set[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with special tokens as special. from_huggingface
    keeps their literal text ("<|im_start|>"), so a string or a regex class could take one
    as those characters (and EOS as text in "[^b]+" let an output end before the regex
    did), while the detokenizer drops special tokens from the text: what the grammar saw
    is not what the Result shows. An empty string is how xgrammar marks a special token."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
    if not special:
        return info
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            vocab[i] = token
    return xgr.TokenizerInfo(
        vocab,
        vocab_type=info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=eos_token_ids,
        add_prefix_space=info.add_prefix_space,
    )
