"""Workloads: what each request asks for, generated purely from a seed.

A workload is a sequence of sessions; a session is one or more turns sent one after
another (single-turn workloads have one turn per session). Session ``i`` is drawn from
its own generator seeded by ``(seed, kind, i)``, so it is the same whatever the run's
length, rate or target, and every endpoint of a comparison sees the same prompts.

Prompt lengths are exact in tokens of the target's tokenizer: text is built from
words, encoded, cut to the asked number of tokens, decoded and checked. With the
``byte`` tokenizer (meshserve's sim models) that is exact by construction; with a
Hugging Face tokenizer it converges in a few tries, and whatever length the text
really has is what the request records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.common.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

# Plain words keep prompts readable in logs and tokenize like ordinary text.
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river mountain signal packet router engine token cache block queue stream"
).split()

# Seed tags: one independent stream per purpose.
_TAG_RANDOM, _TAG_PREFIX, _TAG_GROUP, _TAG_TURNS, _TAG_TRACE, _TAG_BLOCK = 11, 12, 13, 14, 15, 16


# ---------------------------------------------------------------------------- lengths


# Beyond any model's context: a length past it is a typo (1e12), not a workload, and
# would have the client build terabytes of text.
MAX_LENGTH = 10_000_000


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of lengths (tokens) or times (s), parsed from ``kind:a:b``.

    ``512`` or ``fixed:512``; ``uniform:LO:HI`` (inclusive); ``normal:MEAN:STD``;
    ``lognormal:MEAN:SIGMA`` (SIGMA in log space, MEAN the arithmetic mean);
    ``exponential:MEAN``.
    """

    kind: str
    a: float
    b: float = 0.0

    KINDS = ("fixed", "uniform", "normal", "lognormal", "exponential")

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise ValueError("its numbers must be finite")
        if self.kind not in self.KINDS:
            raise ValueError(f"distribution must be one of {self.KINDS}, got {self.kind!r}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError("uniform:LO:HI needs LO <= HI")
        if self.kind in ("normal", "lognormal") and self.b < 0:
            raise ValueError("spread must be >= 0")

    @classmethod
    def parse(cls, spec: str | float | int) -> LengthDist:
        try:
            if isinstance(spec, int | float):
                return cls("fixed", float(spec))
            parts = spec.strip().split(":")
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            kind, nums = parts[0].lower(), [float(p) for p in parts[1:]]
            want = {"fixed": 1, "exponential": 1, "uniform": 2, "normal": 2, "lognormal": 2}.get(kind)
            if want is None or len(nums) != want:
                raise ValueError("expected e.g. 512, uniform:256:768, normal:512:64, lognormal:512:0.5, exponential:2")
            return cls(kind, nums[0], nums[1] if want == 2 else 0.0)
        except ValueError as exc:
            raise ValueError(f"bad distribution {spec!r}: {exc}") from None

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def sample(self, rng: np.random.Generator) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return float(rng.uniform(self.a, self.b))
        if self.kind == "normal":
            return float(rng.normal(self.a, self.b))
        if self.kind == "exponential":
            return float(rng.exponential(self.a)) if self.a > 0 else 0.0
        # lognormal with the given arithmetic mean: mu = ln(mean) - sigma²/2
        mu = math.log(max(self.a, 1e-9)) - self.b * self.b / 2
        return float(rng.lognormal(mu, self.b))

    @property
    def largest(self) -> float:
        """The largest value it means to give (a spread's tail aside)."""
        return self.b if self.kind == "uniform" else self.a

    def sample_int(self, rng: np.random.Generator, lo: int = 1, hi: int = MAX_LENGTH) -> int:
        if self.kind == "uniform":
            return max(lo, min(hi, int(rng.integers(round(self.a), round(self.b) + 1))))
        # clamped before rounding: a lognormal's tail can overflow to inf
        return round(max(lo, min(hi, self.sample(rng))))

    def sample_time(self, rng: np.random.Generator) -> float:
        return max(0.0, self.sample(rng))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        if self.kind == "exponential":
            return f"exponential:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


# ---------------------------------------------------------------------------- text


def open_tokenizer(spec: str) -> Tokenizer:
    """``load_tokenizer(spec)``, its failures a ``ValueError`` naming ``--tokenizer`` and
    what is wrong (the tokenizers library raises a bare ``Exception``)."""
    if spec in ("", "byte"):
        return load_tokenizer(spec)
    path = Path(spec)
    if not path.is_dir():
        why = "not a directory" if path.exists() else "no such directory"
        raise ValueError(f"--tokenizer {spec}: {why} (give 'byte', or a local Hugging Face tokenizer "
                         "directory holding tokenizer.json)")
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {spec}: no tokenizer.json in this directory")
    try:
        return load_tokenizer(spec)
    except Exception as exc:  # tokenizers: bare Exception; a bad tokenizer_config.json: ValueError
        raise ValueError(f"--tokenizer {spec}: cannot load it: {str(exc) or type(exc).__name__}") from None


class TextFactory:
    """Makes text of an exact number of tokens for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer | str = "byte") -> None:
        self.tokenizer = open_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self._byte = isinstance(self.tokenizer, ByteTokenizer)

    @property
    def name(self) -> str:
        return self.tokenizer.name

    def count(self, text: str) -> int:
        if self._byte:
            return len(text.encode("utf-8"))
        return len(self.tokenizer.encode(text))

    def _words(self, rng: np.random.Generator, k: int) -> str:
        idx = rng.integers(0, len(WORDS), size=max(1, k))
        return " ".join(WORDS[i] for i in idx)

    def text(self, n: int, rng: np.random.Generator) -> str:
        """Text of exactly ``n`` tokens (best effort beyond the byte tokenizer)."""
        if n <= 0:
            return ""
        if self._byte:
            # ASCII words: bytes == tokens; ~6 bytes per word incl. the space.
            out = self._words(rng, n // 5 + 2)
            while len(out) < n:
                out += " " + self._words(rng, n // 5 + 2)
            return out[:n]
        enc, dec = self.tokenizer.encode, self.tokenizer.decode
        text = self._words(rng, n + 8)
        ids = enc(text)
        while len(ids) < n:
            text += " " + self._words(rng, n - len(ids) + 8)
            ids = enc(text)
        best = dec(ids[:n])
        for _ in range(24):
            cand = dec(ids[:n])
            got = enc(cand)
            if len(got) == n:
                return cand
            if abs(len(got) - n) < abs(self.count(best) - n):
                best = cand
            if len(got) > n:
                ids = got
            else:
                ids = enc(cand + " " + self._words(rng, n - len(got) + 2))
        return best


# ---------------------------------------------------------------------------- sessions


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session: new user content, the output length it asks for."""

    user: str
    user_tokens: int
    output_tokens: int
    # Synthetic assistant reply (output_tokens long) that later turns carry as history,
    # so their prompt lengths are known before the run; empty for single-turn sessions.
    reply: str = ""
    reply_tokens: int = 0
    think_time: float = 0.0  # s after the previous turn ended, before this one is sent


@dataclass(frozen=True, slots=True)
class Session:
    index: int
    turns: tuple[Turn, ...]
    seed: int  # per-request seed = seed + turn
    system: str = ""
    system_tokens: int = 0
    group: int | None = None  # shared-prefix group

    def input_tokens(self, k: int) -> int:
        """Content tokens of turn k's prompt (system + history + new user content)."""
        hist = sum(t.user_tokens + t.reply_tokens for t in self.turns[:k])
        return self.system_tokens + hist + self.turns[k].user_tokens


class Workload(Protocol):
    kind: str

    @property
    def size(self) -> int | None:
        """Number of sessions available (None: unbounded)."""
        ...

    def session(self, i: int) -> Session: ...

    def describe(self) -> dict[str, Any]: ...


def _rng(seed: int, tag: int, i: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, tag, i])


def _req_seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**31 - 1 - 1024))


@dataclass
class RandomWorkload:
    """Independent prompts with input/output lengths drawn from distributions."""

    text: TextFactory
    input_tokens: LengthDist
    output_tokens: LengthDist
    seed: int = 0
    kind: str = "random"

    @property
    def size(self) -> int | None:
        return None

    def session(self, i: int) -> Session:
        rng = _rng(self.seed, _TAG_RANDOM, i)
        n_in = self.input_tokens.sample_int(rng)
        n_out = self.output_tokens.sample_int(rng)
        user = self.text.text(n_in, rng)
        turn = Turn(user=user, user_tokens=self.text.count(user), output_tokens=n_out)
        return Session(index=i, turns=(turn,), seed=_req_seed(rng))

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "input_tokens": str(self.input_tokens),
                "output_tokens": str(self.output_tokens), "tokenizer": self.text.name}


@dataclass
class SharedPrefixWorkload:
    """G system prompts of P tokens, each shared by many requests with distinct suffixes.

    P is a distribution: each group draws its prompt's length once (from its own seed),
    so ``uniform:1024:2048`` gives G prompts of different lengths in that range.
    """

    text: TextFactory
    groups: int
    prefix_tokens: LengthDist
    input_tokens: LengthDist  # the distinct suffix
    output_tokens: LengthDist
    seed: int = 0
    kind: str = "shared-prefix"
    _prefixes: dict[int, tuple[str, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError("groups must be >= 1")

    @property
    def size(self) -> int | None:
        return None

    def prefix(self, g: int) -> tuple[str, int]:
        if g not in self._prefixes:
            rng = _rng(self.seed, _TAG_PREFIX, g)
            text = self.text.text(self.prefix_tokens.sample_int(rng), rng)
            self._prefixes[g] = (text, self.text.count(text))
        return self._prefixes[g]

    def session(self, i: int) -> Session:
        rng = _rng(self.seed, _TAG_GROUP, i)
        g = int(rng.integers(0, self.groups))
        n_in = self.input_tokens.sample_int(rng)
        n_out = self.output_tokens.sample_int(rng)
        system, system_tokens = self.prefix(g)
        user = self.text.text(n_in, rng)
        turn = Turn(user=user, user_tokens=self.text.count(user), output_tokens=n_out)
        return Session(index=i, turns=(turn,), seed=_req_seed(rng), system=system,
                       system_tokens=system_tokens, group=g)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "groups": self.groups, "prefix_tokens": str(self.prefix_tokens),
                "suffix_tokens": str(self.input_tokens), "output_tokens": str(self.output_tokens),
                "tokenizer": self.text.name}


@dataclass
class MultiTurnWorkload:
    """Chat sessions: each turn resends the whole conversation plus a new user message.

    Turn k+1 is sent ``think_time`` after turn k's response ended (sessions are closed
    loops inside; session starts follow the arrival process). Earlier assistant replies
    are synthetic text of the asked output length, so prompt lengths are exact and the
    same for every target; the runner can send the real replies instead.
    """

    text: TextFactory
    turns: LengthDist
    input_tokens: LengthDist  # per user message
    output_tokens: LengthDist
    think_time: LengthDist
    system_tokens: int = 0
    seed: int = 0
    kind: str = "multi-turn"

    @property
    def size(self) -> int | None:
        return None

    def session(self, i: int) -> Session:
        rng = _rng(self.seed, _TAG_TURNS, i)
        n_turns = self.turns.sample_int(rng)
        system = self.text.text(self.system_tokens, rng)
        turns = []
        for k in range(n_turns):
            user = self.text.text(self.input_tokens.sample_int(rng), rng)
            n_out = self.output_tokens.sample_int(rng)
            reply = self.text.text(n_out, rng) if k < n_turns - 1 else ""
            think = self.think_time.sample_time(rng) if k > 0 else 0.0
            turns.append(Turn(user=user, user_tokens=self.text.count(user), output_tokens=n_out,
                              reply=reply, reply_tokens=self.text.count(reply), think_time=think))
        return Session(index=i, turns=tuple(turns), seed=_req_seed(rng), system=system,
                       system_tokens=self.text.count(system))

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "turns": str(self.turns), "input_tokens": str(self.input_tokens),
                "output_tokens": str(self.output_tokens), "think_time": str(self.think_time),
                "system_tokens": self.system_tokens, "tokenizer": self.text.name}


# ---------------------------------------------------------------------------- traces


@dataclass(frozen=True, slots=True)
class TraceEntry:
    timestamp: float  # seconds
    output_tokens: int
    input_tokens: int | None = None
    text: str | None = None
    hash_ids: tuple[int, ...] = ()  # Mooncake-style shared blocks


_TS_KEYS = ("timestamp", "time", "arrival_time", "ts")
_IN_KEYS = ("input_tokens", "input_length", "prompt_tokens", "input_len", "context_tokens")
_OUT_KEYS = ("output_tokens", "output_length", "completion_tokens", "output_len",
             "max_tokens", "generated_tokens")
_TEXT_KEYS = ("text", "prompt", "input_text")


def _first(obj: dict[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        if k in obj and obj[k] is not None:
            return obj[k]
    return None


def parse_trace(lines: Iterable[str], time_unit: str = "s") -> list[TraceEntry]:
    """Parse a JSONL trace: one object per line with a timestamp, the input (tokens or
    text) and the output tokens. Accepts the common spellings (``input_length`` /
    ``output_length`` of Mooncake traces, ``prompt`` for text, ``hash_ids``). Blank
    lines and ``#`` comments are skipped; entries are sorted by time.
    """
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}.get(time_unit)
    if scale is None:
        raise ValueError("time_unit must be s, ms or us")
    out: list[TraceEntry] = []
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace line {lineno}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"trace line {lineno}: expected an object")
        ts, n_out = _first(obj, _TS_KEYS), _first(obj, _OUT_KEYS)
        n_in, text = _first(obj, _IN_KEYS), _first(obj, _TEXT_KEYS)
        if ts is None:
            raise ValueError(f"trace line {lineno}: no timestamp ({'/'.join(_TS_KEYS)})")
        if n_out is None:
            raise ValueError(f"trace line {lineno}: no output tokens ({'/'.join(_OUT_KEYS)})")
        if n_in is None and text is None:
            raise ValueError(f"trace line {lineno}: no input tokens or text")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"trace line {lineno}: text must be a string")
        try:
            if isinstance(ts, bool) or not math.isfinite(float(ts)):
                raise ValueError(f"timestamp {ts!r} is not a finite number")
            entry = TraceEntry(
                timestamp=float(ts) * scale,
                output_tokens=int(n_out),
                input_tokens=int(n_in) if n_in is not None else None,
                text=text,
                hash_ids=tuple(int(h) for h in obj.get("hash_ids") or ()),
            )
        except (TypeError, ValueError, OverflowError) as exc:  # int(inf): OverflowError
            raise ValueError(f"trace line {lineno}: {exc}") from None
        if entry.output_tokens < 1 or (entry.input_tokens is not None and entry.input_tokens < 0):
            raise ValueError(f"trace line {lineno}: token counts must be positive")
        # Bounded as --input-tokens and --output-tokens are: 1e12 is a typo, and the client
        # would try to build terabytes of prompt for it.
        for name, n in (("input", entry.input_tokens), ("output", entry.output_tokens)):
            if n is not None and n > MAX_LENGTH:
                raise ValueError(f"trace line {lineno}: {n:,} {name} tokens, more than {MAX_LENGTH:,}, "
                                 "longer than any model's context")
        if len(entry.hash_ids) > MAX_LENGTH:  # a block is at least a token
            raise ValueError(f"trace line {lineno}: {len(entry.hash_ids):,} hash_ids, more than {MAX_LENGTH:,}")
        out.append(entry)
    out.sort(key=lambda e: e.timestamp)
    return out


def load_trace(path: str | Path, time_unit: str = "s") -> list[TraceEntry]:
    """``parse_trace`` of a file; any problem with it (unreadable, not UTF-8, a bad line,
    no request at all) is a ``ValueError`` that names the file (``--trace FILE: ...``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            entries = parse_trace(fh, time_unit)
    except OSError as exc:
        raise ValueError(f"--trace {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # UnicodeDecodeError among them
        raise ValueError(f"--trace {path}: {exc}") from None
    if not entries:
        raise ValueError(f"--trace {path}: no requests in it")
    return entries


@dataclass
class TraceWorkload:
    """Replays a trace: its timestamps drive arrivals, its lengths the requests.

    Entries with text send that text; entries with token counts get generated text of
    that many tokens. ``hash_ids`` (Mooncake traces) name blocks of ``block_size``
    tokens: equal ids become equal text, so the trace's prefix sharing is reproduced.
    """

    entries: list[TraceEntry]
    text: TextFactory
    seed: int = 0
    block_size: int = 512
    kind: str = "trace"
    _blocks: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int | None:
        return len(self.entries)

    @property
    def timestamps(self) -> list[float]:
        return [e.timestamp for e in self.entries]

    def _block(self, h: int) -> str:
        if h not in self._blocks:
            self._blocks[h] = self.text.text(self.block_size, _rng(self.seed, _TAG_BLOCK, h))
        return self._blocks[h]

    def session(self, i: int) -> Session:
        e = self.entries[i]
        rng = _rng(self.seed, _TAG_TRACE, i)
        if e.text is not None:
            user = e.text
        elif e.hash_ids:
            n = e.input_tokens or 0
            # Only the blocks the prompt reaches (a trace may name more than its length), and
            # one more while a tokenizer merging across blocks leaves it short.
            used = min(len(e.hash_ids), -(-n // self.block_size))
            full = "".join(self._block(h) for h in e.hash_ids[:used])
            have = self.text.count(full)
            while have < n and used < len(e.hash_ids):
                full += self._block(e.hash_ids[used])
                used += 1
                have = self.text.count(full)
            if have >= n:
                # Cut the last blocks to length (exact for the byte tokenizer).
                user = full.encode("utf-8")[:n].decode("utf-8", "ignore") if self.text._byte \
                    else self.text.tokenizer.decode(self.text.tokenizer.encode(full)[:n])
            else:
                user = full + self.text.text(n - have, rng)
        else:
            user = self.text.text(e.input_tokens or 0, rng)
        turn = Turn(user=user, user_tokens=self.text.count(user), output_tokens=e.output_tokens)
        return Session(index=i, turns=(turn,), seed=_req_seed(rng))

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "entries": len(self.entries), "block_size": self.block_size,
                "tokenizer": self.text.name}
