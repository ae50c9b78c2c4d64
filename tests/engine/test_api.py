"""The public API (api.py, and the package's generate()) end to end, on the real default model
and on the tiny one: results in input order, streams, generate_iter's bounds, threads sharing
one engine, what the first request imports."""

import json
import threading
import time

import jsonschema
import pytest

import constrained_serve
from constrained_serve import Engine, SamplingParams


@pytest.mark.slow
def test_capital_of_france(default_engine):
    [r] = default_engine.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32)
    )
    assert "Paris" in r.text
    assert r.finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens == len(r.token_ids)


@pytest.mark.slow
def test_results_in_input_order_and_usage(default_engine):
    msgs = [[{"role": "user", "content": f"Say the number {i} and nothing else."}] for i in range(6)]
    rs = default_engine.chat(msgs, SamplingParams(max_tokens=8))
    assert [r.index for r in rs] == list(range(6))
    assert all(str(i) in r.text for i, r in enumerate(rs))


@pytest.mark.slow
def test_stream_yields_the_same_text(default_engine):
    p = SamplingParams(max_tokens=20)
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = default_engine.chat(msgs, p)[0].text
    pieces = list(default_engine.stream(msgs, p))
    assert len(pieces) > 1 and "".join(pieces) == full


def test_generate_iter_streams_in_order(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompts = (f"item {i}" for i in range(20))
    out = list(eng.generate_iter(prompts, SamplingParams(max_tokens=3, ignore_eos=True), max_in_flight=4))
    assert [r.index for r in out] == list(range(20))
    assert all(len(r.token_ids) == 3 for r in out)
    assert not eng.core.scheduler.has_work()


def test_generate_iter_bounds_requests_not_prompts(tiny_engine_factory):
    """max_in_flight counts requests: a prompt sampled n times weighs n (it counted one, so
    n=256 let 65,536 requests queue at the default bound)."""
    eng = tiny_engine_factory()
    seen = []
    add = eng.core.add

    def counting_add(r):
        add(r)
        seen.append(len(eng.core.scheduler.unfinished))

    eng.core.add = counting_add
    p = SamplingParams(max_tokens=2, ignore_eos=True, n=3, temperature=1.0)
    out = list(eng.generate_iter((f"item {i}" for i in range(10)), p, max_in_flight=6))
    assert [len(r.samples) for r in out] == [3] * 10 and max(seen) <= 6


def test_module_level_generate_returns_one_or_many(monkeypatch, tiny_engine_factory):
    eng = tiny_engine_factory()
    monkeypatch.setattr(constrained_serve, "_default_engine", eng)
    one = constrained_serve.generate("hello", max_tokens=3)
    assert isinstance(one, constrained_serve.Result)
    many = constrained_serve.generate(["a", "b"], max_tokens=3)
    assert isinstance(many, list) and len(many) == 2


def test_module_level_generate_token_ids_and_all_sampling_fields(monkeypatch, tiny_engine_factory):
    eng = tiny_engine_factory()
    monkeypatch.setattr(constrained_serve, "_default_engine", eng)
    [r] = constrained_serve.generate([[5, 6, 7]], max_tokens=3, ignore_eos=True, logprobs=1, repetition_penalty=1.1)
    assert r.error is None and r.usage.prompt_tokens == 3 and len(r.logprobs) == 3
    with pytest.raises(TypeError, match="either params= or sampling keywords"):
        constrained_serve.generate("x", params=SamplingParams(max_tokens=7), max_tokens=3)


def test_stream_refuses_unknown_keywords_and_raises_when_aborted(tiny_engine_factory):
    eng = tiny_engine_factory()
    with pytest.raises(TypeError, match="shema"):
        list(eng.stream("x", SamplingParams(max_tokens=3), shema={"type": "object"}))
    dead = 'start: "a" b\nb: /[^\\s\\S]/\n'  # "a" is forced, then nothing can follow
    shown = []
    with pytest.raises(constrained_serve.OutputError, match="cannot be completed"):
        for delta in eng.stream("x", SamplingParams(max_tokens=8), grammar=dead):
            shown.append(delta)
    assert "".join(shown) == "a"
    assert not eng.core.has_work()


def test_device_auto_is_cpu_here(tiny_llama_dir):
    eng = Engine(model=str(tiny_llama_dir), device="auto", kv_cache_tokens=256)
    assert eng.device.type == "cpu"


def test_calls_from_several_threads_share_one_engine(tiny_engine_factory):
    """Threads may call one Engine at once (a notebook's background jobs, a web handler): one
    thread at a time drives the core, every step advances all callers' requests, and each
    call gets what it gets alone. Before the core lock, three such threads livelocked."""
    eng = tiny_engine_factory()
    eng.core.check_each_step = True  # page and refcount integrity after every step
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    jobs = {
        "greedy": lambda: [
            r.token_ids
            for r in eng.generate([f"p{i}" for i in range(3)], SamplingParams(max_tokens=6, ignore_eos=True))
        ],
        "seeded": lambda: [
            r.token_ids
            for r in eng.generate(["s", "t"], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
        ],
        "schema": lambda: [
            (r.finish_reason, r.text) for r in eng.generate(["a", "b"], SamplingParams(max_tokens=40), schema=schema)
        ],
        "stream": lambda: "".join(eng.stream("story", SamplingParams(max_tokens=8, ignore_eos=True))),
        "iter": lambda: [
            r.index
            for r in eng.generate_iter((f"q{i}" for i in range(5)), SamplingParams(max_tokens=3), max_in_flight=2)
        ],
    }
    alone = {k: f() for k, f in jobs.items()}
    together: dict = {}

    def run(k):
        together[k] = jobs[k]()

    # Daemon threads: a livelocked one fails the join below without keeping pytest alive.
    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "concurrent calls hung"
    assert together == alone
    assert [len(t) for t in together["greedy"]] == [6, 6, 6] and together["iter"] == list(range(5))
    for reason, text in together["schema"]:
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
    assert not eng.core.scheduler.has_work()


def test_start_up_imports_no_torch_compiler(tiny_llama_dir):
    """The first constrained request used to spend ~3 s importing torch's compiler stack
    (llguidance.torch's module-level torch.compile; nn.Embedding's init on the meta device
    imported torch._dynamo; Module.to_empty on the meta device imported sympy and torch's
    symbolic shapes, 0.6-0.8 s; Triton, 0.3 s, runs no kernel on CPU). Fresh interpreter: build
    an engine, run one constrained request."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from constrained_serve import Engine, SamplingParams\n"
        f"e = Engine(model={str(tiny_llama_dir)!r})\n"
        "e.generate(['x'], SamplingParams(max_tokens=3, temperature=0.7, top_k=5, seed=1), regex='[ab]+')\n"
        "slow = ('llguidance.torch', 'torch._inductor.compile_fx', 'torch._dynamo', 'sympy',"
        " 'torch.fx.experimental.symbolic_shapes', 'triton')\n"
        "print(sorted(m for m in slow if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
