"""Python types the grammar tests turn into JSON Schemas (shared by test_spec and test_manager)."""

from __future__ import annotations

from pydantic import BaseModel
from typing_extensions import TypedDict


class Person(BaseModel):
    name: str
    age: int


class Point(TypedDict):
    x: int
    y: int
