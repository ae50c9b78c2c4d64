"""Output specs shared by the engine tests: a Pydantic person, a small bounded JSON Schema,
a record whose keys the grammar forces (fast-forward), and a model whose validator refuses
every value (a rule JSON Schema cannot carry)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, field_validator


class Person(BaseModel):
    name: str
    age: int
    city: Literal["Paris", "Rome", "Oslo"]


BOUNDED = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "n", "tag"],
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["red", "green"]},
    },
}


RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
}


class Refused(BaseModel):
    flag: bool

    @field_validator("flag")
    @classmethod
    def never(cls, v):  # a rule JSON Schema cannot carry into the grammar
        raise ValueError("flag is never acceptable")
