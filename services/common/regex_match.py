"""Whether a text fullmatches a regular expression, without backtracking.

``re.fullmatch`` backtracks: a client's pattern with nested repeats (``(?:a{20,}){5,}$!``)
takes seconds to minutes on a text of a hundred characters that does not match, on the
event loop of the worker checking its guided output. Here each node of Python's own
parse of the pattern (``re._parser``) maps a *set* of start positions to the set of
positions it can end at, so a repeat that finds no new positions stops, and the work is
polynomial in the text; a step budget bounds what remains (counted repeats nested deep),
and the answer is then ``None``: not known. Constructs an automaton cannot express
(backreferences, lookarounds, atomic groups, possessive repeats) are ``None`` too.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from services.common.structured import parse_regex

# Set operations one check may take (each position moved through a node counts one):
# ~0.3 s of CPU at most, far past what a sane pattern on a long text needs.
MAX_STEPS = 1_000_000

_IGNORECASE, _MULTILINE, _DOTALL, _ASCII = int(re.I), int(re.M), int(re.S), int(re.A)
_CATEGORY_PATTERNS = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}


class _Unknown(Exception):
    """The answer cannot be had here: an unsupported construct or the budget spent."""


def fullmatch(pattern: str | Any, text: str, max_steps: int = MAX_STEPS) -> bool | None:
    """``re.fullmatch(pattern, text) is not None`` (``pattern`` as a string or as its
    parse), or ``None`` where that is not known (see the module doc)."""
    parsed = _parsed(pattern) if isinstance(pattern, str) else pattern
    matcher = _Matcher(text, max_steps)
    try:
        return len(text) in matcher.seq(parsed, frozenset((0,)), parsed.state.flags)
    except _Unknown:
        return None


def search(pattern: str | Any, text: str, max_steps: int = MAX_STEPS) -> bool | None:
    """``re.search(pattern, text) is not None`` (JSON Schema's ``pattern``), or ``None``
    where that is not known: every position a start, any position an end."""
    parsed = _parsed(pattern) if isinstance(pattern, str) else pattern
    matcher = _Matcher(text, max_steps)
    try:
        return bool(matcher.seq(parsed, frozenset(range(len(text) + 1)), parsed.state.flags))
    except _Unknown:
        return None


# A JSON Schema's pattern is searched once per string per attempt: parse it once.
_parsed = functools.lru_cache(maxsize=256)(parse_regex)


@functools.cache
def _category(name: str, ascii_only: bool) -> re.Pattern[str]:
    return re.compile(_CATEGORY_PATTERNS[name], re.A if ascii_only else 0)


def in_set(items: Any, c: str, flags: int = 0) -> bool:
    """Whether ``c`` is one of a character class's items (its parse, NEGATE removed)."""
    cp = ord(c)
    for op, arg in items:
        name = str(op)
        if name == "LITERAL" and cp == arg:
            return True
        if name == "RANGE" and arg[0] <= cp <= arg[1]:
            return True
        if name == "CATEGORY" and _category(str(arg), bool(flags & _ASCII)).fullmatch(c):
            return True
    return False


def _is_word(c: str, flags: int) -> bool:
    return _category("CATEGORY_WORD", bool(flags & _ASCII)).fullmatch(c) is not None


class _Matcher:
    __slots__ = ("left", "text")

    def __init__(self, text: str, max_steps: int) -> None:
        self.text = text
        self.left = max_steps

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise _Unknown

    def seq(self, items: Any, starts: frozenset[int], flags: int) -> frozenset[int]:
        for op, arg in items:
            if not starts:
                break
            starts = self.node(str(op), arg, starts, flags)
        return starts

    def node(self, name: str, arg: Any, starts: frozenset[int], flags: int) -> frozenset[int]:
        self.spend(len(starts))
        text = self.text
        if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            return frozenset(
                i + 1 for i in starts if i < len(text) and self.one_char(name, arg, text[i], flags)
            )
        if name == "SUBPATTERN":
            _group, add_flags, del_flags, sub = arg
            return self.seq(sub, starts, (flags | add_flags) & ~del_flags)
        if name == "BRANCH":
            out: set[int] = set()
            for option in arg[1]:
                out |= self.seq(option, starts, flags)
            return frozenset(out)
        if name in ("MAX_REPEAT", "MIN_REPEAT"):  # lazy or greedy: the same full matches
            return self.repeat(arg, starts, flags)
        if name == "AT":
            return frozenset(i for i in starts if self.at(str(arg), i, flags))
        raise _Unknown  # GROUPREF, ASSERT, ATOMIC_GROUP, POSSESSIVE_REPEAT, ...

    def repeat(self, arg: Any, starts: frozenset[int], flags: int) -> frozenset[int]:
        lo, hi, sub = arg
        bounded = hi != re._constants.MAXREPEAT  # type: ignore[attr-defined]
        level, k = starts, 0  # level: the ends after exactly k repetitions
        out: set[int] = set(starts) if lo == 0 else set()
        seen: set[int] = set()
        while level and (not bounded or k < hi):
            before, level = level, self.seq(sub, level, flags)
            k += 1
            if level == before:  # a fixed point: every further count ends where this one does
                out |= level
                break
            if k >= lo:
                out |= level
                if not bounded:  # past the minimum only positions not met before lead anywhere new
                    level = level - seen
                    seen |= level
        return frozenset(out)

    def one_char(self, name: str, arg: Any, c: str, flags: int) -> bool:
        if name == "ANY":
            return c != "\n" or bool(flags & _DOTALL)
        if name in ("LITERAL", "NOT_LITERAL"):
            same = ord(c) == arg or (bool(flags & _IGNORECASE) and c.lower() == chr(arg).lower())
            return same == (name == "LITERAL")
        negate = bool(arg) and str(arg[0][0]) == "NEGATE"
        body = arg[1:] if negate else arg
        forms = {c, c.lower(), c.upper()} if flags & _IGNORECASE else (c,)
        return any(in_set(body, f, flags) for f in forms) != negate

    def at(self, code: str, i: int, flags: int) -> bool:
        text, n = self.text, len(self.text)
        multiline = bool(flags & _MULTILINE)
        if code == "AT_BEGINNING_STRING":
            return i == 0
        if code == "AT_BEGINNING":
            return i == 0 or (multiline and text[i - 1] == "\n")
        if code == "AT_END_STRING":
            return i == n
        if code == "AT_END":
            return i == n or (i == n - 1 and text[i] == "\n") or (multiline and i < n and text[i] == "\n")
        if code == "AT_NON_BOUNDARY" and n == 0:
            return False  # re's \B never matches an empty text (Python < 3.14)
        if code in ("AT_BOUNDARY", "AT_NON_BOUNDARY"):
            before = i > 0 and _is_word(text[i - 1], flags)
            after = i < n and _is_word(text[i], flags)
            return (before != after) == (code == "AT_BOUNDARY")
        raise _Unknown
