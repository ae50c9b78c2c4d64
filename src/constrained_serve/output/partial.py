"""Partial objects while a JSON output streams (``stream(..., schema=Model, partial=True)``).

Each time another field of the top-level object is complete (its value fully written: a
string closed, a number followed by a comma...), a new partial object is yielded: for a
Pydantic model, ``Model.model_construct`` with the complete fields, each validated alone (a
field not written yet is absent: ``model_fields_set`` tells which are there, and reading one
that is not raises AttributeError); for a plain schema, a dict of them. The stream ends with
the final object, validated as a whole (``Result.parsed``, or ``Result.json`` without a type).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import OutputError
from .json_spans import complete_members

if TYPE_CHECKING:
    from ..params import OutputSpec
    from ..result import Result

__all__ = ["PartialObjects", "final_object"]


class PartialObjects:
    def __init__(self, python_type: Any = None) -> None:
        self.type = python_type
        self.text = ""
        self.count = 0
        self._fields: dict[str, Any] | None = None
        try:
            from pydantic import BaseModel, TypeAdapter

            if isinstance(python_type, type) and issubclass(python_type, BaseModel):
                self._fields = {name: TypeAdapter(f.annotation) for name, f in python_type.model_fields.items()}
        except ImportError:
            pass

    def feed(self, delta: str) -> Any | None:
        """Add text; a new partial object when another field completed, else None."""
        self.text += delta
        try:
            members = complete_members(self.text)
        except ValueError:  # not JSON (cannot happen under a JSON grammar): nothing to show
            return None
        if members is None or len(members) <= self.count:
            return None
        self.count = len(members)
        if self._fields is None:
            return dict(members)
        values = {}
        for name, value in members.items():
            adapter = self._fields.get(name)
            if adapter is None:
                continue  # an extra key the model may not keep
            try:
                values[name] = adapter.validate_python(value)
            except Exception:  # noqa: BLE001 - the final validation reports it
                values[name] = value
        return self.type.model_construct(_fields_set=set(values), **values)


def final_object(result: Result, spec: OutputSpec) -> Any:
    """What a partial stream yields last: the validated object (the Pydantic instance, or
    the JSON value), or OutputError when the finished output is not a complete valid one."""
    if result.error is not None:
        raise OutputError(f"the streamed output is not a complete valid object: {result.error_type}: {result.error}")
    return result.parsed if spec.python_type is not None else result.json
