"""The bounded matcher of the final conformance check answers as ``re`` does (differential)."""

from __future__ import annotations

import random
import re
import warnings

from constrained_serve.grammar.regex_check import ecma_search, python_fullmatch

# Pieces where the regex package reads the same text otherwise than re: the class escapes,
# braces that are no quantifier, "[" inside a class, comments; and ordinary syntax around them.
ATOMS = [
    r"\w",
    r"\W",
    r"\d",
    r"\D",
    r"\s",
    r"\S",
    ".",
    "a",
    "é",
    r"[\w-]",
    r"[^\w]",
    r"[a\D]",
    r"[^\s\d]",
    "[a[:digit:]]",
    "[]a]",
    "[^]a]",
    "{",
    "}",
    "a{e<=1}",
    "x{1,2}",
    "{,}",
    "(?s:.)",
    "(?m:^)",
    "$",
    "^",
    r"\Z",
    r"\A",
    r"\N{DIGIT ONE}",
    r"[\N{DIGIT ONE}-9]",
    r"(?#[c\w)",
    r"\u0663",
    r"\x41",
    r"\.",
    "[.]",
    "(?:ab|a)",
    "(a)",
    r"\1",
    "(?P<n>a)",
    "(?P=n)",
    "(?=a)",
    "(?!a)",
    "(?<=a)",
    "a++",
    "(?>a+)",
    r"[\b]",
    r"\-",
    "[--a]",
    "[a-]",
    r"[\]]",
    r"\\w",
    r"[\\w]",
    r"\x5cw",
    "(?u)",
]
QUANTIFIERS = ["", "", "*", "+", "?", "{2}", "*?", "{0,2}"]
CHARS = [
    "a",
    "b",
    "é",
    "٣",
    "1",
    "_",
    " ",
    "\n",
    "\x1c",
    "\ufeff",
    "\u2028",
    "\xa0",
    "\u0300",
    "ि",
    "{",
    "}",
    "[",
    "]",
    ":",
    "-",
    "\x08",
    "\ud800",
    "A",
    "²",
    "e",
    "<",
    "=",
    "x",
    "\\",
    "w",
]


def test_python_fullmatch_answers_as_re_does():
    rnd = random.Random(1234)
    checked = 0
    for _ in range(600):
        pattern = "".join(rnd.choice(ATOMS) + rnd.choice(QUANTIFIERS) for _ in range(rnd.randint(1, 4)))
        if rnd.random() < 0.3:
            pattern += "|" + rnd.choice(ATOMS)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = re.compile(pattern)
        except re.error:
            continue
        for _ in range(10):
            text = "".join(rnd.choice(CHARS) for _ in range(rnd.randint(0, 5)))
            got = python_fullmatch(pattern, text)
            assert got is not None, pattern
            assert got == (compiled.fullmatch(text) is not None), (pattern, text)
            checked += 1
    assert checked > 2000


def test_what_has_no_exact_rewrite_is_not_checked():
    # Rust-only syntax, a possible nested set or set operation (re warns: Rust's meaning is
    # likely), word boundaries and the flags that regex reads otherwise: None, never a guess.
    for pattern in (r"\p{L}", "[[:alpha:]]", "[a&&b]", "[a--b]", r"\bx", r"x\B", "(?i)x", "(?a:x)", "(?x)x"):
        assert python_fullmatch(pattern, "x") is None, pattern


def test_ecma_classes():
    # ECMA-262: \w and \d are ASCII (so \W and \D take "é", "٣"); \s has U+FEFF, not U+001C or U+0085.
    for pattern, text, found in (
        (r"^\W+$", "é", True),
        (r"\w", "é", False),
        (r"^\D$", "٣", True),
        (r"\d", "٣", False),
        (r"^[^\d]$", "٣", True),
        (r"^\s$", "\ufeff", True),
        (r"^\s$", "\x1c", False),
        (r"^\s$", "\x85", False),
        (r"^\S$", "\x85", True),
        (r"^[\w-]+$", "a-_9", True),
        ("b", "abc", True),
        ("^b", "abc", False),
    ):
        assert ecma_search(pattern, text) is found, (pattern, text)
