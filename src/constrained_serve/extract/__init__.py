"""The resumable JSONL extraction job behind ``constrained-serve extract``: ``job.py`` reads
the input and runs the engine over it, ``output.py`` appends rows and finds what a resumed
run has already written."""

from .job import InputItem, JobStats, PromptBuilder, count_rows, read_items, result_row, run_extract
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
