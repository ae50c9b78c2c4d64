"""Which rules of a grammar can produce a finite text (CFG "productive" symbols).

A rule with no finite expansion (``root ::= "a" root``; a JSON Schema whose required
property is the schema itself) has an empty language: once a model enters it, it can never
finish. llguidance notices and ends the request with an error; xgrammar does not, and worse,
its jump-forward search (``find_jump_forward_string``, our fast-forward) follows the one
infinite string such a rule forces and never returns, growing in memory until the process
dies. So the xgrammar backend refuses such grammars at compile time, reading them from
xgrammar's own printed EBNF (``str(compiled.grammar)``).

The reading is conservative: a construct it does not know (``Regex(...)``, ``TagDispatch``,
a lookahead) counts as able to end, and text it cannot parse makes it give no answer, so a
good grammar is never refused; it only finds rules that certainly cannot end.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_\-.]*) ::= (.*)$")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")
_BOUNDS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(-?\d*)\s*)?\}")


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Seq:
    items: tuple["_Expr", ...]


@dataclass(frozen=True)
class _Alt:
    options: tuple["_Expr", ...]


@dataclass(frozen=True)
class _Repeat:
    item: "_Expr"
    at_least: int


_TERMINAL = _Seq(())  # ends at once: a string, a class, anything we do not look into
_Expr = _Ref | _Seq | _Alt | _Repeat


class _Unreadable(ValueError):
    pass


class _Parser:
    """Recursive descent over one rule body of xgrammar's printed EBNF."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def parse(self) -> _Expr:
        e = self._alt()
        self._space()
        if self.i != len(self.s):
            raise _Unreadable(f"unexpected {self.s[self.i : self.i + 20]!r}")
        return e

    def _space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1

    def _alt(self) -> _Expr:
        options = [self._seq()]
        while self._peek("|"):
            self.i += 1
            options.append(self._seq())
        return options[0] if len(options) == 1 else _Alt(tuple(options))

    def _peek(self, ch: str) -> bool:
        self._space()
        return self.s.startswith(ch, self.i)

    def _seq(self) -> _Expr:
        items = []
        while True:
            self._space()
            if self.i >= len(self.s) or self.s[self.i] in "|)":
                break
            item = self._atom()
            if item is not None:
                items.append(self._quantified(item))
        return items[0] if len(items) == 1 else _Seq(tuple(items))

    def _quantified(self, item: _Expr) -> _Expr:
        s, i = self.s, self.i
        if i < len(s) and s[i] in "*?":
            self.i += 1
            return _TERMINAL  # zero repetitions end at once
        if i < len(s) and s[i] == "+":
            self.i += 1
            return _Repeat(item, 1)
        m = _BOUNDS.match(s, i)
        if m:
            self.i = m.end()
            return _Repeat(item, int(m.group(1))) if int(m.group(1)) else _TERMINAL
        return item

    def _atom(self) -> _Expr | None:
        s, i = self.s, self.i
        ch = s[i]
        if ch in '"[':
            self.i = self._skip_quoted(i, '"' if ch == '"' else "]")
            return _TERMINAL
        if s.startswith("(=", i) or s.startswith("(!", i):  # a lookahead: no text of its own
            self.i = self._skip_group(i)
            return None
        if ch == "(":
            self.i += 1
            e = self._alt()
            if not self._peek(")"):
                raise _Unreadable("unclosed group")
            self.i += 1
            return e
        m = _NAME.match(s, i)
        if m:
            self.i = m.end()
            if s.startswith("(", self.i):  # Regex("..."), TagDispatch(...): not looked into
                self.i = self._skip_group(self.i)
                return _TERMINAL
            return _Ref(m.group())
        raise _Unreadable(f"unexpected {s[i : i + 20]!r}")

    def _skip_quoted(self, i: int, close: str) -> int:
        j = i + 1
        while j < len(self.s):
            if self.s[j] == "\\":
                j += 2
                continue
            if self.s[j] == close:
                return j + 1
            j += 1
        raise _Unreadable("unclosed string or class")

    def _skip_group(self, i: int) -> int:
        depth, j = 0, i
        while j < len(self.s):
            ch = self.s[j]
            if ch in '"[':
                j = self._skip_quoted(j, '"' if ch == '"' else "]")
                continue
            depth += ch == "("
            depth -= ch == ")"
            j += 1
            if depth == 0:
                return j
        raise _Unreadable("unclosed group")


def _can_end(e: _Expr, ending: set[str]) -> bool:
    if isinstance(e, _Ref):
        return e.name in ending
    if isinstance(e, _Seq):
        return all(_can_end(x, ending) for x in e.items)
    if isinstance(e, _Alt):
        return any(_can_end(x, ending) for x in e.options)
    return _can_end(e.item, ending)  # _Repeat, at least once


def _refs(e: _Expr) -> set[str]:
    if isinstance(e, _Ref):
        return {e.name}
    if isinstance(e, _Seq):
        return set().union(*(_refs(x) for x in e.items)) if e.items else set()
    if isinstance(e, _Alt):
        return set().union(*(_refs(x) for x in e.options))
    return _refs(e.item)


def rules_without_finite_text(ebnf: str, root: str = "root") -> list[str] | None:
    """The rules reachable from ``root`` that can produce no finite text (``root`` first when
    it is one of them: the whole grammar matches nothing finite); None when the EBNF is not
    read (then nothing is known)."""
    rules: dict[str, _Expr] = {}
    try:
        for line in ebnf.splitlines():
            if not line.strip():
                continue
            m = _RULE.match(line.strip())
            if m is None:
                raise _Unreadable(f"not a rule: {line[:60]!r}")
            rules[m.group(1)] = _Parser(m.group(2)).parse()
    except (_Unreadable, IndexError, RecursionError) as e:
        logger.debug("grammar not checked for rules without a finite text: %s", e)
        return None
    if root not in rules or any(n not in rules for e in rules.values() for n in _refs(e)):
        return None
    ending: set[str] = set()
    changed = True
    while changed:  # least fixed point: a rule can end once one of its options can
        changed = False
        for name, e in rules.items():
            if name not in ending and _can_end(e, ending):
                ending.add(name)
                changed = True
    reachable, todo = {root}, [root]
    while todo:
        for n in _refs(rules[todo.pop()]) - reachable:
            reachable.add(n)
            todo.append(n)
    stuck = sorted(reachable - ending, key=lambda n: (n != root, n))
    return stuck
