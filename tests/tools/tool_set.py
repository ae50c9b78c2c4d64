"""Four tools with nested parameters, and earlier turns that call them: what the tool-calling
tests (tests/tools/test_engine_tools.py) and benchmarks/tools.py send to the default model."""

from __future__ import annotations

import json

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string", "maxLength": 40}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["street", "zip"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_flight",
            "description": "Book a flight",
            "parameters": {
                "type": "object",
                "properties": {
                    "route": {
                        "type": "object",
                        "properties": {
                            "from": {"type": "string", "maxLength": 3, "minLength": 3},
                            "to": {"type": "string", "maxLength": 3, "minLength": 3},
                        },
                        "required": ["from", "to"],
                    },
                    "passengers": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "maxLength": 30},
                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            },
                            "required": ["name"],
                        },
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                "required": ["route", "passengers"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "ship_parcel",
            "description": "Ship a parcel to an address",
            "parameters": {
                "type": "object",
                "properties": {
                    "to": {"$ref": "#/$defs/address"},
                    "kg": {"type": "number", "minimum": 0, "maximum": 30},
                },
                "required": ["to", "kg"],
                "$defs": {"address": ADDRESS},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 60},
                    "filters": {
                        "type": "object",
                        "properties": {"site": {"type": "string", "maxLength": 30}, "recent": {"type": "boolean"}},
                    },
                },
                "required": ["query"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def called(name: str, args: dict) -> dict:
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# Earlier turns where the assistant called tools: the 135M model, which was not trained on
# tool calls, then calls them where they fit and answers in text otherwise.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Rome?"},
    called("get_weather", {"city": "Rome"}),
    {"role": "user", "content": "Search the web for cheap hotels."},
    called("search", {"query": "cheap hotels"}),
    {"role": "user", "content": "Book a flight from SFO to SEA for Bob."},
    called("book_flight", {"route": {"from": "SFO", "to": "SEA"}, "passengers": [{"name": "Bob"}]}),
]
