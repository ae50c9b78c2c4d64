"""Partial objects while streaming (partial.py): fields are only ever added, every partial
agrees with the final object, sync and async; a stream that cannot end in a valid object
raises."""

from __future__ import annotations

import asyncio
import json

import pytest

from constrained_serve import AsyncEngine, SamplingParams
from constrained_serve.errors import OutputError

from ..engine.specs import BOUNDED, Person


def test_partial_objects_sync_and_async(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=40)
    objs = list(eng.stream("A thing: ", p, schema=BOUNDED, partial=True))
    assert [len(o) for o in objs[:-1]] == sorted(len(o) for o in objs[:-1])  # fields only ever added
    final = objs[-1]
    assert final == json.loads(eng.generate(["A thing: "], p, schema=BOUNDED)[0].text)
    assert all(final[k] == v for o in objs for k, v in o.items())  # every partial agrees with the end

    async def main():
        async with AsyncEngine(eng) as ae:
            return [o async for o in ae.stream("A thing: ", p, schema=BOUNDED, partial=True)]

    assert asyncio.run(main()) == objs
    with pytest.raises(OutputError, match="not a complete valid object"):
        list(eng.stream("A thing: ", SamplingParams(max_tokens=3), schema=BOUNDED, partial=True))
    with pytest.raises(ValueError, match="needs a JSON output spec"):
        eng.stream("A thing: ", p, regex="[a-z]+", partial=True)


@pytest.mark.slow
def test_partial_pydantic_objects_on_the_default_model(default_engine):
    msgs = [{"role": "user", "content": "Invent a person as JSON with name, age and city."}]
    objs = list(default_engine.stream(msgs, SamplingParams(max_tokens=60), schema=Person, partial=True))
    assert isinstance(objs[-1], Person) and objs[-1].model_fields_set == {"name", "age", "city"}
    sets = [o.model_fields_set for o in objs[:-1]]
    assert sets[0] == {"name"} and all(a < b for a, b in zip(sets, sets[1:]))
    with pytest.raises(AttributeError):
        _ = objs[0].age  # not written yet: absent
