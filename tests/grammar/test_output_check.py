"""The check of a finished output (output_check.py): parsed as the user reads the spec (json
and the schema's validator, re, lark, the Python type), each within a time bound; what a
backend read more loosely is reported (OutputValidationError, the JSON kept), never passed
as valid."""

from __future__ import annotations

import datetime
import json
import logging
import time
import uuid
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from constrained_serve.errors import OutputValidationError
from constrained_serve.grammar import make_output_spec, parse_output

GRAMMARS = Path(__file__).resolve().parents[2] / "grammars"


def test_a_finished_output_is_checked_against_the_spec_as_the_user_reads_it():
    """The last line of the guarantee: where a backend read the spec more loosely (xgrammar's
    ASCII \\w, llguidance's Rust Unicode tables, a schema keyword it dropped), the finished
    output is reported (OutputValidationError, JSON kept), never passed as valid."""
    from constrained_serve.errors import OutputValidationError

    # regex= reads \w as ASCII by default, in the grammar and in the check alike ...
    ascii_regex = make_output_spec(regex=r"\w+")
    assert parse_output(ascii_regex, "ab_1") == (None, "ab_1")
    with pytest.raises(OutputValidationError, match="re.fullmatch"):
        parse_output(ascii_regex, "é日")
    # ... and as Python's Unicode \w with unicode_classes=True.
    regex = make_output_spec(regex=r"\w+", unicode_classes=True)
    assert parse_output(regex, "é日") == (None, "é日")
    with pytest.raises(OutputValidationError, match="re.fullmatch"):
        parse_output(regex, "हिंदी")  # Rust's \w takes the combining vowel signs, Python's does not
    assert parse_output(make_output_spec(regex=r"\p{L}+"), "x") == (None, "x")  # not Python syntax: no check
    schema = {
        "type": "object",
        "properties": {"b": {"type": "string"}},
        "patternProperties": {".*": {"type": "string"}},
        "required": ["b"],
    }
    with pytest.raises(OutputValidationError, match="at k") as e:
        parse_output(make_output_spec(schema=schema), '{"b":"a","k":-2}')
    assert e.value.value == {"b": "a", "k": -2}
    # strict=False accepted the backend's approximation: its outputs stand.
    assert parse_output(make_output_spec(schema=schema, strict=False), '{"b":"a","k":-2}')[0] == {"b": "a", "k": -2}
    assert parse_output(make_output_spec(regex=r"\w+", strict=False, unicode_classes=True), "हिंदी")[1] == "हिंदी"


def test_the_conformance_check_never_flags_valid_outputs():
    """Float multipleOf (jsonschema's float division), draft-04 booleans without $schema and
    Rust-only regex classes are left to the backend rather than reported as errors."""
    price = make_output_spec(schema={"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.01}}})
    assert parse_output(price, '{"p":19.99}')[0] == {"p": 19.99}
    old = make_output_spec(schema={"type": "integer", "minimum": 0, "exclusiveMinimum": True})
    assert parse_output(old, "1")[0] == 1
    assert parse_output(make_output_spec(regex="[[:alpha:]]+"), "abc")[1] == "abc"
    # Lark: what lark cannot read (llguidance's special tokens, Rust-only regex) goes unchecked,
    # and lark's LALR parser refusing a valid text (a shift/reduce conflict lark resolved
    # silently: " + " in arith.lark) is not a refusal: its Earley parser decides.
    assert parse_output(make_output_spec(grammar='start: "a" <[2]>'), "a")[1] == "a"
    assert parse_output(make_output_spec(grammar="start: /\\p{L}+/"), "abc")[1] == "abc"
    arith = (GRAMMARS / "arith.lark").read_text()
    assert parse_output(make_output_spec(grammar=arith), "1 + 2 * 3")[1] == "1 + 2 * 3"
    long = " + ".join(["(12.5 - 3)"] * 40)  # past the Earley length bound, LALR refuses: unchecked
    assert len(long) > 256 and parse_output(make_output_spec(grammar=arith), long)[1] == long


def test_the_final_regex_check_is_bounded(caplog):
    """re.fullmatch backtracks exponentially on some pattern and text pairs, and a text that
    does not match is what the check exists for. The check runs with a time bound: re took
    ~20 s for this one (and 4x longer per extra character)."""
    t0 = time.perf_counter()
    with pytest.raises(OutputValidationError, match="re.fullmatch"):
        parse_output(make_output_spec(regex=r"(\w+\s?)+"), "a" * 28 + "!")
    assert time.perf_counter() - t0 < 3
    # Still Python's \w (the regex package's own takes the combining marks of "हिंदी").
    with pytest.raises(OutputValidationError):
        parse_output(make_output_spec(regex=r"(\w+\s?)+"), "हिंदी")
    # A match that runs past the bound is left unchecked, and says so.
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="constrained_serve.grammar.regex_check"):
        assert parse_output(make_output_spec(regex="(a|a)+b"), "a" * 28) == (None, "a" * 28)
    assert time.perf_counter() - t0 < 3 and "left unchecked" in caplog.text


def test_schema_patterns_are_checked_as_ecma_262_reads_them_within_a_bound(caplog):
    r"""A JSON Schema pattern means what it means in ECMA-262: \w and \d are ASCII, so \W takes
    "é" (as both backends do); jsonschema's re.search refused it, after backtracking for
    seconds. Its \s is ECMA's (U+FEFF, not U+001C). patternProperties and
    additionalProperties read their patterns the same way."""
    spec = make_output_spec(schema={"type": "string", "pattern": "^(\\W+\\s?)+$"})
    t0 = time.perf_counter()
    assert parse_output(spec, '"' + "!" * 26 + 'é"')[0] == "!" * 26 + "é"
    assert time.perf_counter() - t0 < 3
    with pytest.raises(OutputValidationError, match="does not match"):
        parse_output(spec, '"!a"')
    space = make_output_spec(schema={"type": "string", "pattern": "^\\s$"})
    assert parse_output(space, '"\\ufeff"')[0] == "\ufeff"
    with pytest.raises(OutputValidationError):
        parse_output(space, '"\\u001c"')
    keys = make_output_spec(
        schema={"type": "object", "patternProperties": {"^\\W+$": {"type": "integer"}}, "additionalProperties": False}
    )
    assert parse_output(keys, '{"é":1}')[0] == {"é": 1}
    with pytest.raises(OutputValidationError, match="at é"):
        parse_output(keys, '{"é":"x"}')
    with pytest.raises(OutputValidationError, match="do not match any of the regexes"):
        parse_output(keys, '{"a":1,"b":2}')
    # Past the bound: unchecked, with a warning.
    slow = make_output_spec(schema={"type": "string", "pattern": "^(a|a)+$"})
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="constrained_serve.grammar.regex_check"):
        assert parse_output(slow, '"' + "a" * 28 + 'b"')[0] == "a" * 28 + "b"
    assert time.perf_counter() - t0 < 3 and "left unchecked" in caplog.text


class Note(BaseModel):
    model_config = ConfigDict(strict=True)
    when: datetime.datetime
    text: str


def test_a_lone_surrogate_escape_parses_into_the_type(manager):
    """'\\ud800' is valid JSON text that xgrammar's JSON grammar allows and json.loads reads,
    but Pydantic's JSON parser refuses (json_invalid): parsed then comes from the json.loads
    value, in lax Python mode, so a strict model still reads its ISO datetime string, and
    json and parsed hold the same string."""
    spec = make_output_spec(schema=Note)
    text = '{"when":"2024-01-01T09:00:00Z","text":"a\\ud800"}'
    assert manager.matches(manager.compile(spec, "xgrammar"), text)
    value, parsed = parse_output(spec, text)
    assert value == {"when": "2024-01-01T09:00:00Z", "text": "a\ud800"}
    assert parsed == Note(when=datetime.datetime(2024, 1, 1, 9, tzinfo=datetime.timezone.utc), text="a\ud800")
    assert parsed.text == value["text"]
    # The type's own refusals still stand, with the JSON kept.
    with pytest.raises(OutputValidationError) as refused:
        parse_output(spec, '{"when":"soon","text":"\\ud800"}')
    assert refused.value.value == {"when": "soon", "text": "\ud800"}


def test_the_lark_deadline_only_cuts_the_code_it_bounds():
    """The deadline is checked at calls of functions under the bounded folder only: a
    finalizer or collector callback that runs meanwhile (elsewhere) is never cut short."""
    import os
    import time as clock

    from constrained_serve.grammar.output_check import _call_with_deadline, _Deadline

    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    calls_elsewhere = []

    def bounded_work():
        end = clock.perf_counter() + 0.05
        while clock.perf_counter() < end:
            pass
        calls_elsewhere.append(json.dumps([1]))  # json is not under ``here``: not cut
        _inner()  # defined here: cut

    def _inner():
        raise AssertionError("reached past the deadline")

    with pytest.raises(_Deadline):
        _call_with_deadline(bounded_work, 0.01, here)
    assert calls_elsewhere == ["[1]"]
    assert _call_with_deadline(lambda: 7, 1.0, here) == 7


class Stamp(BaseModel):
    model_config = ConfigDict(strict=True)
    when: datetime.datetime
    ref: uuid.UUID | str


def test_parsed_is_what_the_type_reads_from_json():
    """parsed is TypeAdapter.validate_json of the text: a strict model takes ISO datetimes and
    UUIDs as JSON strings (Python-mode validation refused every valid output), and a union
    "UUID | str" resolves to the UUID (Python mode picked the str)."""
    from constrained_serve.grammar import make_output_spec, parse_output

    text = '{"when":"2024-01-01T09:00:00Z","ref":"123e4567-e89b-12d3-a456-426614174000"}'
    value, parsed = parse_output(make_output_spec(schema=Stamp), text)
    assert parsed == Stamp.model_validate_json(text) and isinstance(parsed.ref, uuid.UUID)
    assert value == json.loads(text)


def test_lark_earley_check_is_time_bounded(caplog):
    # No LALR parser (a reduce/reduce conflict) and an ambiguous grammar: lark's Earley
    # parser took 0.3 s on 64 characters and ~n^3.5 beyond. It stops at its time bound
    # and the output goes unchecked, rather than stalling the batch for seconds.
    spec = make_output_spec(grammar='start: e\ne: e e | A | b\nb: A\nA: "a"\n')
    t0 = time.perf_counter()
    with caplog.at_level(logging.DEBUG, logger="constrained_serve.grammar.output_check"):
        assert parse_output(spec, "a" * 200) == (None, "a" * 200)
    assert time.perf_counter() - t0 < 2 and "left unchecked" in caplog.text
    with pytest.raises(OutputValidationError):  # a short refusal still comes through
        parse_output(spec, "ab")
