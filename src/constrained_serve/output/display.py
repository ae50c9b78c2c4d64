"""How a Result looks in Jupyter (``_repr_html_``) and in a terminal (``__repr__``).

Both read only the public Result fields (text, json, parsed, finish_reason, stop_reason, usage, error,
source_text, spans), so they work on any object with that shape. Grounded values are shown
where they stand: the source text with each span highlighted, its JSON path on hover.
Everything taken from the model or the user is HTML-escaped: model output is untrusted text
inside the notebook page.
"""

from __future__ import annotations

import html
import json
from typing import Any

_MAX_TEXT = 2000  # characters of raw text shown before eliding; a repr must stay readable
_MAX_ROWS = 50  # table rows shown before eliding


def _value(result: Any) -> tuple[str, Any]:
    """(kind, value): the richest view of the output the result has.

    ``parsed`` is a Pydantic instance for a model schema, the JSON value itself for a plain
    JSON Schema, and the text for regex / grammar outputs; only the first is worth a label.
    """
    parsed = getattr(result, "parsed", None)
    value = getattr(result, "json", None)
    dump = getattr(parsed, "model_dump", None)
    if callable(dump):
        return type(parsed).__name__, dump(mode="json")
    if value is not None:
        return "json", value
    if parsed is not None and not isinstance(parsed, str):  # e.g. a TypeAdapter-validated type
        return type(parsed).__name__, parsed
    return "text", getattr(result, "text", "") or ""


def _usage_line(result: Any) -> str:
    usage = getattr(result, "usage", None)
    if usage is None:
        return ""
    parts = [f"{getattr(usage, 'prompt_tokens', 0)} prompt"]
    cached = getattr(usage, "cached_tokens", 0)
    if cached:
        parts[0] += f" ({cached} cached)"
    parts.append(f"{getattr(usage, 'completion_tokens', 0)} generated")
    forced = getattr(usage, "forced_tokens", 0)
    if forced:
        parts[-1] += f" ({forced} forced by the grammar)"
    return "tokens: " + ", ".join(parts)


def _elide(text: str, limit: int = _MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit} more characters)"


def _pretty(value: Any) -> str:
    return _elide(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def _cell(value: Any) -> str:
    """One table cell: scalars inline, nested values as small pretty JSON."""
    if isinstance(value, str):
        return html.escape(_elide(value, 500))
    if isinstance(value, (dict, list)):
        return f"<pre style='margin:0'>{html.escape(_pretty(value))}</pre>"
    return f"<code>{html.escape(json.dumps(value, default=str))}</code>"


def _table(obj: dict[str, Any], confidence: dict[str, float] | None = None) -> str:
    """key | value rows; with field confidences, a third column (the value's probability)."""
    from .json_spans import child_path

    rows = []
    for i, (key, value) in enumerate(obj.items()):
        if i == _MAX_ROWS:
            rows.append(f"<tr><td colspan='2'><i>… {len(obj) - _MAX_ROWS} more fields</i></td></tr>")
            break
        p = (confidence or {}).get(child_path("$", str(key)))
        conf = f"<td style='color:#666'>p={p:.2g}</td>" if p is not None else ""
        rows.append(
            f"<tr><th style='text-align:left;vertical-align:top'>{html.escape(str(key))}</th>"
            f"<td style='text-align:left'>{_cell(value)}</td>{conf}</tr>"
        )
    return "<table>" + "".join(rows) + "</table>"


_MARK = "background:#fff2a8;border-radius:2px"


def _source_html(result: Any) -> str:
    """The source text with the grounded values' spans highlighted (Result.spans), or ""."""
    source, spans = getattr(result, "source_text", None), getattr(result, "spans", None)
    if not source or not spans:
        return ""
    # Spans may nest or repeat (two fields quoting the same words): each character is marked
    # once, with the paths of every span over it in its title.
    more = len(source) - _MAX_TEXT
    source = source[:_MAX_TEXT]  # elided before marking: a cut never falls inside a tag
    cover: list[list[str]] = [[] for _ in source]
    for path, (start, end) in spans.items():
        for i in range(max(0, start), min(len(source), end)):
            cover[i].append(path)
    out, i = [], 0
    while i < len(source):
        j = i
        while j < len(source) and cover[j] == cover[i]:
            j += 1
        piece = html.escape(source[i:j])
        if cover[i]:
            piece = f"<mark style='{_MARK}' title='{html.escape(', '.join(cover[i]), quote=True)}'>{piece}</mark>"
        out.append(piece)
        i = j
    return (
        "<div style='color:#666;font-size:smaller'>source (grounded values highlighted):</div>"
        f"<pre style='white-space:pre-wrap;margin:0'>{''.join(out)}"
        f"{f'… ({more} more characters)' if more > 0 else ''}</pre>"
    )


def _finish(result: Any) -> str:
    """The finish reason, with the stop string or token that caused it when there is one."""
    finish = str(getattr(result, "finish_reason", None))
    stop = getattr(result, "stop_reason", None)
    return finish if stop is None else f"{finish} ({stop!r})"


def result_repr_html(result: Any) -> str:
    """HTML for Jupyter: the output (a table for a flat-ish object, else pretty JSON or
    text), then finish reason, token counts and any error."""
    kind, value = _value(result)
    confidence = getattr(result, "field_confidence", None) or {}
    if isinstance(value, dict) and value:
        body = _table(value, confidence)
    elif kind == "text":
        body = f"<pre style='white-space:pre-wrap'>{html.escape(_elide(str(value)))}</pre>"
    else:
        body = f"<pre>{html.escape(_pretty(value))}</pre>"
    meta = [f"<b>{html.escape(kind)}</b>", f"finish: <code>{html.escape(_finish(result))}</code>"]
    usage = _usage_line(result)
    if usage:
        meta.append(html.escape(usage))
    error = getattr(result, "error", None)
    err_html = ""
    if error:
        etype = getattr(result, "error_type", None)
        label = html.escape(f"{etype}: {error}" if etype else str(error))
        err_html = f"<div style='color:#b00020'>error: {label}</div>"
    return (
        "<div class='constrained-serve-result'>"
        f"{body}{_source_html(result)}{err_html}"
        f"<div style='color:#666;font-size:smaller'>{' · '.join(meta)}</div>"
        "</div>"
    )


def result_repr_text(result: Any) -> str:
    """One compact line (two with an error) for ``repr(result)``."""
    kind, value = _value(result)
    if kind == "text":
        shown = repr(_elide(str(value), 200))
    else:
        shown = _elide(json.dumps(value, ensure_ascii=False, default=str), 200)
        if kind != "json":
            shown = f"{kind}({shown})"
    fields = [f"finish_reason={getattr(result, 'finish_reason', None)!r}"]
    if getattr(result, "stop_reason", None) is not None:
        fields.append(f"stop_reason={result.stop_reason!r}")
    usage = _usage_line(result)
    if usage:
        fields.append(usage)
    spans = getattr(result, "spans", None)
    if spans:
        fields.append(f"spans={len(spans)} grounded")
    samples = getattr(result, "samples", None)
    if samples:
        fields.append(f"samples={len(samples)} (the first shown)")
    error = getattr(result, "error", None)
    if error:
        etype = getattr(result, "error_type", None)
        fields.append(f"error={(f'{etype}: ' if etype else '') + str(error)!r}")
    return f"Result({shown}, {', '.join(fields)})"
