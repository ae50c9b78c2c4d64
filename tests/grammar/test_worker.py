"""Grammar work that runs away, fails or breaks its grammar: killed, isolated, recovered.

Real llguidance 1.9.1 runaways (no stand-ins): it never finishes the first mask of
``start: A B / A: /a+/ / B: /a/`` (A is greedy, B can only start with what A swallows), and
with that pair reached only after the first token it spins mid-generation, holding the GIL in
``compute_ff_tokens`` and growing ~10 MB/s in ``compute_mask``. Each test has a wall-clock
bound (pytest-timeout) and checks its own timings: it fails, it does not hang.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import GrammarManager, make_output_spec

MODEL_VOCAB = 49152

# Compiles (its first mask is fine); whichever token comes first, the next mask spins.
HANG_AFTER_FIRST = 'start: c y\nc: "q" | "x"\ny: "{" A B "}"\nA: /a+/\nB: /a/\n'
# The example: the spin comes only after "x"; "q" ends the output.
HANG_AFTER_X = 'start: "q" | "x" y\ny: "{" A B "}"\nA: /a+/\nB: /a/\n'
HANG_AT_COMPILE = "start: A B\nA: /a+/\nB: /a/\n"
# A string pattern whose derivatives llguidance's lexer must count: past a few dozen words it
# hits "too many expressions constructed", which breaks the lexer its matchers share.
POISON_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["s"],
    "properties": {"s": {"type": "string", "maxLength": 500, "pattern": "^(?:\\S+\\s+){0,49}\\S+$"}},
}


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture
def mgr(tokenizer):
    m = GrammarManager(tokenizer, MODEL_VOCAB, mask_threads=1, compile_timeout_s=5, mask_timeout_s=0.5)
    yield m
    m.close()


@pytest.mark.timeout(60)
def test_runaway_matcher_fails_alone_and_the_rest_go_on(mgr, tokenizer):
    bad = mgr.compile(make_output_spec(grammar=HANG_AFTER_FIRST))
    good = mgr.compile(make_output_spec(regex="[a-z]{1,8}"))
    hs = [mgr.new_matcher(bad), mgr.new_matcher(bad), mgr.new_matcher(good)]
    assert all(a is not None for a in mgr.advance([(h, [], 16, ()) for h in hs]))
    x, q, ab = encode(tokenizer, "x"), encode(tokenizer, "q"), encode(tokenizer, "ab")
    t0 = time.monotonic()
    out = mgr.advance([(hs[0], x, 16, ()), (hs[1], q, 16, ()), (hs[2], ab, 16, ())])
    elapsed = time.monotonic() - t0
    assert out[0] is None and out[1] is None, out  # both spin, each is killed in turn
    for h in hs[:2]:
        assert "took longer than its deadline of 0.5 s" in h.failure and "killed" in h.failure, h.failure
    assert out[2] is not None and out[2].accepted and hs[2].failure is None
    assert elapsed < 15, elapsed
    assert mgr.stats["mask_overruns"] == 2 and mgr.stats["worker_restarts"] == 2
    # The good matcher was rebuilt in the restarted worker from its history, and goes on.
    bitmask = mgr.allocate_bitmask(1)
    assert mgr.fill_bitmask([(0, hs[2])], bitmask) == []
    assert hs[2].accept_tokens(encode(tokenizer, "cd")) and hs[2].can_end()
    assert not hs[2].accept_tokens(encode(tokenizer, "1"))
    # The grammar that ran away was evicted: the next request compiles it afresh.
    assert mgr.compile(make_output_spec(grammar=HANG_AFTER_FIRST)) is not bad


@pytest.mark.timeout(60)
def test_runaway_mask_fill_is_killed_and_its_row_left_open(mgr, tokenizer):
    bad = mgr.compile(make_output_spec(grammar=HANG_AFTER_X))
    good = mgr.compile(make_output_spec(regex="[0-9]+"))
    h_bad, h_good = mgr.new_matcher(bad), mgr.new_matcher(good)
    try:
        h_bad.accept_tokens(encode(tokenizer, "x"))
    except GrammarError:  # the state read after the token may already spin: killed there
        pass
    bitmask = mgr.step_bitmask(2)
    t0 = time.monotonic()
    failed = mgr.fill_bitmask([(0, h_bad), (1, h_good)], bitmask)
    assert time.monotonic() - t0 < 10
    assert failed == [h_bad] and "deadline" in h_bad.failure
    assert bool((bitmask[0] == -1).all())  # a failed row allows everything: its request fails anyway
    allowed = {t for t in range(MODEL_VOCAB) if (int(bitmask[1, t // 32]) >> (t % 32)) & 1}
    assert encode(tokenizer, "7")[0] in allowed and encode(tokenizer, "a")[0] not in allowed


@pytest.mark.timeout(90)
def test_compile_runaway_is_killed_and_its_shape_refused_at_once(tokenizer):
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, max_workers=1, mask_threads=1, compile_timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(GrammarError, match="took longer than 1 s") as first:
            mgr.compile(make_output_spec(grammar=HANG_AT_COMPILE))
        assert first.value.reason == "timeout" and 1.0 <= time.monotonic() - t0 < 8
        # Retries, and trivial edits of it (same shape), are refused without compiling.
        for g in (HANG_AT_COMPILE, "start: A B\nA: /b+/\nB: /b/\n", "start:  A  B\nA: /zz+/\nB: /z/\n"):
            t0 = time.monotonic()
            with pytest.raises(GrammarError, match="same shape") as again:
                mgr.compile_async(make_output_spec(grammar=g)).result(timeout=1)
            assert again.value.reason == "timeout" and time.monotonic() - t0 < 0.5
        assert mgr.stats["timeouts"] == 1 and mgr.stats["timeout_refusals"] == 3
        # A longer deadline is another try (it runs away again: killed again).
        with pytest.raises(GrammarError, match="took longer than 1.5 s"):
            mgr.compile(make_output_spec(grammar=HANG_AT_COMPILE), timeout_s=1.5)
        assert mgr.stats["timeouts"] == 2
        # Good specs compile as before, on the restarted worker.
        assert mgr.compile(make_output_spec(regex="[a-c]+")).backend == "llguidance"
    finally:
        mgr.close()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_twenty_distinct_runaways_leave_threads_processes_and_memory_bounded(tokenizer):
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, max_workers=2, mask_threads=1, compile_timeout_s=0.4)
    try:
        mgr.compile(make_output_spec(regex="[0-9]+"))  # workers and tables up, outside the counts
        threads0, rss0 = threading.active_count(), rss_kb(os.getpid())
        # Distinct shapes (one more literal each): none is refused as a retry of another.
        for i in range(20):
            grammar = "start: A B" + ' "z"' * i + "\nA: /a+/\nB: /a/\n"
            t0 = time.monotonic()
            with pytest.raises(GrammarError, match="took longer than") as e:
                mgr.compile(make_output_spec(grammar=grammar))
            assert e.value.reason == "timeout" and time.monotonic() - t0 < 6, (i, time.monotonic() - t0)
        assert mgr.stats["timeouts"] == 20 and mgr.stats["timeout_refusals"] == 0
        pids = mgr.worker_pids()
        assert len(pids) <= 3, pids  # 2 compile workers (at most) and 1 mask worker
        assert all(rss_kb(p) < 400_000 for p in pids), [rss_kb(p) for p in pids]
        assert threading.active_count() <= threads0 + 2
        assert rss_kb(os.getpid()) - rss0 < 100_000
        t0 = time.monotonic()
        assert mgr.compile(make_output_spec(regex="[a-z]+@[a-z]+")).backend == "llguidance"
        assert time.monotonic() - t0 < 3
    finally:
        mgr.close()


@pytest.mark.timeout(60)
def test_poisoned_grammar_is_evicted_and_the_next_request_succeeds(mgr, tokenizer):
    spec = make_output_spec(schema=POISON_SCHEMA, strict=False)
    first = mgr.compile(spec)
    h = mgr.new_matcher(first)
    text = '{"s":"' + " ".join(f"word{i}" for i in range(45)) + '"}'  # valid: 45 words, < 500 chars
    ids = encode(tokenizer, text)
    with pytest.raises(GrammarError, match="too many expressions constructed"):
        for t in ids:
            assert h.accept_tokens([t])
    assert "too many expressions" in h.failure
    assert mgr.stats["evictions"] == 1
    second = mgr.compile(spec)
    assert second is not first  # compiled afresh, not the broken one
    h2 = mgr.new_matcher(second)
    assert h2.accept_tokens(encode(tokenizer, '{"s":"a b"}')) and h2.can_end()


@pytest.mark.timeout(60)
def test_a_matches_check_that_breaks_its_grammar_is_reported_and_rebuilt(mgr):
    spec = make_output_spec(schema=POISON_SCHEMA, strict=False)
    compiled = mgr.compile(spec)
    long_text = '{"s":"' + " ".join(f"word{i}" for i in range(45)) + '"}'
    with pytest.raises(GrammarError, match="too many expressions"):
        mgr.matches(compiled, long_text)
    assert mgr.matches(compiled, '{"s":"a b"}')  # rebuilt from its payload
    assert not mgr.matches(compiled, '{"s":""}')


@pytest.mark.timeout(60)
def test_inline_isolation_runs_the_same_code_in_process(tokenizer):
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, isolation="inline")
    try:
        h = mgr.new_matcher(mgr.compile(make_output_spec(regex="[0-9]{2}-[a-z]+")))
        [a] = mgr.advance([(h, [], 8, ())])
        assert a.accepted and a.forced == []
        assert h.accept_tokens(encode(tokenizer, "12-")) and not h.can_end()
        assert h.accept_tokens(encode(tokenizer, "ab")) and h.can_end()
        assert mgr.worker_pids() == []
    finally:
        mgr.close()


@pytest.mark.timeout(60)
def test_a_worker_killed_from_outside_is_restarted_and_its_matchers_rebuilt(mgr, tokenizer):
    h = mgr.new_matcher(mgr.compile(make_output_spec(regex="[a-z]+-[0-9]+")))
    assert h.accept_tokens(encode(tokenizer, "abc-"))
    pid = mgr.workers.maskers_for("llguidance")[0].pid
    os.kill(pid, 9)
    time.sleep(0.2)
    assert h.accept_tokens(encode(tokenizer, "12")) and h.can_end()  # rebuilt: "abc-" replayed
    assert not h.accept_tokens(encode(tokenizer, "x"))
    assert pid not in mgr.worker_pids()


@pytest.mark.parametrize(
    "wall, cpu, killed",
    [
        (0.6, 1.2, False),  # two threads busy for 0.6 s: 1.2 s of CPU, but it has not run 1 s yet
        (1.2, 0.3, False),  # waited for a core (busy machine, paused VM): little CPU used
        (1.2, 1.2, True),  # a runaway on one core: both past the deadline
        (1.1, 2.2, True),  # a runaway on two cores
        (8.1, 0.0, True),  # blocked without spinning: cut at 3x the deadline + 5 s of wall time
    ],
)
def test_an_item_overruns_when_both_its_wall_and_cpu_time_pass_the_deadline(wall, cpu, killed):
    from constrained_serve.grammar import worker

    # batch 7 sent at t=100 with one item (deadline 1 s); item 0 started at t=100, CPU 5 s
    left, index, elapsed = worker.batch_time_left(
        100.0 + wall, (7, [1.0], 100.0), (7, 0, 100.0, 5.0), lambda: 5.0 + cpu, reply_timeout_s=60.0
    )
    assert index == 0 and elapsed == pytest.approx((wall, cpu))
    assert (left <= 0) == killed, left


def _hammer_progress(fd: int, seconds: float) -> None:
    """In another process: write records whose four fields are all the same number."""
    import mmap

    from constrained_serve.grammar.worker import ProgressCell

    cell = ProgressCell(mmap.mmap(fd, mmap.PAGESIZE))
    end, k = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        k += 1
        cell.write(k, k, float(k), float(k))


def test_the_engine_never_reads_a_half_written_progress_record():
    """A worker descheduled mid-write once left a new item index beside a start of 0.0: the
    item seemed to have run for the machine's uptime and was killed at once. A reader must
    see whole records only, however the writer's stores interleave with its reads."""
    import mmap
    import multiprocessing

    from constrained_serve.grammar.worker import ProgressCell

    fd = os.memfd_create("cs-test-progress")
    os.ftruncate(fd, mmap.PAGESIZE)
    cell = ProgressCell(mmap.mmap(fd, mmap.PAGESIZE))
    cell.write(0, 0, 0.0, 0.0)
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_hammer_progress, args=(fd, 1.5))
    writer.start()
    try:
        reads, last = 0, 0
        while writer.is_alive() or reads == 0:
            seq, index, wall, cpu = cell.read()
            assert seq == index == wall == cpu, (seq, index, wall, cpu)
            assert seq >= last  # and never an older record after a newer one
            last, reads = seq, reads + 1
        assert last > 1000, f"the writer wrote only {last} records"
    finally:
        writer.join(5)
        os.close(fd)


def test_bitmask_pinning_is_refused_cleanly_without_cuda():
    """SharedBitmask.pin (cudaHostRegister, used on CUDA) returns False where CUDA is absent,
    and the buffer stays usable; benchmarks/gpu_structured.py reports it on a GPU."""
    import torch

    from constrained_serve.grammar.shared_memory import SharedBitmask

    bm = SharedBitmask(2, 3)
    try:
        assert bm.pin() is torch.cuda.is_available()
        bm.array[1] = 7
        assert bm.array.tolist() == [[-1, -1, -1], [7, 7, 7]]
    finally:
        bm.close()


def test_an_unknown_op_fails_its_item_alone_with_a_clear_error():
    """The worker runs only the ops of its table: another name (a private method's included)
    is that item's error, and the other items still run."""
    from constrained_serve.grammar.host import OPS, MatcherHost

    host = MatcherHost(backend=None)
    out = host.run([("bogus", 1), ("_why_rejected", None), ("drop", 5)])
    assert [ok for ok, _ in out] == [False, False, True]
    for _, (etype, message, _reason) in out[:2]:
        assert etype == "ValueError" and "unknown grammar worker op" in message
    assert "dead_end" in OPS and "why_rejected" not in " ".join(OPS)
