"""grammars/*.lark: each compiles under llguidance, parses its documented examples with
`lark`, and (on the real model, with both grammar backends) generates text that `lark`
parses back."""

from __future__ import annotations

import lark
import llguidance
import pytest

from constrained_serve import SamplingParams

from ..helpers import GRAMMARS

# Strings each grammar must accept (documentation as much as test data).
EXAMPLES = {
    "arith.lark": ["1 + 2 * 3", "-(4.5 - 2)^2 / 3", "2^3^2", "1 - -2", "(7)", "-(-2)", "2^-1"],
    "sql_select.lark": [
        "SELECT * FROM users",
        "SELECT DISTINCT city FROM users WHERE email IS NOT NULL AND name LIKE 'A%' AND id IN (1, 2, 3)",
        "SELECT u.name, COUNT(*) AS n FROM orders o INNER JOIN users u ON o.user_id = u.id WHERE o.total > 100 "
        "GROUP BY u.name HAVING COUNT(*) >= 2 ORDER BY n DESC LIMIT 10;",
    ],
    "csv.lark": ['name,age,city\nAlice,30,Paris\n"Smith, John",,"say ""hi"""\n', "a", ",,"],
    "function_call.lark": [
        'get_weather(city="Paris", unit="celsius")',
        'send_email(to=["a@b.org"], urgent=true); noop()',
        "f(x=-1.5e3, y=null, z=[])",
    ],
}
REJECTS = {
    "arith.lark": ["1 +", "1  + 2", "x", "1 - --2"],
    "sql_select.lark": ["select * from users", "SELECT * FROM Users", "SELECT *  FROM users"],
    "csv.lark": ['"open', 'a"b'],
    "function_call.lark": ["f(1)", 'f(x="a" y=1)', "f" * 41 + "()"],
}
PROMPTS = {
    "arith.lark": "Write an arithmetic expression for: three times the sum of four and five",
    "sql_select.lark": "Write a SQL query that selects the name and email of the users who live in Paris.",
    "csv.lark": "Write a CSV table of three fruits with the columns name,color,price.",
    "function_call.lark": 'Call get_weather for Paris in celsius, like get_weather(city="Rome", unit="fahrenheit").',
}


def read(name: str) -> str:
    return (GRAMMARS / name).read_text()


def test_every_grammar_file_is_covered() -> None:
    assert sorted(p.name for p in GRAMMARS.glob("*.lark")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_grammar_compiles_with_llguidance_and_parses_with_lark(name: str) -> None:
    text = read(name)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(text)) == ""
    parser = lark.Lark(text)
    for sample in EXAMPLES[name]:
        parser.parse(sample)
    for sample in REJECTS[name]:
        with pytest.raises(lark.exceptions.LarkError):
            parser.parse(sample)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_grammars_generate_text_that_lark_parses(engine, backend: str) -> None:
    names = sorted(PROMPTS)
    grammars = [read(n) for n in names]
    conversations = [[{"role": "user", "content": PROMPTS[n]}] for n in names]
    # one batch, a different grammar per prompt
    results = engine.chat(conversations, SamplingParams(max_tokens=64), grammar=grammars, grammar_backend=backend)
    for name, grammar, r in zip(names, grammars, results):
        assert r.error is None or r.finish_reason == "length", (name, r)
        text = r.text
        if r.finish_reason == "length":
            # Only a CSV may run on (a model can always add another row); every complete
            # line of it is a complete row, so cut back to the last one.
            assert name == "csv.lark", (name, text)
            text = text[: text.rfind("\n")]
            assert text, (name, r.text)
        lark.Lark(grammar).parse(text)
