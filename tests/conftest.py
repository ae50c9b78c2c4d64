"""Shared fixtures. TRITON_INTERPRET must be set before anything defines the Triton kernels,
so the kernel tests run on CPU through the interpreter."""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
# Two cores: one intra-op thread for the model leaves the other to grammar/mask workers, the
# child processes some tests start and whatever else runs on the machine. With two threads,
# every OpenMP barrier of a forward waits a scheduler time slice for a thread whose core was
# taken (runtime/thread_tuner.py): a 4-token generate on the default model measured 15 s
# instead of 1.3 s beside a busy neighbour. OMP_NUM_THREADS is what Engine() (num_threads
# None) reads, here and in the child processes (helpers.subprocess_env copies os.environ).
# Tests that need more threads set them themselves (tests/kernel/conftest.py, the tuner's).
THREADS = os.environ.get("CS_TEST_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", THREADS)
# On a CPU with bf16 units (AMX, AVX512-BF16) Engine() with no dtype checks bf16 against fp32
# on each new model (runtime/cpu_dtype.py) and may run bf16: every tiny model of a session is
# a new folder, and the tests that compare with transformers expect fp32. So the suite runs
# fp32 on every CPU; tests/runtime/test_cpu_dtype.py turns the pick on where it tests it.
os.environ.setdefault("CONSTRAINED_SERVE_AUTO_BF16", "0")

import signal  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# A run started in the background of a non-interactive shell (`cmd &`, as CI scripts and
# nohup wrappers do) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
# handler: the Ctrl-C tests (tests/engine/test_interrupts.py, the CLI's, which send SIGINT to
# this process or to children that would inherit the same) would test nothing. Ctrl-C as a
# user's terminal delivers it is what they test, so restore Python's own handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

torch.set_num_threads(int(THREADS))

# The test files that take longest on 2 cores (--durations, 2026-12-07), longest first.
# pytest-xdist hands whole files to its two workers in collection order (make test turns off
# its reordering by test count, --no-loadscope-reorder): started first, the long files no
# longer run alone at the end while the other worker idles (that tail was 40 s of 648).
# Only the order changes; a file not listed keeps its place after these.
SLOWEST_FILES = [
    "tests/ray/test_pipeline.py",  # 206 s
    "tests/engine/test_engine_structured.py",  # 84 s
    "tests/docs/test_examples.py",  # 76 s
    "tests/grammar/test_conformance.py",  # 62 s
    "tests/server/test_tools.py",  # 51 s
    "tests/docs/test_notebook.py",  # 48 s
    "tests/models/test_llama.py",  # 47 s
    "tests/engine/test_engine.py",  # 44 s
    "tests/cli/test_extract_command.py",  # 37 s
    "tests/docs/test_docs.py",  # 36 s
    "tests/runtime/test_cuda_graphs.py",  # 36 s
    "tests/tools/test_engine_tools.py",  # 34 s
    "tests/kernel/test_sampling_candidates.py",  # 33 s
    "tests/server/test_hardening.py",  # 31 s
    "tests/grammar/test_worker.py",  # 30 s
    "tests/engine/test_engine_grammar_faults.py",  # 29 s
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole


@pytest.fixture(scope="session")
def default_model_dir():
    from constrained_serve.models.loader import default_model_dir as d

    try:
        return d()
    except ValueError as e:
        pytest.fail(f"the default model is missing ({e}); run `make setup`")


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="session")
def default_engine(default_model_dir):
    """One Engine on the real default model, shared by the slow end-to-end tests."""
    from constrained_serve import Engine

    return Engine(max_num_seqs=32)


@pytest.fixture(scope="session")
def engine(default_engine):
    """The session's default-model Engine, under the name the CLI, display, docs and grammars
    tests use: loading the model is the slowest part of these tests, so it happens once."""
    return default_engine


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


def _save_tiny(tmp_path_factory, name, config, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-init weights make the logits sensitive to any mistake in our forward.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(d), safe_serialization=True)
    tokenizer.save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_tokenizer):
    from transformers import LlamaConfig

    from .models.helpers import small_config

    cfg = small_config(
        LlamaConfig,
        default_tokenizer,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    return _save_tiny(tmp_path_factory, "tiny_llama", cfg, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, default_tokenizer):
    from transformers import Qwen3Config

    from .models.helpers import small_config

    cfg = small_config(
        Qwen3Config, default_tokenizer, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True
    )
    return _save_tiny(tmp_path_factory, "tiny_qwen3", cfg, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama_dir):
    """Build Engines on the tiny Llama checkpoint (fast: tests of scheduling and caching)."""
    from constrained_serve import Engine

    def make(**kw):
        kw.setdefault("max_num_seqs", 16)
        return Engine(model=str(tiny_llama_dir), **kw)

    return make


def _sentencepiece_model(path, variant: str):
    """A tiny Llama with a SentencePiece-style (Llama/Mistral) tokenizer: "legacy" (a "▁"
    prepended by the normalizer, as Llama-2's tokenizer.json) or "metaspace" (Metaspace with
    prepend_scheme "first", as Mistral v0.3). Both read a text as the start of a text."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = "hello world say more about the story of a cat and a dog in the garden".split()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + " [INST] [/INST]" for _ in range(300)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if variant == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())  # byte tokens are ordinary pieces in a SentencePiece vocabulary
    for i in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{i:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
        " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    )
    hf.save_pretrained(str(path))
    cfg = LlamaConfig(
        vocab_size=len(hf),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def sentencepiece_model_dirs(tmp_path_factory):
    """{"legacy": dir, "metaspace": dir}: tiny Llamas with SentencePiece-style tokenizers."""
    return {v: _sentencepiece_model(tmp_path_factory.mktemp(f"sp_{v}"), v) for v in ("legacy", "metaspace")}
