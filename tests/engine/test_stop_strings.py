"""Stop strings and stop tokens (stop_strings.py): the text ends before the stop, in streams
too; a stop inside grammar-forced tokens ends the output where it is completed; what a stop
leaves of a constrained output is complete or says it was cut."""

import pytest

from constrained_serve import SamplingParams


def test_stop_strings_cut_the_text(tiny_engine_factory):
    eng = tiny_engine_factory()
    free = eng.generate("Once upon", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[4:7]
    r = eng.generate("Once upon", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert stop not in r.text
    assert free.text.startswith(r.text)
    # A stream shows exactly the result's text: never the stop string, nor what follows it.
    assert "".join(eng.stream("Once upon", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))) == r.text


def test_stop_token_ids_and_max_tokens(tiny_engine_factory):
    eng = tiny_engine_factory()
    free = eng.generate("Once upon", SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    tok = free.token_ids[3]
    r = eng.generate("Once upon", SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] == tok and tok not in r.token_ids[:-1]
    assert r.stop_reason == tok and free.stop_reason is None
    # As in vLLM, the stop token stays in token_ids but its text is not part of the output.
    before = eng.tokenizer.decode(r.token_ids[:-1])
    assert r.text == before and free.text.startswith(before + eng.tokenizer.decode([tok]))
    assert (
        "".join(eng.stream("Once upon", SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[tok]))) == r.text
    )


def test_stop_string_inside_a_long_fast_forward_is_seen(tiny_engine_factory):
    """The grammar forces ~100 characters in one go; the stop string sits near their start.
    It must end the request there (the old check only looked at the last 64 characters)."""
    eng = tiny_engine_factory()
    forced = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma: "
    [r] = eng.generate(["x"], SamplingParams(max_tokens=60, stop=["beta"]), regex=forced + "[a-z ]{0,80}")
    [whole] = eng.generate(["x"], SamplingParams(max_tokens=60), regex=forced + "[a-z ]{0,80}")
    assert whole.usage.forced_tokens > 10
    assert r.finish_reason == "stop" and r.text == "alpha " and r.stop_reason == "beta"
    assert r.parsed is None and r.error_type == "truncated" and "stop string 'beta'" in r.error
    assert r.usage.completion_tokens == r.usage.forced_tokens  # nothing sampled after the stop
    # The output ends at the token that completes the stop string, as had the forced tokens
    # been sampled one by one (fast_forward=False): none of the forced tokens after it.
    ids = eng.tokenizer.encode(forced, add_special_tokens=False)
    n = next(i + 1 for i in range(len(ids)) if "beta" in eng.tokenizer.decode(ids[: i + 1]))
    assert r.token_ids == ids[:n]


@pytest.mark.parametrize("fast_forward", [True, False])
def test_stop_token_among_forced_tokens_ends_there(tiny_engine_factory, fast_forward):
    """A stop token ends the output where it stands, whether the grammar forced it (fast-forward)
    or it was sampled under a one-token mask; a constrained output cut short says so."""
    eng = tiny_engine_factory(fast_forward=fast_forward)
    text = "alpha beta gamma delta"
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    stop = ids[len(ids) // 2]
    [r] = eng.generate(["x"], SamplingParams(max_tokens=30, stop_token_ids=[stop]), regex=text + "!")
    assert r.token_ids == ids[: len(ids) // 2 + 1]
    assert r.text == eng.tokenizer.decode(ids[: len(ids) // 2])  # without the stop token's text
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert (r.usage.forced_tokens > 0) == fast_forward
    assert r.parsed is None and r.error_type == "truncated" and "stop token" in r.error


def test_stop_string_leaving_a_complete_match_is_not_an_error(tiny_engine_factory):
    """A stop string may cut a constrained output where the grammar could have ended: that
    output is complete (parsed, no error); where it could not, the result says it was cut."""
    eng = tiny_engine_factory()
    seen = set()
    for seed in range(40):
        p = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
        [free] = eng.generate(["x"], p, regex="[ab]{1,8}")
        cut = free.text.find("b")
        if cut < 0 or (cut > 0) in seen:
            continue
        seen.add(cut > 0)
        p = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, stop=["b"])
        [r] = eng.generate(["x"], p, regex="[ab]{1,8}")
        assert r.text == free.text[:cut] and r.stop_reason == "b"
        if cut > 0:
            assert r.ok and r.parsed == r.text and r.error is None
        else:  # an empty output does not match [ab]{1,8}
            assert r.parsed is None and r.error_type == "truncated"
        if seen == {False, True}:
            break
    assert seen == {False, True}, "the seeds never gave both a leading 'b' and a later one"


def test_stop_string_in_the_closing_text_cuts_it(tiny_engine_factory):
    """The grammar's last characters hold the stop string: the stop string wins (it cuts the
    text), and the result says the output is incomplete rather than failing to parse."""
    eng = tiny_engine_factory()
    [r] = eng.generate(["x"], SamplingParams(max_tokens=10, stop=["!"]), regex="abc!")
    assert r.text == "abc" and r.finish_reason == "stop" and r.stop_reason == "!"
    assert r.parsed is None and r.error_type == "truncated"
