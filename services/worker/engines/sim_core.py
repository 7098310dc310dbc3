"""A pure, synchronous, deterministic model of one vLLM v1 replica.

The shape follows vLLM v1 (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``,
``sched/scheduler.py``) so that everything upstream of the worker sees realistic
behaviour without a GPU:

- ``BlockPool``: a fixed number of KV blocks, a free queue in LRU eviction order, a map
  block hash → cached block and reference counts. Freed blocks keep their hash and stay
  reusable as prefix-cache hits until a new allocation evicts them from the queue head.
- ``SimCore.step(now)``: continuous batching. Each step spends ``max_num_batched_tokens``
  on one decode token per running sequence first, then on prefill chunks of running
  sequences, then admits waiting requests (higher priority first, then arrival order) up
  to ``max_num_seqs``, reusing cached prefix blocks. When a running sequence needs a
  block and none is free, the lowest-priority, most recently admitted running sequence
  is preempted by recompute (blocks freed, back to waiting), as vLLM does.
- Step time comes from the profile (``sim_profile.StepCosts``); the caller owns the
  clock (``now`` is passed in, the core never reads one), so the same inputs always give
  the same outputs and timings.
- Output tokens are pseudo-text derived only from the request's seed (or id), its
  original prompt and the output position, so batching, preemption and migration never
  change what is generated. With ``sampling.structured`` they spell a valid instance of
  the schema, regex, choice or grammar (``guided``), then EOS. ``logit_bias`` forces and
  bans tokens, and log probabilities are plausible and consistent with the sampling
  parameters (``sim_sampling``); temperature, top-p/k, min-p and penalties otherwise
  leave the text unchanged.

Times inside the core are whatever clock the caller passes (the async shell passes
simulated seconds); nothing here sleeps or does I/O.
"""

from __future__ import annotations

import codecs
import heapq
import math
import random
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import xxhash

from proto.hashing import extend_block_hashes, pack_tokens, root_hash
from proto.messages import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    SamplingParams,
    StructuredOutput,
    Timings,
)
from services.common.tokenizer import ByteTokenizer

from . import guided
from .base import EngineOutput, EngineRequest, EngineStats, FinishReason
from .sim_profile import DEFAULT_PROFILE, MemoryBudget, SimProfile, load_profile
from .sim_sampling import SPECIAL_TEXT, Bias, prompt_logprobs, sampled_logprob

_TOK = ByteTokenizer()
EOS = _TOK.EOS
SPACE = ord(" ") + ByteTokenizer.OFFSET

# ---------------------------------------------------------------------------- block pool


class KVBlock:
    """One KV cache block. ``block_hash`` is set while the block is in the cache map."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """vLLM's block pool: free queue (LRU head first), hash → block map, refcounts.

    Every block with ``ref_cnt == 0`` sits in the free queue, cached or not; allocation
    takes from the head and evicts the block's hash if it had one. Freeing appends to
    the tail, so the least recently freed cached block is evicted first. The pool also
    records the KV events (stored with parent hash / removed / cleared) its changes mean.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict keyed by block id: O(1) pop from the head, append to the tail and
        # removal from the middle (a cache hit on a free block), like vLLM's linked list.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self._events: list[KvEvent] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out: list[KVBlock] = []
        removed: list[int] = []
        for _ in range(n):
            _, blk = self._free.popitem(last=False)
            if blk.block_hash is not None:
                del self._cached[blk.block_hash]
                removed.append(blk.block_hash)
                blk.block_hash = None
            blk.ref_cnt = 1
            out.append(blk)
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail in the given order,
        so callers pass a sequence's blocks last-first: its tail is evicted before the
        prefix other requests are more likely to share."""
        for blk in ordered:
            blk.ref_cnt -= 1
            if blk.ref_cnt < 0:
                raise RuntimeError(f"block {blk.block_id} freed more often than taken")
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = blk

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[int],
        start: int,
        end: int,
        block_size: int,
        lora: str | None,
    ) -> None:
        """Enter ``blocks[start:end]`` (now full of computed tokens) into the cache map.

        A hash already cached by another block (two identical prompts prefilled in the
        same step) leaves this block uncached: one block per hash keeps the map, the
        events and the snapshot in exact agreement.
        """
        run: list[int] = []
        parent: int | None = None
        for j in range(start, end):
            blk, h = blocks[j], hashes[j]
            if blk.block_hash is not None or h in self._cached:
                self._flush_stored(run, parent, block_size, lora)
                run = []
                continue
            blk.block_hash = h
            self._cached[h] = blk
            if not run:
                parent = hashes[j - 1] if j > 0 else None
            run.append(h)
        self._flush_stored(run, parent, block_size, lora)

    def _flush_stored(self, run: list[int], parent: int | None, block_size: int, lora: str | None) -> None:
        if run:
            self._events.append(
                BlockStored(block_hashes=run, parent_hash=parent, block_size=block_size, lora=lora)
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use (as in vLLM)."""
        if self.num_used:
            return False
        for blk in self._cached.values():
            blk.block_hash = None
        self._cached.clear()
        self._events.append(AllCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's structures disagree (tests, debugging)."""
        free_ids = set(self._free)
        for blk in self.blocks:
            assert blk.ref_cnt >= 0, blk
            assert (blk.ref_cnt == 0) == (blk.block_id in free_ids), blk
            if blk.block_hash is not None:
                assert self._cached.get(blk.block_hash) is blk, blk
        assert all(b.block_hash == h for h, b in self._cached.items())


# ----------------------------------------------------------------------- pseudo-text


# Short, common, ASCII-only words: readable output, and every byte is one token of the
# byte tokenizer, so text length and token count agree.
WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as",
    "was", "at", "by", "this", "from", "are", "or", "be", "an", "not", "we", "can",
    "time", "model", "token", "cache", "block", "queue", "batch", "request", "mesh",
    "stream", "latency", "prefix", "worker", "router", "engine", "memory", "river",
    "stone", "light", "small", "large", "quick", "quiet", "north", "south", "green",
    "paper", "garden", "window", "signal", "answer", "number", "simple", "moment",
    "people", "water", "world", "house", "story", "music",
)  # fmt: skip
EOS_ONE_IN = 16  # a word is followed by EOS instead of a space once in this many words


class TokenStream:
    """The deterministic output of one request: token i depends on (key, i) only.

    The stream is a sequence of words from ``WORDS``, each followed by a space or, now
    and then, EOS; word w is chosen by xxh64(key ‖ w). Tokens are produced lazily and
    remembered, so continuing at output position k (a migrated request) regenerates the
    k earlier tokens once and then matches an uninterrupted run exactly.
    """

    __slots__ = ("_buf", "_key", "_words")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._buf: list[int] = []
        self._words = 0

    @property
    def key(self) -> bytes:
        return self._key

    @staticmethod
    def key_for(engine_seed: int, seed: int | None, request_id: str, prompt: Sequence[int]) -> bytes:
        h = xxhash.xxh64()
        h.update(engine_seed.to_bytes(16, "little", signed=True))
        if seed is not None:
            h.update(b"seed" + seed.to_bytes(16, "little", signed=True))
        else:
            h.update(b"id" + request_id.encode())
        h.update(pack_tokens(prompt))
        return h.digest()

    def token(self, i: int) -> int:
        buf = self._buf
        while len(buf) <= i:
            h = xxhash.xxh64_intdigest(self._key + self._words.to_bytes(8, "little"))
            self._words += 1
            buf.extend(b + ByteTokenizer.OFFSET for b in WORDS[h % len(WORDS)].encode())
            buf.append(EOS if (h >> 32) % EOS_ONE_IN == 0 else SPACE)
        return buf[i]


class GuidedStream:
    """The output of a structured request: the UTF-8 bytes of one instance of
    ``structured``, then EOS at every later position. The instance is drawn from a
    ``random.Random`` seeded by the same key as ``TokenStream``, so a migrated request
    continues the very instance an uninterrupted run spells."""

    __slots__ = ("_key", "_tokens", "prefix_only", "text")

    def __init__(self, key: bytes, structured: StructuredOutput, max_len: int) -> None:
        self._key = key
        # Work bounded by a few times what the engine could ever emit (max_model_len).
        work = min(max(4 * max_len, 1 << 12), guided.MAX_WORK)
        self.prefix_only = False
        try:
            self.text = guided.generate(structured, random.Random(int.from_bytes(key, "little")), work)
        except guided.GuidedError:
            # Its shortest instance is longer than any output (a{100000000}): spell the start
            # of one, which max_tokens cuts ("length"), as a real engine's would be. In prefix
            # mode the work bound ends the text rather than failing, so nested minimums
            # (minItems 10⁹ of minItems 10⁹) cost no more than one (bounded) attempt.
            # Each step spells at least a character: max_len steps are all a prefix needs.
            self.prefix_only = True
            self.text = guided.generate(structured, random.Random(int.from_bytes(key, "little")),
                                        max(max_len, 1 << 12), prefix_cap=max_len)
        self._tokens = _TOK.encode(self.text)

    @property
    def key(self) -> bytes:
        return self._key

    def token(self, i: int) -> int:
        if i < len(self._tokens):
            return self._tokens[i]
        return self._tokens[-1] if self.prefix_only and self._tokens else EOS  # a prefix never ends


# ------------------------------------------------------------------------- sequences

Status = Literal["waiting", "running", "finished"]


class _Sequence:
    """The core's state of one request."""

    __slots__ = (
        "admit_seq",
        "arrival",
        "bias",
        "block_hashes",
        "blocks",
        "cached_tokens",
        "decoder",
        "first_token_at",
        "lora",
        "max_stop_len",
        "num_cached_blocks",
        "num_computed",
        "num_preemptions",
        "num_prompt_tokens",
        "order",
        "output_ids",
        "output_offset",
        "priority",
        "request_id",
        "salt",
        "sampling",
        "scheduled_at",
        "special_gap",
        "status",
        "stop_context",
        "stream",
        "text",
        "text_sent",
        "token_ids",
    )

    def __init__(
        self, req: EngineRequest, now: float, order: int, stream: TokenStream | GuidedStream
    ) -> None:
        self.request_id = req.request_id
        self.sampling: SamplingParams = req.sampling
        self.priority = req.priority
        self.lora = req.lora or None
        self.salt = req.lora or ""
        self.arrival = now
        self.order = order
        self.output_offset = req.output_offset
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.token_ids: list[int] = list(req.prompt_token_ids)  # prompt + output so far
        self.output_ids: list[int] = []
        self.block_hashes: list[int] = []  # of the full blocks of token_ids, filled lazily
        self.blocks: list[KVBlock] = []
        self.num_cached_blocks = 0  # leading blocks already offered to the cache map
        self.num_computed = 0
        self.status: Status = "waiting"
        self.admit_seq = 0
        self.cached_tokens: int | None = None  # prefix hit at first scheduling
        self.scheduled_at = 0.0
        self.first_token_at = 0.0
        self.num_preemptions = 0
        self.stream = stream
        self.text = ""  # generated text (this engine's part), stop strings cut off
        self.text_sent = 0
        self.max_stop_len = max((len(s) for s in self.sampling.stop), default=0)
        # A structured instance is what it is: the bias steers only free text (a real
        # engine would pick among the grammar's allowed tokens; the sim has no logits).
        self.bias = Bias({} if isinstance(stream, GuidedStream) else self.sampling.logit_bias)
        # Tail of the output a previous worker produced, so a stop string spanning the
        # migration point is still found.
        prior = req.prompt_token_ids[len(req.prompt_token_ids) - req.output_offset :]
        tail = _TOK.decode(prior) if self.max_stop_len and prior else ""
        self.stop_context = tail[-(self.max_stop_len - 1) :] if self.max_stop_len > 1 else ""
        # Bytes become text a whole UTF-8 character at a time; primed with the prior
        # output's last bytes so a character split by the migration point completes here.
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.decoder.decode(_TOK.decode_bytes(prior[-3:]))
        self.special_gap = False  # a special token's text was last: space the next text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decoding(self) -> bool:
        """One token left to compute: the one sampled last step."""
        return bool(self.output_ids) and self.num_computed == len(self.token_ids) - 1


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: SimProfile
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    seed: int = 0
    lora_adapters: tuple[str, ...] = ()
    rate_window_s: float = 5.0  # simulated seconds of steps the rates in stats cover

    @classmethod
    def build(
        cls,
        profile: str | SimProfile = DEFAULT_PROFILE,
        *,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        hbm_bytes: int | None = None,
        weights_bytes: int | None = None,
        reserve_bytes: int | None = None,
        kv_bytes_per_token: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        lora_adapters: Iterable[str] = (),
        rate_window_s: float = 5.0,
    ) -> SimConfig:
        """Profile defaults, overridden by whatever is given.

        The block count is ``num_kv_blocks`` if given, else the profile's memory budget
        with any of its four figures overridden. ``max_model_len`` defaults to the
        profile's, capped by what the KV cache holds; asking for more than the cache
        holds is an error, as in vLLM (one sequence must always fit, else a lone long
        sequence could never make progress).
        """
        prof = load_profile(profile)
        bs = block_size or prof.block_size
        if num_kv_blocks is None:
            mem = prof.memory
            budget = MemoryBudget(
                hbm_bytes=mem.hbm_bytes if hbm_bytes is None else hbm_bytes,
                weights_bytes=mem.weights_bytes if weights_bytes is None else weights_bytes,
                reserve_bytes=mem.reserve_bytes if reserve_bytes is None else reserve_bytes,
                kv_bytes_per_token=mem.kv_bytes_per_token
                if kv_bytes_per_token is None
                else kv_bytes_per_token,
            )
            num_kv_blocks = budget.num_blocks(bs)
        if num_kv_blocks <= 0 or bs <= 0:
            raise ValueError("block_size and the KV block count must be positive")
        capacity = num_kv_blocks * bs
        if max_model_len is None:
            max_model_len = min(prof.max_model_len, capacity)
        elif max_model_len > capacity:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the KV cache ({num_kv_blocks} blocks of {bs} "
                f"= {capacity} tokens)"
            )
        seqs = max_num_seqs or prof.max_num_seqs
        batched = max_num_batched_tokens or prof.max_num_batched_tokens
        if seqs <= 0 or batched <= 0 or max_model_len <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be positive")
        return cls(
            profile=prof,
            num_blocks=num_kv_blocks,
            block_size=bs,
            max_num_seqs=seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            lora_adapters=tuple(lora_adapters),
            rate_window_s=rate_window_s,
        )


# ------------------------------------------------------------------------------- core


@dataclass(slots=True)
class StepResult:
    """What one step did: its outputs (stamped at ``end``) and KV events."""

    start: float
    duration: float
    outputs: list[EngineOutput]
    kv_events: list[KvEvent]
    prefill_tokens: int  # prompt (or recomputed) tokens processed
    decode_seqs: int
    kv_tokens: int  # context tokens attended, summed over scheduled sequences
    num_scheduled: int
    sampled_tokens: int  # output tokens produced (first tokens included)
    preempted: int

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class _StepRecord:
    end: float
    duration: float
    prefill_tokens: int
    sampled_tokens: int


@dataclass(slots=True)
class _HitRecord:
    t: float
    queries: int
    hits: int


@dataclass
class _Window:
    """Sliding window (in the core's clock) behind the rates in ``stats``."""

    span: float
    steps: deque[_StepRecord] = field(default_factory=deque)
    hits: deque[_HitRecord] = field(default_factory=deque)

    def prune(self, now: float) -> None:
        horizon = now - self.span
        while self.steps and self.steps[0].end < horizon:
            self.steps.popleft()
        while self.hits and self.hits[0].t < horizon:
            self.hits.popleft()


class SimCore:
    """The replica model. Drive it with ``add_request``/``abort``/``step``; read ``stats``.

    Not thread-safe and not async: the shell calls it from one task between steps.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks)
        self._bs = config.block_size
        self._seqs: dict[str, _Sequence] = {}
        self._running: list[_Sequence] = []  # in admission order
        self._waiting: list[tuple[int, float, int, _Sequence]] = []  # heap; stale entries skipped
        self._num_waiting = 0
        self._order = 0
        self._admit_counter = 0
        self._roots: dict[str, int] = {}
        self.preemptions = 0
        self._window = _Window(config.rate_window_s)
        self._queries_total = 0
        self._hits_total = 0
        costs = config.profile.costs
        # Until a step has been measured, advertise the profile's own speed, so a fresh
        # replica does not look infinitely slow to admission's TTFT prediction.
        self._prefill_rate = config.max_num_batched_tokens / costs.step_time(
            config.max_num_batched_tokens, 0, 0
        )
        self._decode_rate = 1.0 / costs.step_time(0, 1, 0)
        self._step_time = 0.0

    # ----------------------------------------------------------------- requests

    def add_request(self, req: EngineRequest, now: float) -> EngineOutput | None:
        """Queue a request. Returns a final output instead when it cannot run: an error
        (empty or over-long prompt, unknown adapter, bad parameters), or ``length`` with
        no tokens when a continued request has already reached ``max_tokens``."""
        if req.request_id in self._seqs:
            raise ValueError(f"request {req.request_id!r} is already in flight")
        sp = req.sampling
        n = len(req.prompt_token_ids)
        error: str | None = None
        if n == 0:
            error = "prompt is empty"
        elif n > self.config.max_model_len:
            error = (
                f"prompt has {n} tokens, more than max_model_len {self.config.max_model_len} "
                f"(the KV cache holds {self.config.num_blocks} blocks of {self._bs})"
            )
        elif not 0 <= req.output_offset <= n:
            error = f"output_offset {req.output_offset} outside the prompt of {n} tokens"
        elif req.lora and req.lora not in self.config.lora_adapters:
            error = f"unknown LoRA adapter {req.lora!r}"
        elif sp.max_tokens < 1:
            error = "max_tokens must be at least 1"
        elif sp.min_tokens < 0:
            error = "min_tokens must not be negative"
        if error is not None:
            return EngineOutput(
                request_id=req.request_id,
                finish_reason="error",
                prompt_tokens=n,
                timings=Timings(arrival=now, finished=now),
                error=error,
                rejected=True,
            )
        if req.output_offset >= sp.max_tokens:
            return EngineOutput(
                request_id=req.request_id,
                finish_reason="length",
                prompt_tokens=n,
                timings=Timings(arrival=now, finished=now),
            )
        original_prompt = req.prompt_token_ids[: n - req.output_offset]
        key = TokenStream.key_for(self.config.seed, sp.seed, req.request_id, original_prompt)
        stream: TokenStream | GuidedStream = TokenStream(key)
        if sp.structured is not None:
            try:
                stream = GuidedStream(key, sp.structured, self.config.max_model_len)
            except guided.GuidedError as exc:  # the gateway checks; a direct caller may not
                return EngineOutput(
                    request_id=req.request_id,
                    finish_reason="error",
                    prompt_tokens=n,
                    timings=Timings(arrival=now, finished=now),
                    error=f"structured output: {exc}",
                    rejected=True,
                )
        self._order += 1
        seq = _Sequence(req, now, self._order, stream)
        self._extend_hashes(seq)
        self._seqs[seq.request_id] = seq
        self._push_waiting(seq)
        return None

    def abort(self, request_id: str, now: float) -> EngineOutput | None:
        """Drop a request wherever it is and free its blocks; its final output, or None."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status == "waiting":
            self._num_waiting -= 1  # its heap entry goes stale
        self._finish(seq)
        return self._output(seq, [], "", "abort", now)

    def has_work(self) -> bool:
        return bool(self._running) or self._num_waiting > 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def request_ids(self) -> list[str]:
        return list(self._seqs)

    # --------------------------------------------------------------------- step

    def step(self, now: float) -> StepResult | None:
        """Schedule and run one engine step starting at ``now``; None when idle."""
        if not self.has_work():
            return None
        cfg, pool = self.config, self.pool
        budget = cfg.max_num_batched_tokens
        sched: dict[_Sequence, int] = {}  # insertion order = batch order
        preempted = 0

        # 1) Running sequences: decodes first, so a long prefill chunk never takes the
        #    budget a running decode needs; then unfinished (chunked) prefills.
        decodes = [s for s in self._running if s.is_decoding]
        prefills = [s for s in self._running if not s.is_decoding]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status != "running":  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            while not self._allocate(seq, num_new):
                victim = self._pick_victim()
                if victim in sched:  # give back what it was granted this step
                    budget += sched.pop(victim)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status == "running":
                sched[seq] = num_new
                budget -= num_new

        # 2) Waiting requests, best first, while budget, sequence slots and blocks last.
        #    Head-of-line: when the best cannot get blocks, nobody behind it jumps ahead.
        #    Not in a step that had to preempt (memory is short, admitting would thrash;
        #    vLLM skips the waiting queue then too) unless everything running was
        #    preempted: then the pool is empty and the best waiting request must start.
        while (not preempted or not sched) and budget > 0 and len(self._running) < cfg.max_num_seqs:
            head = self._peek_waiting()
            if head is None:
                break
            seq = head
            hit = self._lookup_prefix(seq)
            num_hit = len(hit) * self._bs
            num_new = min(seq.num_tokens - num_hit, budget)
            need = math.ceil((num_hit + num_new) / self._bs) - len(hit)
            # Hit blocks sitting in the free queue stop being free once touched.
            evictable_hits = sum(1 for b in hit if b.ref_cnt == 0)
            if need > pool.num_free - evictable_hits:
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            pool.touch(hit)
            seq.blocks = hit + pool.get_new_blocks(need)
            seq.num_computed = num_hit
            seq.num_cached_blocks = len(hit)
            if seq.cached_tokens is None:  # first scheduling: what the usage event reports
                seq.cached_tokens = num_hit
                seq.scheduled_at = now
                self._record_hits(now, seq.num_tokens, num_hit)
            seq.status = "running"
            self._admit_counter += 1
            seq.admit_seq = self._admit_counter
            self._running.append(seq)
            sched[seq] = num_new
            budget -= num_new

        if not sched:
            # Cannot happen: one sequence always fits the pool (max_model_len ≤ capacity),
            # so an empty batch means a bookkeeping bug; fail loudly rather than spin.
            raise RuntimeError("sim scheduler made no progress with work pending")

        prefill_tokens = decode_seqs = kv_tokens = 0
        for seq, n in sched.items():
            if seq.is_decoding:
                decode_seqs += 1
            else:
                prefill_tokens += n
            kv_tokens += seq.num_computed + n
        duration = cfg.profile.costs.step_time(prefill_tokens, decode_seqs, kv_tokens)
        end = now + duration

        outputs: list[EngineOutput] = []
        sampled = 0
        for seq, n in sched.items():
            seq.num_computed += n
            self._cache_full_blocks(seq)
            if seq.num_computed < seq.num_tokens:
                continue  # chunked prefill: more of the prompt next step
            token, delta, finish = self._sample(seq)
            sampled += 1
            if not seq.first_token_at:
                seq.first_token_at = end
            if finish is not None:
                self._finish(seq)
            out = self._output(seq, [token], delta, finish, end)
            sp = seq.sampling
            if out.logprobs is not None:
                pos = seq.output_offset + len(seq.output_ids) - 1
                out.logprobs.append(sampled_logprob(seq.stream.key, pos, token, sp, seq.bias))
            if sp.prompt_logprobs is not None and len(seq.output_ids) == 1:
                original = seq.token_ids[: seq.num_prompt_tokens - seq.output_offset]
                out.prompt_logprobs = prompt_logprobs(self.config.seed, original, sp.prompt_logprobs)
            outputs.append(out)

        self._window.steps.append(_StepRecord(end, duration, prefill_tokens, sampled))
        self._window.prune(end)
        self._step_time = duration
        return StepResult(
            start=now,
            duration=duration,
            outputs=outputs,
            kv_events=pool.take_events(),
            prefill_tokens=prefill_tokens,
            decode_seqs=decode_seqs,
            kv_tokens=kv_tokens,
            num_scheduled=len(sched),
            sampled_tokens=sampled,
            preempted=preempted,
        )

    # ------------------------------------------------------------ observability

    def stats(self, now: float) -> EngineStats:
        """Load and rates. Rates are per busy second of the steps in the window (the
        speed while working, not diluted by idle time); with no step in the window they
        hold their last value (the profile's estimate before the first step).

        The prefill rate is a capacity (what admission divides a queue by), so it counts
        only steps whose prefill fills at least half the step budget: a step carrying a
        short or mostly cached prompt costs mostly the fixed per-step time, and its
        tokens per second say nothing about how fast a queue drains (one cached prompt
        per step reads as ~300 tokens/s on a 14k tokens/s profile)."""
        win = self._window
        win.prune(now)
        full = self.config.max_num_batched_tokens / 2
        pre_tok = pre_time = out_tok = out_time = dur = 0.0
        for rec in win.steps:
            dur += rec.duration
            if rec.prefill_tokens >= full:
                pre_tok += rec.prefill_tokens
                pre_time += rec.duration
            if rec.sampled_tokens:
                out_tok += rec.sampled_tokens
                out_time += rec.duration
        if pre_time > 0:
            self._prefill_rate = pre_tok / pre_time
        if out_time > 0:
            self._decode_rate = out_tok / out_time
        step_time = dur / len(win.steps) if win.steps else self._step_time
        queries = sum(h.queries for h in win.hits)
        hits = sum(h.hits for h in win.hits)
        if not queries:  # nothing admitted lately: the lifetime figure
            queries, hits = self._queries_total, self._hits_total
        queued = sum(s.num_tokens for _, _, _, s in self._waiting if s.status == "waiting")
        queued += sum(s.num_tokens - s.num_computed for s in self._running if not s.is_decoding)
        if win.steps and win.steps[-1].end > now:
            # The step under way: its prefill is computed here at its start, but a request
            # arriving now still waits for it (vLLM's gauge counts it until the first token).
            queued += win.steps[-1].prefill_tokens
        pool = self.pool
        return EngineStats(
            waiting=self._num_waiting,
            running=len(self._running),
            queued_prefill_tokens=queued,
            running_tokens=sum(s.num_tokens for s in self._running),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_usage=pool.num_used / pool.num_blocks,
            prefix_hit_rate=hits / queries if queries else 0.0,
            prefill_tokens_per_s=self._prefill_rate,
            decode_tokens_per_s=self._decode_rate,
            step_time_s=step_time,
            preemptions=self.preemptions,
            lora_adapters=list(self.config.lora_adapters),
            kv_events_mode="engine",
        )

    def kv_snapshot(self) -> list[int]:
        return self.pool.cached_hashes()

    def take_kv_events(self) -> list[KvEvent]:
        """Events produced outside ``step`` (``reset_prefix_cache``)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if blocks, refcounts and sequences disagree."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for seq in self._running:
            assert seq.status == "running"
            assert len(seq.blocks) == math.ceil(seq.num_computed / self._bs), seq.request_id
            for blk in seq.blocks:
                refs[blk.block_id] = refs.get(blk.block_id, 0) + 1
        for seq in self._seqs.values():
            if seq.status == "waiting":
                assert not seq.blocks
        for blk in self.pool.blocks:
            assert blk.ref_cnt == refs.get(blk.block_id, 0), blk
        live_waiting = {id(s) for _, _, _, s in self._waiting if s.status == "waiting"}
        assert len(live_waiting) == self._num_waiting

    # ------------------------------------------------------------------ internals

    def _push_waiting(self, seq: _Sequence) -> None:
        # Preempted sequences keep their key, so they go back ahead of later arrivals.
        heapq.heappush(self._waiting, (-seq.priority, seq.arrival, seq.order, seq))
        seq.status = "waiting"
        self._num_waiting += 1

    def _peek_waiting(self) -> _Sequence | None:
        while self._waiting:
            seq = self._waiting[0][3]
            if seq.status == "waiting":
                return seq
            heapq.heappop(self._waiting)  # aborted while waiting
        return None

    def _root(self, salt: str) -> int:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_hash(salt)
        return root

    def _extend_hashes(self, seq: _Sequence) -> None:
        """Hash every full block of the sequence's tokens not hashed yet."""
        have = len(seq.block_hashes)
        full = len(seq.token_ids) // self._bs
        if full > have:
            parent = seq.block_hashes[-1] if have else self._root(seq.salt)
            seq.block_hashes.extend(
                extend_block_hashes(parent, seq.token_ids[have * self._bs : full * self._bs], self._bs)
            )

    def _lookup_prefix(self, seq: _Sequence) -> list[KVBlock]:
        """Longest run of cached leading blocks, leaving at least one token to compute
        (the step needs it to produce logits), as vLLM does."""
        if not self.config.enable_prefix_caching:
            return []
        self._extend_hashes(seq)
        limit = (seq.num_tokens - 1) // self._bs
        hit: list[KVBlock] = []
        for h in seq.block_hashes[:limit]:
            blk = self.pool.get_cached_block(h)
            if blk is None:
                break
            hit.append(blk)
        return hit

    def _allocate(self, seq: _Sequence, num_new: int) -> bool:
        need = math.ceil((seq.num_computed + num_new) / self._bs) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def _pick_victim(self) -> _Sequence:
        # vLLM: FCFS pops the newest running request; with priorities the least important,
        # newest first among equals. Here higher ``priority`` is more important.
        return min(self._running, key=lambda s: (s.priority, -s.admit_seq))

    def _preempt(self, seq: _Sequence) -> None:
        """Recompute preemption: blocks freed (they stay cached), back to waiting."""
        self._running.remove(seq)
        self.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.num_preemptions += 1
        self.preemptions += 1
        self._push_waiting(seq)

    def _cache_full_blocks(self, seq: _Sequence) -> None:
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed // self._bs
        if full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq)
        self.pool.cache_blocks(seq.blocks, seq.block_hashes, seq.num_cached_blocks, full, self._bs, seq.lora)
        seq.num_cached_blocks = full

    def _finish(self, seq: _Sequence) -> None:
        if seq.status == "running":
            self._running.remove(seq)
        self.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        seq.status = "finished"
        del self._seqs[seq.request_id]

    def _record_hits(self, now: float, queries: int, hits: int) -> None:
        self._window.hits.append(_HitRecord(now, queries, hits))
        self._queries_total += queries
        self._hits_total += hits

    def _sample(self, seq: _Sequence) -> tuple[int, str, FinishReason | None]:
        """Produce the next token and the text delta that may be released now.

        Order of checks follows vLLM: length cap first, then (past ``min_tokens``) EOS
        and stop token ids, whose text is not output, then stop strings, which cut the
        text before the match and win over a length cap. With
        ``include_stop_str_in_output`` the stop token's text and the matched stop string
        stay in the text, and nothing is held back (vLLM's detokenizer does the same).
        """
        sp = seq.sampling
        pos = seq.output_offset + len(seq.output_ids)  # absolute output position
        token = seq.stream.token(pos)
        eos_masked = sp.ignore_eos or pos < sp.min_tokens
        if seq.bias:
            token = seq.bias.apply(token, eos_masked)
        if token == EOS and eos_masked:
            # vLLM masks EOS; the stream's separator is the natural stand-in.
            token = SPACE if SPACE not in seq.bias.banned else seq.bias.substitute(EOS, True)
        seq.output_ids.append(token)
        seq.token_ids.append(token)
        n_out = pos + 1
        finish: FinishReason | None = None
        stop_token = False
        if n_out >= sp.max_tokens or seq.num_tokens >= self.config.max_model_len:
            finish = "length"
        elif n_out >= sp.min_tokens and (token == EOS or token in sp.stop_token_ids):
            finish = "stop"
            stop_token = True
        added = ""
        if not stop_token or sp.include_stop_str_in_output:
            added = self._token_text(seq, token)
            seq.text += added
        include = sp.include_stop_str_in_output
        if sp.stop and n_out > sp.min_tokens and added:
            hit = self._find_stop(seq, len(added))
            if hit is not None:
                start, stop_end = hit
                seq.text = seq.text[: stop_end if include else start]
                finish = "stop"
        if finish is not None:
            upto = len(seq.text)
        elif include:
            upto = len(seq.text)
        else:
            # Hold back what could still turn out to be the start of a stop string.
            upto = max(seq.text_sent, len(seq.text) - max(seq.max_stop_len - 1, 0))
        delta = seq.text[seq.text_sent : upto]
        seq.text_sent = upto
        return token, delta, finish

    @staticmethod
    def _token_text(seq: _Sequence, token: int) -> str:
        """The text ``token`` adds. Bytes join into UTF-8 characters. Special tokens have
        text only with ``skip_special_tokens`` off; ``spaces_between_special_tokens``
        then sets them apart from the text around them by a space, as Hugging Face's
        decoding joins special tokens and text runs with spaces."""
        sp = seq.sampling
        if ByteTokenizer.OFFSET <= token < _TOK.vocab_size:
            text = seq.decoder.decode(bytes((token - ByteTokenizer.OFFSET,)))
            if text and seq.special_gap:
                seq.special_gap = False
                text = " " + text
            return text
        name = SPECIAL_TEXT.get(token)
        if name is None or sp.skip_special_tokens:
            return ""
        if sp.spaces_between_special_tokens:
            if seq.text or seq.output_offset:
                name = " " + name
            seq.special_gap = True
        return name

    @staticmethod
    def _find_stop(seq: _Sequence, new_chars: int) -> tuple[int, int] | None:
        """(start, end) in ``seq.text`` of the stop string that completes earliest within
        the newest ``new_chars`` characters, ties in list order (vLLM's rule); starts
        inside the prior output clamp to 0."""
        full = seq.stop_context + seq.text
        best: tuple[int, int] | None = None
        for stop in seq.sampling.stop:
            if not stop:
                continue
            at = full.find(stop, max(0, len(full) - new_chars - len(stop) + 1))
            if at >= 0 and (best is None or at + len(stop) < best[1]):
                best = (at, at + len(stop))
        if best is None:
            return None
        ctx = len(seq.stop_context)
        return max(0, best[0] - ctx), max(0, best[1] - ctx)

    def _output(
        self, seq: _Sequence, tokens: list[int], delta: str, finish: FinishReason | None, t: float
    ) -> EngineOutput:
        return EngineOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            text=delta,
            finish_reason=finish,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.cached_tokens or 0,
            completion_tokens=len(seq.output_ids),
            timings=Timings(
                arrival=seq.arrival,
                scheduled=seq.scheduled_at,
                first_token=seq.first_token_at,
                finished=t if finish is not None else 0.0,
            ),
            # A list whenever asked for (empty on an abort), so "present" means "asked".
            logprobs=[] if seq.sampling.logprobs is not None else None,
        )
