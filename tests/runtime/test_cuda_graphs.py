"""Decode steps through the CUDA-graph runner (cuda_graphs.py), staged and run eagerly on CPU:
the padded buckets, the scratch page and the fixed split-KV count must give the tokens and
logits of the plain forward. (Capture itself needs a GPU: benchmarks/gpu_correctness.py.)"""

import pytest
import torch

from constrained_serve import SamplingParams
from constrained_serve.kernels import sampling
from constrained_serve.runtime.cuda_graphs import batch_buckets, graph_splits

PROMPTS = [
    "The parcel was late",
    "A short one",
    "Write a list of colours: red, green,",
    "Order 4412 arrived broken and the box was wet when it came to the door",
    "Hello",
]


def test_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    for n in range(1, 300):
        b = batch_buckets(300)
        assert min(x for x in b if x >= n) - n < 16


def test_graph_splits_fill_small_batches_and_stay_within_the_context():
    assert graph_splits(1, 8, 8192) == 32  # one row: 8 programs would leave a GPU idle
    assert graph_splits(256, 8, 8192) == 1
    assert graph_splits(1, 8, 300) == 1  # a context that short is never split


def _run(factory, stage: bool, **kw):
    engine = factory(max_num_seqs=8, **kw)
    if stage:
        assert engine.core.runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
    # 8 tokens: eight decode steps of five rows each (under TRITON_INTERPRET each step
    # interprets every attention program, so a longer run only repeats the same steps).
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = engine.generate(PROMPTS, params)
    return engine, [r.token_ids for r in out]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_staged_decode_steps_give_the_plain_forward_tokens(tiny_engine_factory, monkeypatch, kernels):
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", kernels)
    # The staging covers the forward, not the sampler. Under TRITON_INTERPRET the Triton
    # sampler interprets a 49k-vocabulary loop per row, half of this test's time for nothing
    # it checks (tests/kernel/test_sampling*.py check it against the torch sampler): both runs
    # sample with the torch reference.
    monkeypatch.setattr(
        sampling,
        "sample_triton",
        lambda logits, bitmask, params, *, all_greedy=False, candidates=None: sampling.sample_torch(
            logits, bitmask, params, all_greedy=all_greedy
        ),
    )
    _, plain = _run(tiny_engine_factory, stage=False)
    engine, staged = _run(tiny_engine_factory, stage=True)
    assert staged == plain
    graphs = engine.core.runner.graphs
    assert graphs.steps >= 6 and graphs.replays == 0  # decode steps went through the staging


def test_staged_logits_equal_plain_logits_with_padding_and_long_contexts(tiny_engine_factory, monkeypatch):
    """A 3-row decode step padded to bucket 4 (one scratch row), contexts over several pages,
    under the Triton kernels with a split-KV count fixed as a graph would fix it."""
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", "triton")
    engine = tiny_engine_factory(max_num_seqs=4, page_size=16)
    runner = engine.core.runner
    assert runner.enable_decode_graphs(4, engine.max_model_len, capture=False)
    graphs = runner.graphs
    prompts = ["word " * 40, "another prompt " * 12, "x"]

    # One decode step by hand, as the scheduler would build it, for three live requests.
    from constrained_serve.engine.batch import Batch, ScheduledChunk
    from constrained_serve.engine.request import Request

    reqs = []
    for p in prompts:
        ids = engine.tokenizer(p)["input_ids"]
        r = Request(prompt_ids=ids, params=SamplingParams(max_tokens=4))
        assert engine.kv.ensure_pages(r, len(ids) + 1)
        reqs.append(r)
    for r in reqs:  # compute the prompts' K/V first
        runner.forward(runner.prepare(Batch([ScheduledChunk(r, r.num_prompt, sample=True)])))
        r.num_computed = r.num_prompt
        r.token_ids.append(5 + len(r.token_ids) % 7)
    before = graphs.steps  # a one-token prompt is decode-shaped: it may have used them too
    inputs = runner.prepare(Batch([ScheduledChunk(r, 1, sample=True) for r in reqs]))
    assert graphs.fits(inputs.input_ids, inputs.meta, inputs.prompt_rows)
    plain = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, inputs.logits_indices)
    staged = runner.forward(inputs)
    assert graphs.bucket_for(3) == 4 and graphs.steps == before + 1
    torch.testing.assert_close(staged, plain, rtol=1e-4, atol=1e-4)
    for r in reqs:
        engine.kv.release(r, cache_tokens=False)


def test_long_prefill_chunks_never_use_the_graphs(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_seqs=8)
    runner = engine.core.runner
    runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
    long_prompts = [p + " and then some more words to make it long enough" * 2 for p in PROMPTS[:2]]
    engine.generate(long_prompts, SamplingParams(max_tokens=1))  # one prefill step, no decode
    assert runner.graphs.steps == 0


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_short_chunks_unrolled_into_rows_give_the_plain_logits(tiny_engine_factory, monkeypatch, kernels):
    """Two decode rows and two chunks of 5 and 3 tokens (forced tokens) in one step, padded to
    bucket 16: each chunk token is a row of its own, attending up to its own position."""
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", kernels)
    engine = tiny_engine_factory(max_num_seqs=4, page_size=16)
    runner = engine.core.runner
    assert runner.enable_decode_graphs(12, engine.max_model_len, capture=False)
    graphs = runner.graphs

    from constrained_serve.engine.batch import Batch, ScheduledChunk
    from constrained_serve.engine.request import Request

    prompts = ["word " * 40, "another prompt " * 12, "x y z", "a somewhat longer prompt " * 3]
    new = [1, 5, 1, 3]  # tokens each request feeds this step
    reqs = []
    for p, k in zip(prompts, new):
        ids = engine.tokenizer(p)["input_ids"]
        r = Request(prompt_ids=ids, params=SamplingParams(max_tokens=4))
        assert engine.kv.ensure_pages(r, len(ids) + k)
        reqs.append(r)
    for r, k in zip(reqs, new):  # the prompts' K/V first, then k tokens to feed
        runner.forward(runner.prepare(Batch([ScheduledChunk(r, r.num_prompt, sample=True)])))
        r.num_computed = r.num_prompt
        r.token_ids.extend(5 + (len(r.token_ids) + i) % 7 for i in range(k))
    before, unrolled = graphs.steps, graphs.unrolled  # the short prompt went through them too
    inputs = runner.prepare(Batch([ScheduledChunk(r, k, sample=True) for r, k in zip(reqs, new)]))
    assert graphs.fits(inputs.input_ids, inputs.meta, inputs.prompt_rows)
    plain = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, inputs.logits_indices)
    staged = runner.forward(inputs)
    assert graphs.bucket_for(10) == 12 and graphs.steps == before + 1 and graphs.unrolled == unrolled + 1
    assert staged.shape == (4, plain.shape[1])
    torch.testing.assert_close(staged, plain, rtol=1e-4, atol=1e-4)
    # A chunk longer than the unrolling limit is left to the eager path.
    from constrained_serve.runtime.cuda_graphs import MAX_UNROLLED_CHUNK

    reqs[1].token_ids.extend([7] * (MAX_UNROLLED_CHUNK + 1))
    reqs[1].num_computed += 5
    assert engine.kv.ensure_pages(reqs[1], reqs[1].num_tokens)
    long = runner.prepare(Batch([ScheduledChunk(reqs[1], MAX_UNROLLED_CHUNK + 1, sample=True)]))
    assert not graphs.fits(long.input_ids, long.meta, long.prompt_rows)
    for r in reqs:
        engine.kv.release(r, cache_tokens=False)


def test_constrained_decoding_through_unrolled_steps_gives_the_plain_tokens(tiny_engine_factory):
    """Forced tokens join the next step as short chunks; those steps go through the graph
    staging too, and the tokens are the eager ones."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}},
        "required": ["name", "count"],
    }
    outs = []
    for stage in (False, True):
        engine = tiny_engine_factory(max_num_seqs=4)
        if stage:
            assert engine.core.runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
        rs = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=40, temperature=0.8, seed=3), schema=schema)
        outs.append([r.token_ids for r in rs])
    assert outs[0] == outs[1]
    assert engine.core.runner.graphs.unrolled > 0


def test_capture_refuses_a_cpu_engine(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_seqs=4)
    # Not on CUDA: capture is skipped with a log line, and decode stays eager.
    assert not engine.core.runner.enable_decode_graphs(4, engine.max_model_len)
    assert engine.core.runner.graphs is None


def test_cuda_graph_config_is_validated():
    from constrained_serve.config import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineConfig(cuda_graph_max_batch=0)
    assert EngineConfig(max_num_seqs=64).graph_batch() == 80  # room for forced-token chunks
    assert EngineConfig(max_num_seqs=4).graph_batch() == 12
    assert EngineConfig(max_num_seqs=1000).graph_batch() == 512
    assert EngineConfig(max_num_seqs=64, cuda_graph_max_batch=16).graph_batch() == 16
