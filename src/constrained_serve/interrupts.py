"""Ctrl-C held back for the length of one engine step.

A KeyboardInterrupt raised between two statements of a step (after a request's computed
count moved but before its token was appended, or after the scheduler took a request off
the waiting queue but before it joined the running list) would leave requests that other
callers still wait on (another thread, an open stream from an earlier Jupyter cell) in a
state no later step repairs: a hang, or text missing a token. So while a step runs, SIGINT
is only recorded; the handler that was installed runs right after the step, which delays
Ctrl-C by at most one forward pass. Signals reach only the main thread, so steps run on
other threads need nothing.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def sigint_deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN / SIG_DFL / not installed from Python: leave it alone
        yield
        return
    received: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(signal.SIGINT, received[0])  # default_int_handler raises KeyboardInterrupt
