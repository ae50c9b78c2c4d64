"""Interrupts and interleaved callers: Ctrl-C in a step, an open stream finished by another
call, generators finalised by the garbage collector mid-step, dropped conversations."""

import gc
import os
import signal
import threading

import pytest

from constrained_serve import SamplingParams
from constrained_serve.errors import OutputError

P = SamplingParams(max_tokens=12, ignore_eos=True)


def _consume(stream, timeout=60.0) -> str:
    """The rest of a stream, read on a thread so that a hang fails the test instead of it."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(text="".join(stream)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the stream never finished"
    return out["text"]


def test_ctrl_c_during_a_step_waits_for_the_step(tiny_engine_factory, monkeypatch):
    """SIGINT while a step is half done (the running rows' computed counts moved, their tokens
    not appended yet) used to leave an open stream's request unschedulable: it hung. Now the
    interrupt is raised once the step is over, and the stream goes on exactly."""
    eng = tiny_engine_factory()
    ref = "".join(eng.stream("Once upon a time", P))
    s = eng.stream("Once upon a time", P)
    first = next(s)
    share = eng.kv.share_progress
    fired = []

    def share_then_interrupt(r):
        share(r)
        if not fired:  # the new prompt's prefill, after the stream's row counted its token
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(eng.kv, "share_progress", share_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(["The capital of France is " * 3], P)
    assert fired
    assert all(r.num_pending >= 1 for r in eng.core.scheduler.running)
    assert first + _consume(s) == ref
    eng.core.check_integrity()
    assert not eng.core.scheduler.running and not eng.core.scheduler.waiting


def test_stream_shows_its_tail_when_another_call_finishes_it(tiny_engine_factory):
    """Another call's steps may finish a stream's request while the stream waits at a yield:
    the stream still yields the rest of the text (it used to end with nothing more)."""
    eng = tiny_engine_factory()
    ref = "".join(eng.stream("Once upon a time", P))
    s = eng.stream("Once upon a time", P)
    first = next(s)
    eng.generate(["The capital of France is"], SamplingParams(max_tokens=30, ignore_eos=True))
    assert first + _consume(s) == ref


def test_generator_collected_mid_step_is_aborted_after_the_step(tiny_engine_factory):
    """An abandoned generate_iter in a reference cycle (Jupyter keeps them in tracebacks) may be
    finalised by the garbage collector inside another call's forward. Its request is aborted
    after that step, not during it (its pages were freed under the step: ValueError)."""
    eng = tiny_engine_factory(max_num_batched_tokens=64)
    prompts = ["The capital of France is", "def add(a, b):"]
    ref = [r.token_ids for r in eng.generate(prompts, P)]
    g = eng.generate_iter(["Hi", "The history of the city. " * 40], SamplingParams(max_tokens=1))
    next(g)
    [req] = [r for r in eng.core.scheduler.running]
    assert req.num_computed < req.num_prompt  # still prefilling
    cycle = [g]
    cycle.append(cycle)
    del g, cycle
    forward, calls = eng.core.runner.forward, []

    def forward_then_collect(inputs):
        out = forward(inputs)
        if not calls:
            calls.append(True)
            gc.collect()
        return out

    eng.core.runner.forward = forward_then_collect
    try:
        assert [r.token_ids for r in eng.generate(prompts, P)] == ref
    finally:
        eng.core.runner.forward = forward
    assert req.finished and req.finish_reason == "abort"
    eng.core.check_integrity()
    assert eng.pool.num_free + eng.kv.radix.cached_pages() == eng.pool.num_pages


def test_stream_takes_one_sampling_params(tiny_engine_factory):
    with pytest.raises(TypeError, match="one SamplingParams"):
        tiny_engine_factory().stream("x", [SamplingParams()])


def test_a_request_the_core_lost_fails_instead_of_spinning(tiny_engine_factory):
    """Were a request ever dropped from the scheduler unfinished (an engine bug, an error
    inside a step), its caller raises instead of waiting forever."""
    eng = tiny_engine_factory()
    it = eng.generate_iter(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True), P])
    next(it)  # "b" is still running
    from constrained_serve.engine.request import Status

    [b] = eng.core.scheduler.running  # lost as if taken off the queue and never placed
    eng.core.scheduler.running.remove(b)
    b.status = Status.WAITING
    with pytest.raises(RuntimeError, match="no longer scheduled"):
        next(it)
    assert b.finished and eng.pool.num_free + eng.kv.radix.cached_pages() == eng.pool.num_pages


def test_second_ctrl_c_interrupts_the_step_at_once(tiny_engine_factory, monkeypatch, caplog):
    """A step can be long; a second Ctrl-C must not wait for it. It raises in the middle of
    the step, which leaves no request's state trustworthy: every unfinished request fails
    (an open stream says why), the KV cache and conversation pins are forgotten, and the
    engine serves the next call exactly as before."""
    eng = tiny_engine_factory()
    ref = [r.text for r in eng.generate(["Once upon a time", "The capital of France is"], P)]
    conv = eng.conversation()
    conv.send("Hello", SamplingParams(max_tokens=4))
    assert conv.pages  # history pinned
    s = eng.stream("Once upon a time", P)
    next(s)
    share, after = eng.kv.share_progress, []

    def share_then_two_interrupts(r):
        share(r)
        if not after:  # mid-step: counts moved, tokens not appended yet
            after.append(False)
            os.kill(os.getpid(), signal.SIGINT)  # held back (with a warning)
            os.kill(os.getpid(), signal.SIGINT)  # raises here
            after[0] = True  # never reached

    monkeypatch.setattr(eng.kv, "share_progress", share_then_two_interrupts)
    with caplog.at_level("WARNING", logger="constrained_serve"):
        with pytest.raises(KeyboardInterrupt):
            eng.generate(["The capital of France is " * 3], P)
    assert after == [False], "the second Ctrl-C waited for the step"
    assert "press it again" in caplog.text and "second Ctrl-C" in caplog.text
    monkeypatch.undo()
    with pytest.raises(OutputError, match="second Ctrl-C"):
        "".join(s)  # finished already: no step to wait for
    assert not conv.pages and not eng.core.scheduler.unfinished
    assert eng.pool.num_free == eng.pool.num_pages and eng.kv.radix.cached_pages() == 0
    eng.core.check_each_step = True
    assert [r.text for r in eng.generate(["Once upon a time", "The capital of France is"], P)] == ref
    assert conv.send("Again", SamplingParams(max_tokens=4)).finish_reason in ("stop", "length")
    eng.core.check_integrity()


def test_dropped_conversation_gives_its_pin_back(tiny_engine_factory):
    """A conversation dropped without close() used to pin its history until the pool ran
    out. Its pin now goes back at the next step, also when the garbage collector finalises
    it on another thread in the middle of a step (where taking the core lock deadlocked)."""
    eng = tiny_engine_factory()
    eng.core.check_each_step = True
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    conv = eng.conversation(system="You are terse.")
    conv.send("Hello there", p)
    assert conv.pages and eng.kv.radix.evictable_pages() < eng.kv.radix.cached_pages()
    del conv
    gc.collect()
    eng.generate(["x"], p)
    assert eng.kv.radix.evictable_pages() == eng.kv.radix.cached_pages()  # nothing locked

    cyclic = eng.conversation(system="You are terse.")
    cyclic.send("Hello there", p)
    cyclic.me = cyclic  # only the cycle collector can free it
    del cyclic
    forward, collected = eng.core.runner.forward, []

    def forward_with_collection_on_a_thread(inputs):
        if not collected:  # the core lock is held by this (stepping) thread
            t = threading.Thread(target=lambda: collected.append(gc.collect()), daemon=True)
            t.start()
            t.join(30)
            assert not t.is_alive(), "the collector's finalizer blocked (deadlock)"
        return forward(inputs)

    eng.core.runner.forward = forward_with_collection_on_a_thread
    try:
        eng.generate(["y", "z"], p)
    finally:
        eng.core.runner.forward = forward
    assert collected
    eng.generate(["w"], p)
    eng.core.check_integrity()
    assert eng.kv.radix.evictable_pages() == eng.kv.radix.cached_pages()
    assert len(eng.kv.pins) == 0  # the collected conversation's pin was released
