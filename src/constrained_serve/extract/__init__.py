"""The resumable JSONL extraction job behind ``constrained-serve extract``: ``inputs.py``
reads the input into prompts (or error rows), ``job.py`` runs the engine over them and turns
results into rows, ``output.py`` appends rows and finds what a resumed run has already
written."""

from .inputs import InputItem, PromptBuilder, count_rows, read_items
from .job import JobStats, result_row, run_extract
from .output import OutputFileError, open_sinks, row_key, written_row_key

__all__ = [
    "InputItem",
    "JobStats",
    "OutputFileError",
    "PromptBuilder",
    "count_rows",
    "open_sinks",
    "read_items",
    "result_row",
    "row_key",
    "run_extract",
    "written_row_key",
]
