"""Multi-turn conversations that append to the cached KV instead of recomputing history.

A conversation keeps the exact token ids of its history (prompt + generated tokens, with the
chat template's turn delimiters) and never re-tokenizes earlier text (only the tail of an
output that a stop string cut inside a token is tokenized afresh). A new turn is rendered
by the chat template as the difference between the conversation with and without it, and
only that difference is tokenized and appended. The radix cache then matches the whole
history, so only the new turn is prefilled (and the history's last partial page: the cache
holds whole pages). While the conversation is open its history is
locked against eviction, up to ``conversation_lock_fraction`` of the pool; past that it is
left evictable (a later turn recomputes what was evicted, never fails). When a request could
not run at all otherwise (it is the only one running, or nothing runs and the next waiting
one does not fit), every pin is dropped: the history stays cached until evicted, and
is pinned again at the conversation's next turn. Ordinary memory pressure (preempting
runners, a queue waiting for pages) leaves the pins alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Protocol

from .engine.detokenizer import IncrementalDetokenizer, encode, encode_continuation
from .engine.interrupts import sigint_deferred
from .params import SamplingParams
from .result import Result

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .cache.manager import KVCacheManager

logger = logging.getLogger(__name__)


class ChatEngine(Protocol):
    """What a conversation needs of its engine (``Engine`` is one): declared here so that
    this module does not import api.py, which imports it."""

    tokenizer: PreTrainedTokenizerBase
    kv: KVCacheManager

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def generate(self, prompts: Any, params: Any = None, **spec_kwargs: Any) -> list[Result]: ...


class Conversation:
    def __init__(self, engine: ChatEngine, system: str | None = None, params: SamplingParams | None = None) -> None:
        self.engine = engine
        self.params = params or SamplingParams()
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self.token_ids: list[int] = []  # the exact history, as the model saw and wrote it
        # The hold on the cached history (cache/pins.py): released by close(), or at the
        # engine's next step after this conversation is garbage-collected.
        self._pin = engine.kv.pins.open(self)
        self._turn = threading.Lock()  # held while a turn is in flight

    @property
    def closed(self) -> bool:
        return self._pin.closed  # set by close(), under the lock pins.pin() takes

    @property
    def pages(self) -> list[int]:
        """Pages this conversation pins (one pool ref each)."""
        return self._pin.pages

    # ------------------------------------------------------------------ turns
    def next_turn_ids(self, content: str) -> list[int]:
        """Token ids of history + the new user turn + the generation prompt."""
        if self.closed:
            raise ValueError("conversation is closed")
        msgs = self.history + [{"role": "user", "content": content}]
        if not self.token_ids:
            return self.engine.encode_chat(msgs)
        prev = self.engine.render_chat(self.history, add_generation_prompt=False)
        full = self.engine.render_chat(msgs, add_generation_prompt=True)
        if not full.startswith(prev):
            raise ValueError("the chat template does not render this conversation as an append-only text")
        # What the template puts after the end-of-turn token the model generated (e.g. "\n").
        tok, eos_id = self.engine.tokenizer, self.token_ids[-1]
        eos_text = tok.decode([eos_id])
        cut = prev.rfind(eos_text) if eos_text else -1
        if cut < 0:
            return self.token_ids + encode(tok, full[len(prev) :])
        delimiter = prev[cut + len(eos_text) :]
        # Tokenized after the end-of-turn token, as in the whole rendered text: a SentencePiece
        # tokenizer would otherwise read the new part as the start of a text ("▁[INST]"
        # where the full text has "[INST]", for Metaspace with prepend_scheme "first").
        ids = encode(tok, eos_text + delimiter + full[len(prev) :])
        new = ids[1:] if ids and ids[0] == eos_id else encode(tok, delimiter + full[len(prev) :])
        return self.token_ids + new

    def send(self, content: str, params: SamplingParams | None = None, **spec_kwargs: Any) -> Result:
        [res] = send_many([self], [content], params, **spec_kwargs)
        return res

    def commit(self, content: str, prompt_ids: list[int], res: Result) -> None:
        """Record a finished turn (called by send_many)."""
        if res.finish_reason == "abort" and not res.token_ids:
            return  # nothing happened: the history stays as it was
        out = list(res.token_ids)
        if res.stop_reason is not None:
            # A stop string or stop token cut the text: the history holds what the user saw.
            out = _ids_for_text(self.engine.tokenizer, prompt_ids, out, res.text)
        ids = list(prompt_ids) + out
        eos = self.engine.tokenizer.eos_token_id
        if not out or out[-1] not in self.engine.eos_token_ids:
            # Truncated or stopped by a stop string: close the turn so the template stays valid.
            ids.append(eos)
        history = self.history + [{"role": "user", "content": content}, {"role": "assistant", "content": res.text}]
        # Ctrl-C waits (interrupts.py): half a turn recorded, or a radix lock taken without
        # its page references, would leave the conversation wrong for good.
        with sigint_deferred():
            self.token_ids, self.history = ids, history
            self._pin_history()

    def begin_turn(self) -> None:
        """Take this conversation's turn (send_many, until the turn is committed or failed).
        A second turn started before the first is committed would be built on the old history
        and overwrite the first: it is refused (RuntimeError) rather than corrupt the history."""
        if not self._turn.acquire(blocking=False):
            raise RuntimeError(
                "this conversation already has a turn in flight (another thread is "
                "sending on it); a conversation takes one turn at a time"
            )

    def end_turn(self) -> None:
        """Give back the turn ``begin_turn`` took."""
        self._turn.release()

    # ------------------------------------------------------------------ pinning
    def _pin_history(self) -> None:
        """Lock the cached history so eviction cannot take it while the conversation is open
        (not once closed: a turn that ran while close() was called keeps nothing)."""
        self.engine.kv.pins.pin(self._pin, self.token_ids)

    def unpin(self) -> None:
        """Make the cached history evictable again (its next turn pins it again)."""
        self.engine.kv.pins.release(self._pin)

    def close(self) -> None:
        self.engine.kv.pins.close(self._pin)

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ids_for_text(
    tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], out_ids: list[int], text: str
) -> list[int]:
    """Token ids whose text is exactly ``text``, a prefix of what ``out_ids`` decode to: the
    model's own tokens as far as they lie inside it (their KV is cached), then the rest of
    the text (a stop string may end inside a token) tokenized afresh."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids[-4:])
    keep, done = 0, 0  # tokens kept, characters they cover
    for i, t in enumerate(out_ids):
        detok.push([t])
        if len(detok.text) > len(text) or not text.startswith(detok.text):
            break
        if detok.read_offset == len(detok.ids):  # no bytes of a character held back
            keep = i + 1
            done = len(detok.text)
    rest = text[done:]
    kept = out_ids[:keep]
    if not rest:
        return kept
    tail = encode_continuation(tokenizer, rest, prompt_ids[-4:] + kept)
    if tail is None:
        logger.debug("no tokenization of %r reads back exactly after the kept tokens", rest)
        tail = encode(tokenizer, rest)
    return kept + tail


def send_many(
    conversations: Sequence[Conversation],
    contents: Sequence[str],
    params: SamplingParams | None = None,
    **spec_kwargs: Any,
) -> list[Result]:
    """One turn for each conversation, all decoded together in one batch."""
    if len(conversations) != len(contents):
        raise ValueError("conversations and contents must have the same length")
    if len({id(c) for c in conversations}) != len(conversations):
        raise ValueError("a conversation can take only one turn at a time")
    with ExitStack() as turns:
        for c in conversations:
            c.begin_turn()
            turns.callback(c.end_turn)
        engine = conversations[0].engine
        ids = [c.next_turn_ids(m) for c, m in zip(conversations, contents)]
        params = params or conversations[0].params
        if params.n != 1:  # the history goes on from one answer
            raise ValueError(f"a conversation turn takes one completion: n must be 1, got {params.n}")
        results = engine.generate(ids, params, **spec_kwargs)
        for c, m, p, res in zip(conversations, contents, ids, results):
            c.commit(m, p, res)
        return results
