"""Ctrl-C held back for the length of one engine step.

A KeyboardInterrupt raised between two statements of a step (after a request's computed
count moved but before its token was appended, or after the scheduler took a request off
the waiting queue but before it joined the running list) would leave requests that other
callers still wait on (another thread, an open stream from an earlier Jupyter cell) in a
state no later step repairs: a hang, or text missing a token. So while a step runs, SIGINT
is only recorded; the handler that was installed runs right after the step, which delays
Ctrl-C by at most one forward pass. Signals reach only the main thread, so steps run on
other threads need nothing.

A step can be long (a big model on a CPU), so a block that can recover from being cut
short (``EngineCore.step``: it fails every request and forgets the KV cache) asks for
``interrupt_on_second=True``: a second Ctrl-C during it raises at once. Further presses
are held back again until the block exits, so the recovery itself is not cut short.

A caller that stops at the first Ctrl-C anyway (the CLI's extract job: every finished row is
already written, the rest is recomputed on resume) asks, with ``interrupt_at_first_press()``,
for the first press to act like a second in those blocks: Ctrl-C then stops within a
fraction of a second instead of after a step, which a long prefill on a busy CPU made 5-10 s.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)

_first_press = [False]  # interrupt_at_first_press() is active (main thread only: signals land there)


@contextmanager
def interrupt_at_first_press() -> Iterator[None]:
    """Within it, the first Ctrl-C interrupts a recoverable block at once (see the module doc)."""
    before, _first_press[0] = _first_press[0], True
    try:
        yield
    finally:
        _first_press[0] = before


def first_press_interrupts() -> bool:
    """Whether interrupt_at_first_press() is active (a broken step is then the caller's plan)."""
    return _first_press[0]


@contextmanager
def sigint_deferred(interrupt_on_second: bool = False) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN / SIG_DFL / not installed from Python: leave it alone
        yield
        return
    received: list = []
    raised: list[bool] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(frame)
        if not interrupt_on_second or raised:
            return
        if len(received) == 1 and not _first_press[0]:
            logger.warning(
                "Ctrl-C: stopping after the current step; press it again to "
                "interrupt now, failing every unfinished request"
            )
        else:
            raised.append(True)
            previous(signum, frame)  # default_int_handler raises KeyboardInterrupt, here

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and not raised:
            previous(signal.SIGINT, received[0])
