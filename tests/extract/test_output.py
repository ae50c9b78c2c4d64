"""The output side of the extract job (output.py): the resume scan, which cuts a partial last
row and refuses a corrupt one, files it must never cut or write to, the lock against a second
writer, and the errors file."""

from __future__ import annotations

import json
import os

import pytest

from constrained_serve.extract.output import OutputFileError, open_sinks, row_key


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_a_row_with_a_lone_surrogate_id_is_written_and_resumed(tmp_path) -> None:
    out = str(tmp_path / "out.jsonl")
    sinks = open_sinks(out)
    sinks.write({"id": "a\udc00", "output": 1})
    sinks.close()
    assert open_sinks(out).done == {row_key("a\udc00")}


def test_resume_scan_collects_ids_and_cuts_a_partial_last_line(tmp_path) -> None:
    out = str(tmp_path / "out.jsonl")
    rows = b'{"id": 1, "output": {}}\n{"id": "x", "error": {"type": "invalid_json"}}\n'
    write_file(out, rows + b'{"id": 3, "outp')  # killed mid-write
    sinks = open_sinks(out)
    assert sinks.done == {row_key(1), row_key("x")}
    assert sinks.out.rows_before == 2
    sinks.write({"id": 3, "output": {"a": 1}})
    sinks.close()
    with open(out, "rb") as f:
        data = f.read()
    assert data == rows + b'{"id": 3, "output": {"a": 1}}\n'


def test_resume_scan_of_missing_and_empty_files(tmp_path) -> None:
    out = str(tmp_path / "new.jsonl")
    sinks = open_sinks(out)
    assert sinks.done == set() and os.path.exists(out)
    sinks.close()
    write_file(out, b'{"id": 1, "out')  # only a partial line
    sinks = open_sinks(out)
    assert sinks.done == set()
    sinks.close()
    assert os.path.getsize(out) == 0


@pytest.mark.parametrize("bad", [b"garbage\n", b'["no", "id"]\n', b'{"no_id": 1}\n'])
def test_resume_refuses_a_corrupt_complete_line(tmp_path, bad: bytes) -> None:
    out = str(tmp_path / "out.jsonl")
    original = b'{"id": 1, "output": 1}\n' + bad + b'{"id": 2, "output": 2}\n'
    write_file(out, original)
    with pytest.raises(OutputFileError, match="line 2"):
        open_sinks(out)
    with open(out, "rb") as f:
        assert f.read() == original  # left untouched


def test_a_file_we_did_not_write_is_never_cut(tmp_path) -> None:
    """Only a partial row of ours is cut: a one-line note or config without its newline, or
    JSON lines that are not output rows, make the run refuse the file, untouched."""
    for name, data in [
        ("notes.txt", b"important notes, do not lose"),
        ("cfg.json", b'{"id": 1}'),
        ("input.jsonl", b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n'),
    ]:
        path = str(tmp_path / name)
        write_file(path, data)
        with pytest.raises(OutputFileError, match="not an output row"):
            open_sinks(path)
        with open(path, "rb") as f:
            assert f.read() == data


def test_output_paths_that_cannot_be_resumed_are_refused(tmp_path) -> None:
    src = str(tmp_path / "in.jsonl")
    write_file(src, b'{"id": "a", "text": "x"}')
    for args, message in [
        ((src,), "is the input file"),
        ((str(tmp_path / "o.jsonl"), src), "is the input file"),
        (("-",), "stdout"),
        (("/dev/null",), "not a regular file"),
        ((str(tmp_path / "no" / "dir.jsonl"),), "cannot open for writing"),
    ]:
        with pytest.raises(OutputFileError, match=message):
            open_sinks(*args, input_path=src)
    with open(src, "rb") as f:
        assert f.read() == b'{"id": "a", "text": "x"}'


def test_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path) -> None:
    out = str(tmp_path / "out.jsonl")
    first = open_sinks(out)
    with pytest.raises(OutputFileError, match="another run"):
        open_sinks(out)
    first.close()
    open_sinks(out).close()  # free again once closed


def test_errors_file_gets_error_rows_and_counts_for_resume(tmp_path) -> None:
    out, err = str(tmp_path / "out.jsonl"), str(tmp_path / "err.jsonl")
    sinks = open_sinks(out, err)
    sinks.write({"id": 1, "output": 1})
    sinks.write({"id": 2, "error": {"type": "x", "message": "m"}})
    sinks.close()
    assert [json.loads(x)["id"] for x in open(out)] == [1]
    assert [json.loads(x)["id"] for x in open(err)] == [2]
    sinks = open_sinks(out, err)
    assert sinks.done == {row_key(1), row_key(2)}
    sinks.close()
    with pytest.raises(OutputFileError):
        open_sinks(out, out)
