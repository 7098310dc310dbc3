"""A GBNF grammar parser: the grammar language of vLLM's xgrammar backend (llama.cpp's
GBNF), parsed into a small tree.

The gateway parses a client's ``guided_grammar`` / ``structured_outputs.grammar`` with
it to refuse garbage with a 400 (a missing ``root``, an undefined rule, a rule that can
never finish, a syntax error with its line and column); the sim engine walks the same
tree to spell a sentence (``services.worker.engines.guided``). Pure and synchronous.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_NESTING = 64  # parentheses deeper than this are hostile, not a real grammar
# A rule's expression tree deeper than this is too (`"a"+++…` nests a repeat per operator):
# the walks over it recurse, and Python's stack ends near 1,000 frames.
MAX_TREE_DEPTH = 4 * MAX_NESTING


@dataclass(frozen=True, slots=True)
class Lit:
    text: str


@dataclass(frozen=True, slots=True)
class CharClass:
    ranges: tuple[tuple[int, int], ...]  # inclusive code point ranges
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Ref:
    name: str


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    options: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    item: Expr
    min: int
    max: int | None  # None: unbounded


Expr = Lit | CharClass | Ref | Seq | Alt | Repeat


@dataclass(frozen=True, slots=True)
class Grammar:
    """A parsed GBNF grammar. ``min_len[name]`` is the shortest string a rule derives
    (every rule derives one: the parser rejects grammars with a rule that cannot end)."""

    rules: dict[str, Expr]
    min_len: dict[str, int]
    # The height of each rule's lowest derivation tree: taking the alternative of least
    # height strictly descends, so a walk that does so past a depth bound always ends.
    height: dict[str, int]
    root: str = "root"


class GrammarError(ValueError):
    pass


_RULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_MAX_REPEAT = 10_000


class _GbnfParser:
    """GBNF (llama.cpp's, as xgrammar reads it): ``name ::= alternatives``; double- or
    single-quoted literals, ``[...]`` classes (``^`` negates), ``( )`` groups, ``|``,
    ``* + ?``, ``{m}``, ``{m,}``, ``{m,n}``, ``#`` comments. Whitespace, newlines
    included, separates tokens: a new rule starts where ``name ::=`` follows."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def error(self, msg: str) -> GrammarError:
        line = self.s.count("\n", 0, self.i) + 1
        col = self.i - (self.s.rfind("\n", 0, self.i) + 1) + 1
        return GrammarError(f"{msg} at line {line}, column {col}")

    def skip(self) -> None:
        s, n = self.s, len(self.s)
        while self.i < n:
            c = s[self.i]
            if c in " \t\r\n":
                self.i += 1
            elif c == "#":
                while self.i < n and s[self.i] != "\n":
                    self.i += 1
            else:
                break

    def at_rule_start(self) -> bool:
        m = _RULE_NAME.match(self.s, self.i)
        if not m:
            return False
        j = m.end()
        while j < len(self.s) and self.s[j] in " \t":
            j += 1
        return self.s.startswith("::=", j)

    def parse(self) -> dict[str, Expr]:
        rules: dict[str, Expr] = {}
        self.skip()
        if self.i >= len(self.s):
            raise self.error("empty grammar")
        while self.i < len(self.s):
            m = _RULE_NAME.match(self.s, self.i)
            if not m or not self.at_rule_start():
                raise self.error("expected a rule 'name ::= ...'")
            name = m.group()
            if name in rules:
                raise self.error(f"rule {name!r} defined twice")
            self.i = self.s.index("::=", m.end()) + 3
            rules[name] = self.alternatives(depth=0)
            if _tree_depth(rules[name]) > MAX_TREE_DEPTH:
                raise self.error(f"rule {name!r} is nested too deeply (more than {MAX_TREE_DEPTH} levels)")
            self.skip()
        return rules

    def alternatives(self, depth: int) -> Expr:
        if depth > MAX_NESTING:
            raise self.error("grammar nested too deeply")
        options = [self.sequence(depth)]
        while True:
            self.skip()
            if self.i < len(self.s) and self.s[self.i] == "|":
                self.i += 1
                options.append(self.sequence(depth))
            else:
                break
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self, depth: int) -> Expr:
        items: list[Expr] = []
        while True:
            self.skip()
            if self.i >= len(self.s) or self.s[self.i] in "|)" or self.at_rule_start():
                break
            items.append(self.postfix(self.atom(depth)))
        if not items:
            raise self.error('empty alternative (use "" for the empty string)')
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def atom(self, depth: int) -> Expr:
        c = self.s[self.i]
        if c in "\"'":
            return Lit(self.literal(c))
        if c == "[":
            return self.char_class()
        if c == "(":
            self.i += 1
            inner = self.alternatives(depth + 1)
            self.skip()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                raise self.error("missing ')'")
            self.i += 1
            return inner
        m = _RULE_NAME.match(self.s, self.i)
        if m:
            self.i = m.end()
            return Ref(m.group())
        raise self.error(f"unexpected {c!r}")

    def postfix(self, item: Expr) -> Expr:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c == "*":
                item, self.i = Repeat(item, 0, None), self.i + 1
            elif c == "+":
                item, self.i = Repeat(item, 1, None), self.i + 1
            elif c == "?":
                item, self.i = Repeat(item, 0, 1), self.i + 1
            elif c == "{":
                m = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}").match(self.s, self.i)
                if not m:
                    raise self.error("bad repetition, expected {m}, {m,} or {m,n}")
                lo = int(m.group(1))
                hi: int | None = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if lo > _MAX_REPEAT or (hi is not None and (hi < lo or hi > _MAX_REPEAT)):
                    raise self.error("bad repetition bounds")
                item, self.i = Repeat(item, lo, hi), m.end()
            else:
                break
        return item

    def escape(self) -> int:
        """After a backslash: the code point of the escape at ``self.i``."""
        s = self.s
        if self.i >= len(s):
            raise self.error("dangling backslash")
        c = s[self.i]
        simple = {
            "n": 10,
            "t": 9,
            "r": 13,
            "\\": 92,
            '"': 34,
            "'": 39,
            "[": 91,
            "]": 93,
            "-": 45,
            "^": 94,
            "0": 0,
        }
        if c in simple:
            self.i += 1
            return simple[c]
        width = {"x": 2, "u": 4, "U": 8}.get(c)
        if width is None:
            raise self.error(f"unknown escape '\\{c}'")
        digits = s[self.i + 1 : self.i + 1 + width]
        if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"bad escape '\\{c}{digits}'")
        self.i += 1 + width
        cp = int(digits, 16)
        if cp > 0x10FFFF:
            raise self.error("escape beyond U+10FFFF")
        return cp

    def literal(self, quote: str) -> str:
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.s) or self.s[self.i] == "\n":
                raise self.error("unterminated string")
            c = self.s[self.i]
            if c == quote:
                self.i += 1
                return "".join(out)
            if c == "\\":
                self.i += 1
                out.append(chr(self.escape()))
            else:
                out.append(c)
                self.i += 1

    def class_char(self) -> int:
        if self.i >= len(self.s) or self.s[self.i] == "\n":
            raise self.error("unterminated character class")
        c = self.s[self.i]
        if c == "\\":
            self.i += 1
            return self.escape()
        self.i += 1
        return ord(c)

    def char_class(self) -> CharClass:
        self.i += 1
        negated = self.s.startswith("^", self.i)
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        while True:
            if self.i >= len(self.s):
                raise self.error("unterminated character class")
            if self.s[self.i] == "]":
                self.i += 1
                break
            lo = self.class_char()
            hi = lo
            if self.s.startswith("-", self.i) and not self.s.startswith("-]", self.i):
                self.i += 1
                hi = self.class_char()
                if hi < lo:
                    raise self.error("character range out of order")
            ranges.append((lo, hi))
        if not ranges and not negated:
            raise self.error("empty character class")
        return CharClass(tuple(ranges), negated)


def _refs(expr: Expr) -> list[str]:
    out: list[str] = []
    stack: list[Expr] = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, Ref):
            out.append(e.name)
        elif isinstance(e, Seq):
            stack.extend(e.items)
        elif isinstance(e, Alt):
            stack.extend(e.options)
        elif isinstance(e, Repeat):
            stack.append(e.item)
    return out


def _tree_depth(expr: Expr) -> int:
    """Levels of ``expr``'s tree (references not followed), counted without recursion."""
    deepest = 0
    stack = [(expr, 1)]
    while stack:
        e, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(e, Seq):
            stack.extend((i, d + 1) for i in e.items)
        elif isinstance(e, Alt):
            stack.extend((o, d + 1) for o in e.options)
        elif isinstance(e, Repeat):
            stack.append((e.item, d + 1))
    return deepest


def _least(rules: Mapping[str, Expr], *, height: bool) -> dict[str, int]:
    """Each rule's shortest derivation length (or least derivation height); rules that
    can never finish are absent.

    Knuth's generalisation of Dijkstra's algorithm over the expression nodes: every
    node's value is a monotone function no smaller than its inputs (sum or max for a
    sequence, min for alternatives, a multiple for a repeat, +1 per rule for heights),
    so nodes settle in increasing order, each edge looked at once: O(n log n) where a
    fixpoint over whole rules takes one pass per rule on a chain (minutes on a hostile
    grammar of a few thousand rules).
    """
    kinds: list[str] = []
    parents: list[list[int]] = []
    factor: list[int] = []  # Repeat: the minimum count
    waiting: list[int] = []  # Seq: children not settled yet
    children: list[list[int]] = []
    heap: list[tuple[int, int]] = []
    refs: list[tuple[int, str]] = []

    def node(kind: str, kids: list[int], const: int | None = None, mult: int = 1) -> int:
        i = len(kinds)
        kinds.append(kind)
        parents.append([])
        factor.append(mult)
        waiting.append(len(kids))
        children.append(kids)
        for k in kids:
            parents[k].append(i)
        if const is not None:
            heap.append((const, i))
        return i

    def build(expr: Expr) -> int:
        if isinstance(expr, Lit):
            return node("const", [], 0 if height else len(expr.text))
        if isinstance(expr, CharClass):
            return node("const", [], 0 if height else 1)
        if isinstance(expr, Ref):
            i = node("ref", [])
            refs.append((i, expr.name))
            return i
        if isinstance(expr, Seq):
            return node("seq", [build(item) for item in expr.items])
        if isinstance(expr, Alt):
            return node("alt", [build(option) for option in expr.options])
        if expr.min == 0:
            return node("const", [], 0)
        return node("repeat", [build(expr.item)], mult=1 if height else expr.min)

    roots = {name: build(expr) for name, expr in rules.items()}
    for i, name in refs:
        children[i] = [roots[name]]
        parents[roots[name]].append(i)
    heapq.heapify(heap)
    value: dict[int, int] = {}
    while heap:
        v, i = heapq.heappop(heap)
        if i in value:
            continue
        value[i] = v
        for p in parents[i]:
            if p in value:
                continue
            kind = kinds[p]
            if kind == "alt":
                heapq.heappush(heap, (v, p))  # the first option to settle is the least
            elif kind == "ref":
                heapq.heappush(heap, (v + 1 if height else v, p))
            elif kind == "repeat":
                heapq.heappush(heap, (v * factor[p], p))
            else:
                waiting[p] -= 1
                if waiting[p] == 0:
                    vals = [value[c] for c in children[p]]
                    heapq.heappush(heap, (max(vals) if height else sum(vals), p))
    return {name: value[i] for name, i in roots.items() if i in value}


def parse_grammar(text: str) -> Grammar:
    """Parse GBNF; GrammarError if it is not GBNF, has no ``root``, names an undefined
    rule, or has a rule that can never finish."""
    if "::=" not in re.sub(r"#.*", "", text):
        raise GrammarError(
            "not an EBNF/GBNF grammar (no 'name ::= ...' rule; Lark grammars are not supported)"
        )
    rules = _GbnfParser(text).parse()
    if "root" not in rules:
        raise GrammarError("the grammar has no 'root' rule")
    for name, expr in rules.items():
        for ref in _refs(expr):
            if ref not in rules:
                raise GrammarError(f"rule {name!r} refers to undefined rule {ref!r}")
    known = _least(rules, height=False)
    stuck = sorted(set(rules) - set(known))
    if stuck:
        raise GrammarError(f"rule {stuck[0]!r} can never finish (it only recurses)")
    return Grammar(rules=rules, min_len=known, height=_least(rules, height=True))
