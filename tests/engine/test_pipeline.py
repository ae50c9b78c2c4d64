"""The pipelined loop (engine.py: step N+1 is scheduled and launched before step N's tokens
are read) gives the plain loop's outputs token for token. It is the default on CUDA only; on
CPU both loops run, so the comparison runs here."""

from __future__ import annotations

import collections

from constrained_serve import SamplingParams
from constrained_serve.engine.core import PLACEHOLDER
from constrained_serve.engine.request import Request

from .specs import RECORD


def _both(factory, prompts, params, **kw):
    """Results and engine of the plain loop, then of the pipelined one (integrity checked
    after every step)."""
    runs = []
    for pipeline in (False, True):
        eng = factory(pipeline=pipeline, **kw)
        eng.core.check_each_step = True
        runs.append((eng.generate(prompts, params), eng))
    return runs


def test_matches_the_plain_loop_through_preemption_stops_and_the_prefix_cache(tiny_engine_factory):
    shared = "the same long opening words for every prompt " * 3
    prompts = [shared + f"record {i}: " + "word " * (i * 7 % 40) for i in range(16)]
    # Stop tokens the model does draw, so that requests end on them mid-batch.
    probe = tiny_engine_factory().generate(prompts[:6], SamplingParams(max_tokens=30, temperature=1.0, seed=1))
    counts = collections.Counter(t for r in probe for t in r.token_ids)
    stops = [t for t, _ in counts.most_common(8)[4:8]]
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=1.0 if i % 3 else 0.0,
            seed=i,
            stop_token_ids=stops,
            stop=["ab"] if i % 4 == 0 else None,
            logprobs=2 if i % 5 == 0 else None,
        )
        for i in range(16)
    ]
    kw = dict(max_num_seqs=6, kv_cache_tokens=320, max_num_batched_tokens=48)
    (plain, pe), (piped, qe) = _both(tiny_engine_factory, prompts, params, **kw)
    assert pe.core.pipeline is False and qe.core.pipeline is True
    assert pe.core.scheduler.num_preemptions > 0 and qe.core.scheduler.num_preemptions > 0
    assert {r.finish_reason for r in plain} == {"stop", "length"}
    for a, b in zip(plain, piped):
        assert PLACEHOLDER not in b.token_ids
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        if a.logprobs is not None:
            assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
            assert all(abs(x[t] - y[t]) < 1e-4 for x, y in zip(a.logprobs, b.logprobs) for t in x)


def test_matches_the_plain_loop_with_grammars_and_forced_tokens(tiny_engine_factory):
    prompts = [f"record {i}:" for i in range(8)]
    schemas = [RECORD, None, RECORD, RECORD, None, RECORD, RECORD, RECORD]
    outs = []
    for pipeline in (False, True):
        eng = tiny_engine_factory(pipeline=pipeline)
        eng.core.check_each_step = True
        rs = eng.generate(prompts, SamplingParams(max_tokens=48, temperature=0.7, seed=5), schema=schemas)
        outs.append(rs)
    for a, b, schema in zip(*outs, schemas):
        assert a.token_ids == b.token_ids and a.text == b.text
        if schema is not None and a.finish_reason == "stop":
            assert b.json is not None


def test_rows_that_end_by_length_are_not_scheduled_again(tiny_engine_factory):
    """A row whose token surely ends its request gets no placeholder: the pipelined loop
    computes exactly the plain loop's tokens, not one wasted row per request."""
    prompts = [f"count {i}" for i in range(5)]
    params = [SamplingParams(max_tokens=3 + i, ignore_eos=True) for i in range(5)]
    (plain, pe), (piped, qe) = _both(tiny_engine_factory, prompts, params)
    assert [r.token_ids for r in plain] == [r.token_ids for r in piped]
    assert pe.core.runner.tokens_computed == qe.core.runner.tokens_computed


def test_a_request_aborted_while_its_token_is_in_flight(tiny_engine_factory):
    eng = tiny_engine_factory(pipeline=True)
    core = eng.core
    core.check_each_step = True
    a = Request(eng.encode_prompt("first"), SamplingParams(max_tokens=20, ignore_eos=True))
    b = Request(eng.encode_prompt("second"), SamplingParams(max_tokens=20, ignore_eos=True))
    core.add(a)
    core.add(b)
    for _ in range(4):
        core.step()
    # Launched, not read: a's last token is a placeholder the next step's inputs take on device.
    assert a.pending_row is not None and a.token_ids[-1] == PLACEHOLDER
    n_before = a.num_tokens
    core.abort(a)
    assert a.finished and PLACEHOLDER not in a.token_ids and a.num_tokens == n_before - 1
    while core.has_work():
        core.step()
    assert PLACEHOLDER not in b.token_ids and b.num_output == 20 and b.finish_reason == "length"
    core.check_integrity()
