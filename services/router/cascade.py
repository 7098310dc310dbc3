"""Cascades: a virtual model whose cheap classifier sends easy requests to a small
model and hard ones to a large one (``Router.resolve`` applies it; DESIGN.md, Routing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proto.hashing import pack_tokens

if TYPE_CHECKING:
    from .decision import RouteQuery


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    """A virtual model: easy requests go to ``small``, hard ones to ``large``.

    Hard means: a prompt longer than ``max_prompt_tokens``, more than
    ``max_output_tokens`` requested, or a hard keyword. Keywords are matched in the
    request text when the caller has it (case-insensitive), and as token-id sequences in
    the packed prompt (``hard_keyword_tokens``: the shell tokenizes each keyword once,
    in the variants its tokenizer produces, e.g. with and without a leading space).
    Keywords are searched only in prompts short enough to be easy otherwise, which
    bounds the classifier's cost: a few C-level ``find`` calls, well under 1 ms.
    """

    small: str
    large: str
    max_prompt_tokens: int = 1024
    max_output_tokens: int | None = None
    hard_keywords: tuple[str, ...] = ()
    hard_keyword_tokens: tuple[tuple[int, ...], ...] = ()
    fallback: bool = True  # the other model serves when the chosen pool has no capacity


class Cascade:
    """A compiled ``CascadeConfig``."""

    def __init__(self, cfg: CascadeConfig) -> None:
        self.cfg = cfg
        words = [k.lower() for k in cfg.hard_keywords if k]
        self._text_re = re.compile("|".join(re.escape(w) for w in words)) if words else None
        self._token_pats = [pack_tokens(seq) for seq in cfg.hard_keyword_tokens if seq]

    def classify(self, q: RouteQuery) -> tuple[str, str]:
        cfg = self.cfg
        if q.prompt_tokens > cfg.max_prompt_tokens:
            return cfg.large, f"cascade: prompt {q.prompt_tokens} > {cfg.max_prompt_tokens} tokens"
        if cfg.max_output_tokens is not None and q.max_tokens > cfg.max_output_tokens:
            return cfg.large, f"cascade: max_tokens {q.max_tokens} > {cfg.max_output_tokens}"
        if q.text is not None and self._text_re is not None:
            m = self._text_re.search(q.text.lower())
            if m:
                return cfg.large, f"cascade: keyword {m.group()!r}"
        for pat in self._token_pats:
            if find_aligned(q.prompt, pat):
                return cfg.large, "cascade: keyword tokens"
        return cfg.small, "cascade: easy"


def find_aligned(data: bytes, pat: bytes) -> bool:
    """``pat`` occurs in ``data`` at a token boundary (a multiple of 4 bytes)."""
    pos = data.find(pat)
    while pos >= 0:
        if pos % 4 == 0:
            return True
        pos = data.find(pat, pos + 1)
    return False
