"""Regex and grammar instances for the sim engine's guided decoding, and the limits every
instance generator shares (the work ``Budget``, ``GuidedError``); :mod:`.guided` is the
entry point (``generate``) and the JSON Schema generator, and its module doc says what
an instance is.
"""

from __future__ import annotations

import random
import string
from typing import Any

from services.common import regex_match
from services.common.gbnf import Alt, CharClass, Expr, Grammar, Lit, Ref, Seq
from services.common.structured import parse_regex

MAX_DEPTH = 6  # schema / grammar nesting past which only the shortest forms are taken
EXTRA_ITEMS = 2  # at most this many array items (or optional repeats) beyond the minimum
MAX_ATTEMPTS = 8
# Work (characters, values, repeats) one instance may take by default. The sim passes a
# few times its max_model_len: an instance it could never emit whole anyway, while a
# hostile request ("a{4294967295}", minItems 10⁹) fails fast instead of stalling it.
MAX_WORK = 1 << 20
SAFE = string.ascii_letters + string.digits  # characters every pattern-free string may use


class GuidedError(ValueError):
    """No instance can be generated: the structured output is malformed (it bypassed the
    gateway's checks) or its shortest instance is beyond ``MAX_WORK``."""


class Budget:
    """Steps left; ``cap``: set in prefix mode, where every minimum count is cut to it and
    a spent budget ends the text instead of failing: every count from then on is 0, so
    the work stays near ``limit`` however the minimums nest (10⁹ items of 10⁹ items)."""

    __slots__ = ("cap", "left", "limit")

    def __init__(self, limit: int = MAX_WORK, cap: int | None = None) -> None:
        self.left = self.limit = limit
        self.cap = cap

    def fresh(self) -> Budget:
        return Budget(self.limit, self.cap)

    def count(self, n: int) -> int:
        """A minimum count as this budget allows it (cut to ``cap`` in prefix mode)."""
        if self.cap is None:
            return n
        return min(n, self.cap, max(self.left, 0))

    @property
    def spent(self) -> bool:
        """In prefix mode, the text has ended: expand nothing more (a rule that doubles at
        each level otherwise takes 2^depth steps, with nothing to cut)."""
        return self.cap is not None and self.left <= 0

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0 and self.cap is None:
            raise GuidedError(f"the instance would take more than {self.limit} steps to generate")


# ------------------------------------------------------------------------------ regex

_PRINTABLE = [chr(c) for c in range(32, 127)]
_CATEGORY_CHARS = {
    "CATEGORY_DIGIT": string.digits,
    "CATEGORY_NOT_DIGIT": string.ascii_letters + "_- ",
    "CATEGORY_SPACE": " ",
    "CATEGORY_NOT_SPACE": SAFE,
    "CATEGORY_WORD": SAFE + "_",
    "CATEGORY_NOT_WORD": " -.,;",
}


def regex_instance(pattern: str, rng: random.Random, budget: Budget | None = None) -> str:
    """A string that fullmatches ``pattern`` (checked; best effort after retries). Checked
    without backtracking: ``re.fullmatch`` on a client's nested repeats can hold the
    worker's event loop for minutes."""
    parsed = parse_regex(pattern)
    out = ""
    for _ in range(MAX_ATTEMPTS):
        groups: dict[int, str] = {}
        out = _walk(parsed, rng, groups, 0, budget.fresh() if budget else Budget())
        if budget is not None and budget.cap is not None:
            break  # a prefix is no instance: checking it (a million steps on a{1000}…) gains nothing
        if regex_match.fullmatch(parsed, out) is not False:  # None: not known, keep it
            break
    return out


def _walk(items: Any, rng: random.Random, groups: dict[int, str], depth: int, budget: Budget) -> str:
    parts: list[str] = []
    for op, arg in items:
        name = str(op)
        budget.spend()
        if name == "LITERAL":
            parts.append(chr(arg))
        elif name == "NOT_LITERAL":
            parts.append(_pick_char(rng, ("NOT_LITERAL", arg), lambda c, a=arg: ord(c) != a, (arg,)))
        elif name == "ANY":
            parts.append(rng.choice(SAFE))
        elif name == "IN":
            parts.append(_pick_in(arg, rng))
        elif name == "BRANCH":
            options = arg[1]
            choice = options[0] if depth >= MAX_DEPTH * 4 else rng.choice(options)
            parts.append(_walk(choice, rng, groups, depth + 1, budget))
        elif name == "SUBPATTERN":
            group, _, _, sub = arg
            text = _walk(sub, rng, groups, depth + 1, budget)
            if group is not None:
                groups[group] = text
            parts.append(text)
        elif name == "ATOMIC_GROUP":
            parts.append(_walk(arg, rng, groups, depth + 1, budget))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = arg
            lo = budget.count(lo)
            budget.spend(lo)  # the minimum count alone may already be too much
            budget.left += lo
            top = lo + (EXTRA_ITEMS + 1 if depth < MAX_DEPTH * 4 else 0)
            hi = min(hi, top)  # MAXREPEAT is a huge int
            for _ in range(rng.randint(lo, max(lo, hi))):
                budget.spend()
                parts.append(_walk(sub, rng, groups, depth + 1, budget))
        elif name == "GROUPREF":
            ref = groups.get(arg, "")
            budget.spend(len(ref))
            parts.append(ref)
        elif name in ("AT", "ASSERT", "ASSERT_NOT", "GROUPREF_EXISTS"):
            continue  # anchors take no text; lookarounds are refused upstream
        else:  # pragma: no cover - every opcode the parser emits for a pattern is above
            raise ValueError(f"unsupported regex construct {name}")
    return "".join(parts)


# Code points tried, besides a class's own bounds, when it allows no printable ASCII.
_PROBES = (0x80, 0xA0, 0xC0, 0x100, 0x370, 0x400, 0x3000, 0x3041, 0x4E00, 0xAC00, 0xE000, 0xF900, 0x10000, 0x20000)
_POOLS: dict[Any, tuple[str, ...]] = {}
_MAX_POOLS = 4096


def _pick_char(rng: random.Random, key: Any, ok: Any, bounds: Any = ()) -> str:
    """A character ``ok`` allows: printable ASCII where it allows some, else one of the
    class's bounds ± 1 or a probe; the choices are found once per class (``key``), so a
    repeat of a class costs a draw per character, not a scan (``[^\\x00-\\u2fff]{600}``
    scanned 12,000 code points per character, ~19 s on a worker's event loop)."""
    pool = _POOLS.get(key)
    if pool is None:
        pool = tuple(c for c in _PRINTABLE if ok(c))
        if not pool:
            points = {b + d for b in bounds for d in (-1, 0, 1)} | set(_PROBES)
            pool = tuple(chr(cp) for cp in sorted(points)
                         if 0 <= cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF and ok(chr(cp)))
        if len(_POOLS) >= _MAX_POOLS:
            _POOLS.clear()
        _POOLS[key] = pool
    return rng.choice(pool) if pool else "\x00"  # an empty class: no text can match it


def _pick_in(items: list[tuple[Any, Any]], rng: random.Random) -> str:
    negate = bool(items) and str(items[0][0]) == "NEGATE"
    body = items[1:] if negate else items
    if not negate:
        # Prefer a member drawn directly from one alternative of the class.
        op, arg = rng.choice(body)
        name = str(op)
        if name == "LITERAL":
            return chr(arg)
        if name == "RANGE":
            lo, hi = arg
            ascii_hi = min(hi, 126)
            if lo <= ascii_hi:
                return chr(rng.randint(max(lo, 32) if lo < 32 <= ascii_hi else lo, ascii_hi))
            return chr(rng.randint(lo, min(hi, lo + 64)))
        if name == "CATEGORY":
            return rng.choice(_CATEGORY_CHARS.get(str(arg), SAFE))
    bounds = [b for op, arg in body for b in ((arg,) if str(op) == "LITERAL" else arg if str(op) == "RANGE" else ())]
    key = ("IN", negate, tuple((str(op), arg) for op, arg in body))
    return _pick_char(rng, key, lambda c: regex_match.in_set(body, c) != negate, bounds)


# ---------------------------------------------------------------------------- grammar


def grammar_instance(grammar: Grammar, rng: random.Random, budget: Budget | None = None) -> str:
    """A random sentence of the grammar: a walk from ``root`` that takes the shortest
    alternatives once ``MAX_DEPTH`` rules deep, so recursive grammars end."""
    out: list[str] = []
    _expand(grammar, grammar.rules[grammar.root], rng, 0, out, budget or Budget())
    return "".join(out)


def _expr_measure(grammar: Grammar, expr: Expr, height: bool) -> int:
    """Least derivation height (or shortest length) of ``expr``."""
    if isinstance(expr, (Lit, CharClass)):
        return 0 if height else (len(expr.text) if isinstance(expr, Lit) else 1)
    if isinstance(expr, Ref):
        return grammar.height[expr.name] + 1 if height else grammar.min_len[expr.name]
    if isinstance(expr, Seq):
        vals = [_expr_measure(grammar, i, height) for i in expr.items]
        return max(vals) if height else sum(vals)
    if isinstance(expr, Alt):
        return min(_expr_measure(grammar, o, height) for o in expr.options)
    if expr.min == 0:
        return 0
    m = _expr_measure(grammar, expr.item, height)
    return m if height else m * expr.min


def _expand(
    grammar: Grammar, expr: Expr, rng: random.Random, depth: int, out: list[str], budget: Budget
) -> None:
    if budget.spent:
        return
    budget.spend(1 + len(expr.text) if isinstance(expr, Lit) else 1)
    if isinstance(expr, Lit):
        out.append(expr.text)
    elif isinstance(expr, CharClass):
        out.append(_class_char(expr, rng))
    elif isinstance(expr, Ref):
        _expand(grammar, grammar.rules[expr.name], rng, depth + 1, out, budget)
    elif isinstance(expr, Seq):
        for item in expr.items:
            _expand(grammar, item, rng, depth, out, budget)
    elif isinstance(expr, Alt):
        if depth >= MAX_DEPTH:
            # The lowest derivation tree's first step: heights strictly fall, so this ends.
            choice = min(
                expr.options,
                key=lambda o: (_expr_measure(grammar, o, True), _expr_measure(grammar, o, False)),
            )
        else:
            choice = rng.choice(expr.options)
        _expand(grammar, choice, rng, depth, out, budget)
    else:
        low = budget.count(expr.min)
        budget.spend(low)  # the minimum count alone may already be too much
        budget.left += low
        hi = low + (EXTRA_ITEMS if depth < MAX_DEPTH else 0)
        if expr.max is not None:
            hi = min(hi, expr.max)
        for _ in range(rng.randint(low, max(low, hi))):
            _expand(grammar, expr.item, rng, depth + 1, out, budget)


def _class_char(cls: CharClass, rng: random.Random) -> str:
    if not cls.negated:
        lo, hi = rng.choice(cls.ranges)
        if lo <= 126 and hi >= 32:  # printable ASCII where the range has some
            return chr(rng.randint(max(lo, 32), min(hi, 126)))
        return chr(rng.randint(lo, min(hi, lo + 64)))

    def ok(c: str) -> bool:
        return not any(lo <= ord(c) <= hi for lo, hi in cls.ranges)

    return _pick_char(rng, ("CLASS", tuple(cls.ranges)), ok, [b for r in cls.ranges for b in r])
