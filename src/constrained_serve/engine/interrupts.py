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
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)


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
        if len(received) == 1:
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
