"""The regex scanner both rewriters read (regex_scan.py): a pattern cut into escapes,
classes, group openings, comments and counted quantifiers, and nothing lost."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "pattern, pieces",
    [
        (r"a\d{2,3}[^\]x-z](?:b|c)", ["a", r"\d", "{2,3}", r"[^\]x-z]", "(?:", "b", "|", "c", ")"]),
        (
            r"(?#note)\N{EM DASH}(?P<n>x){e<=1}",
            ["(?#note)", r"\N{EM DASH}", "(?P<n>", "x", ")", "{", "e", "<", "=", "1", "}"],
        ),
        (r"(?i)a(?s-m:b)[]a][\\]", ["(?i)", "a", "(?s-m:", "b", ")", "[]a]", r"[\\]"]),
    ],
)
def test_a_pattern_is_cut_into_the_pieces_both_rewriters_read(pattern, pieces):
    """One scanner (grammar/regex_scan.py) serves the regex-package rewrite and xgrammar's."""
    from constrained_serve.grammar.regex_scan import regex_tokens

    assert regex_tokens(pattern) == pieces
    assert "".join(pieces) == pattern
