"""block_tables.py: the step's block table, kept across steps and updated where pages
changed, always equals the table built from scratch from the requests' page lists. The page
lists change as the cache manager changes them: appends, a prefix-cache swap of a slice,
admission and release (the non-append changes bump ``pages_version``). What the table keeps
of a request (its slot) is the runner's, keyed by request id, and goes with the request: when
a step leaves it out, or when it finishes."""

from __future__ import annotations

import random

import numpy as np

from constrained_serve.engine.request import Request, Status
from constrained_serve.params import SamplingParams
from constrained_serve.runtime.block_tables import BlockTables


def request() -> Request:
    return Request(prompt_ids=[1], params=SamplingParams())


def check(bt: BlockTables, reqs: list[Request], rng: random.Random) -> None:
    need = [rng.randint(0, len(r.pages)) for r in reqs]
    width = max([1, *need]) + rng.randint(0, 2)
    got = bt.gather(reqs, need, width)
    assert got.shape == (len(reqs), width) and got.dtype == np.int32
    for row, r, n in zip(got, reqs, need):
        assert row[:n].tolist() == r.pages[:n]


def test_incremental_rows_equal_the_pages_through_every_kind_of_change():
    rng = random.Random(0)
    bt = BlockTables(rows=4, cols=4)  # small: rows and columns both have to grow
    live = [request() for _ in range(6)]
    next_page = iter(range(10**6))
    for step in range(400):
        for r in live:
            op = rng.random()
            if op < 0.5:  # decode/prefill: pages appended (no version bump)
                r.pages.extend(next(next_page) for _ in range(rng.choice([0, 0, 1, 3])))
            elif op < 0.6 and r.pages:  # share_progress: a slice swapped for cached pages
                i = rng.randrange(len(r.pages))
                r.pages[i : i + 2] = [next(next_page) for _ in r.pages[i : i + 2]]
                r.pages_version += 1
            elif op < 0.63:  # release (preemption): no pages, later admitted again
                r.pages = []
                r.pages_version += 1
            elif op < 0.65:  # admission on a cached prefix: a new list
                r.pages = [next(next_page) for _ in range(rng.randint(1, 9))]
                r.pages_version += 1
        if step % 50 == 49:  # some finish, new ones come
            for r in rng.sample(live, 2):
                r.status = Status.FINISHED
                live.remove(r)
                live.append(request())
        check(bt, rng.sample(live, rng.randint(1, len(live))), rng)
    # Finished and page-less requests gave their slots back: the table did not grow for each
    # new request.
    assert bt.table.shape[0] <= 16


def test_a_request_left_out_of_a_step_gives_its_slot_back():
    bt = BlockTables(rows=2, cols=2)
    a, b = request(), request()
    a.pages, b.pages = [5, 6], [7]
    bt.gather([a, b], [2, 1], 2)
    c = request()
    c.pages = [9, 9, 9]
    got = bt.gather([b, c], [1, 3], 3)
    assert bt.table.shape[0] == 2, "a's slot went to c"
    assert len(bt) == 2
    assert got[0, :1].tolist() == [7] and got[1].tolist() == [9, 9, 9]
    # a comes back (after a preemption, say): its row is written whole again.
    a.pages = [1, 2]
    assert bt.gather([a], [2], 2).tolist() == [[1, 2]]
    assert len(bt) == 1


def test_release_forgets_a_finished_request():
    bt = BlockTables(rows=1, cols=2)
    a = request()
    a.pages = [3]
    bt.gather([a], [1], 1)
    bt.release(a.request_id)
    bt.release(a.request_id)  # twice: nothing left to forget
    assert len(bt) == 0
    b = request()
    b.pages = [4]
    assert bt.gather([b], [1], 1).tolist() == [[4]]
    assert bt.table.shape[0] == 1, "a's slot went to b"


def test_the_engine_keeps_no_row_of_a_finished_request(tiny_engine_factory):
    """Requests of every kind of end (length, stop, abort mid-run) leave nothing in the
    runner's block tables once the engine is idle, pipelined or not."""
    from constrained_serve import SamplingParams

    for pipeline in (False, True):
        eng = tiny_engine_factory(pipeline=pipeline)
        eng.generate(["hello there", "a b c d e f", "x"], SamplingParams(max_tokens=6, ignore_eos=True))
        assert not eng.core.has_work()
        assert len(eng.core.runner.block_tables) == 0
        stream = eng.core
        r = Request(eng.encode_prompt("some words here"), SamplingParams(max_tokens=50, ignore_eos=True))
        stream.add(r)
        stream.step()
        stream.step()
        assert len(eng.core.runner.block_tables) == 1
        stream.abort(r)
        stream.drain_finished()
        assert len(eng.core.runner.block_tables) == 0
