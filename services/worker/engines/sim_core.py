"""A pure, synchronous, deterministic model of one vLLM v1 replica.

The shape follows vLLM v1 (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``,
``sched/scheduler.py``) so that everything upstream of the worker sees realistic
behaviour without a GPU:

- ``BlockPool`` (``sim_blocks``): a fixed number of KV blocks, a free queue in LRU
  eviction order, a map block hash → cached block and reference counts. Freed blocks
  keep their hash and stay reusable as prefix-cache hits until a new allocation evicts
  them from the queue head.
- ``SimCore.step(now)``: continuous batching. Each step spends ``max_num_batched_tokens``
  on one decode token per running sequence first, then on prefill chunks of running
  sequences, then admits waiting requests (higher priority first, then arrival order) up
  to ``max_num_seqs``, reusing cached prefix blocks. When a running sequence needs a
  block and none is free, the lowest-priority, most recently admitted running sequence
  is preempted by recompute (blocks freed, back to waiting), as vLLM does.
- Step time comes from the profile (``sim_profile.StepCosts``; ``sim_profile.SimConfig``
  is a profile with the replica's overrides); the caller owns the clock (``now`` is
  passed in, the core never reads one), so the same inputs always give the same
  outputs and timings.
- Output tokens (``sim_sequence``: the streams, and each sequence's next token and the
  text it releases) are pseudo-text derived only from the request's seed (or id), its
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

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from proto.hashing import extend_block_hashes, root_hash
from proto.messages import Timings
from proto.workers import KvEvent

from . import guided
from .base import EngineOutput, EngineRequest, EngineStats, FinishReason, prompt_error
from .sim_blocks import BlockPool, KVBlock
from .sim_lora import LoraSlots
from .sim_profile import SimConfig
from .sim_sampling import prompt_logprobs, sampled_logprob
from .sim_sequence import GuidedStream, SimSequence, TokenStream
from .step_rates import StepRecord, StepWindow

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
class _HitRecord:
    t: float
    queries: int
    hits: int


@dataclass
class _HitWindow:
    """Prefix-cache queries and hits of the admissions in the last ``span`` seconds,
    with their sums kept as records come and go (read by every gauge)."""

    span: float
    hits: deque[_HitRecord] = field(default_factory=deque)
    queries: int = 0
    query_hits: int = 0

    def add(self, rec: _HitRecord) -> None:
        self.hits.append(rec)
        self.queries += rec.queries
        self.query_hits += rec.hits

    def prune(self, now: float) -> None:
        horizon = now - self.span
        while self.hits and self.hits[0].t < horizon:
            gone = self.hits.popleft()
            self.queries -= gone.queries
            self.query_hits -= gone.hits


class SimCore:
    """The replica model. Drive it with ``add_request``/``abort``/``step``; read ``stats``.

    Not thread-safe and not async: the shell calls it from one task between steps.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks)
        self._bs = config.block_size
        self._seqs: dict[str, SimSequence] = {}
        self._running: list[SimSequence] = []  # in admission order
        self._waiting: list[tuple[int, float, int, SimSequence]] = []  # heap; stale entries skipped
        self._num_waiting = 0
        self._order = 0
        self._admit_counter = 0
        self._roots: dict[str, int] = {}
        self.preemptions = 0
        self.prefill_tokens_total = 0
        costs = config.profile.costs
        # Until a step has been measured, advertise the profile's own speed, so a fresh
        # replica does not look infinitely slow to admission's TTFT prediction.
        self._window = StepWindow(
            config.rate_window_s, config.max_num_batched_tokens / 2,
            prefill_rate=config.max_num_batched_tokens / costs.step_time(config.max_num_batched_tokens, 0, 0, 1),
            decode_rate=1.0 / costs.step_time(0, 1, 0),
        )
        self._hit_window = _HitWindow(config.rate_window_s)
        self._queries_total = 0
        self._hits_total = 0
        self._last_end: float | None = None  # the last step's end: a step starting later starts from idle
        self.lora = LoraSlots(config.lora, config.lora_adapters)

    # ----------------------------------------------------------------- requests

    def add_request(self, req: EngineRequest, now: float) -> EngineOutput | None:
        """Queue a request. Returns a final output instead when it cannot run: an error
        (empty or over-long prompt, unknown adapter, bad parameters), or ``length`` with
        no tokens when a continued request has already reached ``max_tokens``."""
        if req.request_id in self._seqs:
            raise ValueError(f"request {req.request_id!r} is already in flight")
        sp = req.sampling
        n = len(req.prompt_token_ids)
        error = prompt_error(req, self.config.max_model_len,
                             f" (the KV cache holds {self.config.num_blocks} blocks of {self._bs})")
        if error is None:
            if req.lora and not self.lora.accepts(req.lora, req.lora_size_bytes):
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
        seq = SimSequence(req, now, self._order, stream)
        if req.kv_transfer is not None and not req.output_offset:
            seq.remote_tokens, seq.remote_cached = remote_kv(req.kv_transfer, n, self._bs)
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
        sched: dict[SimSequence, int] = {}  # insertion order = batch order
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
            if seq.kv_ready_at:
                if seq.kv_ready_at > now:
                    continue  # its KV is still on the way from the prefill replica
                seq.kv_ready_at = 0.0
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
        # A request whose adapter needs a slot while every slot serves the batch is set
        # aside for this step (vLLM V1 skips it too); loads are paid in this step.
        active = {s.lora for s in self._running if s.lora} if cfg.lora.dynamic else set()
        skipped: list[SimSequence] = []
        load_s = 0.0
        while (not preempted or not sched) and budget > 0 and len(self._running) < cfg.max_num_seqs:
            head = self._peek_waiting()
            if head is None:
                break
            seq = head
            if seq.lora and not self.lora.can_run(seq.lora, active):
                heapq.heappop(self._waiting)
                self._num_waiting -= 1
                skipped.append(seq)
                continue
            hit = self._lookup_prefix(seq)
            num_hit = len(hit) * self._bs
            # A prefill replica's KV: whole blocks past the local hit, loaded (vLLM's
            # connector: blocks held while it arrives), the rest (at least the last
            # token, for its logits) computed here once it has.
            loaded = max(seq.remote_tokens - num_hit, 0)
            num_new = 0 if loaded else min(seq.num_tokens - num_hit, budget)
            need = math.ceil((num_hit + loaded + num_new) / self._bs) - len(hit)
            # Hit blocks sitting in the free queue stop being free once touched.
            evictable_hits = sum(1 for b in hit if b.ref_cnt == 0)
            if need > pool.num_free - evictable_hits:
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            if seq.lora:
                load_s += self.lora.activate(seq.lora, active)
                active.add(seq.lora)
            pool.touch(hit)
            seq.blocks = hit + pool.get_new_blocks(need)
            seq.num_computed = num_hit + loaded
            seq.num_cached_blocks = len(hit)
            if seq.cached_tokens is None:  # first scheduling: what the usage event reports
                # Loaded KV reports the prefill replica's cache hits (as vLLM's remote prefill):
                # it computed the rest of the prompt, whatever this replica held.
                seq.cached_tokens = seq.remote_cached if seq.remote_tokens else num_hit
                seq.scheduled_at = now
                self._record_hits(now, seq.num_tokens, num_hit)
            seq.status = "running"
            self._admit_counter += 1
            seq.admit_seq = self._admit_counter
            self._running.append(seq)
            seq.remote_tokens = 0  # loaded once: after a preemption it is computed here
            if loaded:
                seq.kv_ready_at = now + cfg.kv_transfer_s(loaded)
                continue
            sched[seq] = num_new
            budget -= num_new

        for seq in skipped:
            self._push_waiting(seq)

        if not sched and any(s.kv_ready_at for s in self._running):
            # Nothing to compute until a transfer lands: the replica idles till then.
            until = min(s.kv_ready_at for s in self._running if s.kv_ready_at)
            return StepResult(start=now, duration=max(until - now, 0.0), outputs=[], kv_events=pool.take_events(),
                              prefill_tokens=0, decode_seqs=0, kv_tokens=0, num_scheduled=0, sampled_tokens=0,
                              preempted=preempted)
        if not sched:
            # Cannot happen: one sequence always fits the pool (max_model_len ≤ capacity),
            # so an empty batch means a bookkeeping bug; fail loudly rather than spin.
            raise RuntimeError("sim scheduler made no progress with work pending")

        prefill_tokens = decode_seqs = kv_tokens = prefill_seqs = 0
        for seq, n in sched.items():
            if seq.is_decoding:
                decode_seqs += 1
            else:
                prefill_tokens += n
                prefill_seqs += 1
            kv_tokens += seq.num_computed + n
        costs = cfg.profile.costs
        duration = costs.step_time(prefill_tokens, decode_seqs, kv_tokens, prefill_seqs) + load_s
        if self._last_end is None or now > self._last_end:
            duration += costs.idle_wake_s
        end = now + duration
        self._last_end = end

        outputs: list[EngineOutput] = []
        sampled = 0
        for seq, n in sched.items():
            seq.num_computed += n
            self._cache_full_blocks(seq)
            if seq.num_computed < seq.num_tokens:
                continue  # chunked prefill: more of the prompt next step
            token, delta, finish = seq.sample(self.config.max_model_len)
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

        self.prefill_tokens_total += prefill_tokens
        self._window.add(StepRecord(end, duration, prefill_tokens, sampled))
        self._window.prune(end)
        self._hit_window.prune(end)
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
        """Load and rates (``step_rates``: per busy second of the steps in the window, a
        prefill capacity from the steps that fill half the budget, held between them)."""
        win = self._window
        prefill_rate, decode_rate, step_time = win.rates(now)
        self._hit_window.prune(now)
        queries, hits = self._hit_window.queries, self._hit_window.query_hits
        if not queries:  # nothing admitted lately: the lifetime figure
            queries, hits = self._queries_total, self._hits_total
        queued = sum(s.num_tokens - s.remote_tokens for _, _, _, s in self._waiting if s.status == "waiting")
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
            prefill_tokens_per_s=prefill_rate,
            decode_tokens_per_s=decode_rate,
            step_time_s=step_time,
            preemptions=self.preemptions,
            prefill_tokens_total=self.prefill_tokens_total,
            lora_adapters=self.lora.resident(),
            lora_cached=self.lora.cached(),
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

    def _push_waiting(self, seq: SimSequence) -> None:
        # Preempted sequences keep their key, so they go back ahead of later arrivals.
        heapq.heappush(self._waiting, (-seq.priority, seq.arrival, seq.order, seq))
        seq.status = "waiting"
        self._num_waiting += 1

    def _peek_waiting(self) -> SimSequence | None:
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

    def _extend_hashes(self, seq: SimSequence) -> None:
        """Hash every full block of the sequence's tokens not hashed yet."""
        have = len(seq.block_hashes)
        full = len(seq.token_ids) // self._bs
        if full > have:
            parent = seq.block_hashes[-1] if have else self._root(seq.salt)
            seq.block_hashes.extend(
                extend_block_hashes(parent, seq.token_ids[have * self._bs : full * self._bs], self._bs)
            )

    def _lookup_prefix(self, seq: SimSequence) -> list[KVBlock]:
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

    def _allocate(self, seq: SimSequence, num_new: int) -> bool:
        need = math.ceil((seq.num_computed + num_new) / self._bs) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def _pick_victim(self) -> SimSequence:
        # vLLM: FCFS pops the newest running request; with priorities the least important,
        # newest first among equals. Here higher ``priority`` is more important.
        return min(self._running, key=lambda s: (s.priority, -s.admit_seq))

    def _preempt(self, seq: SimSequence) -> None:
        """Recompute preemption: blocks freed (they stay cached), back to waiting."""
        self._running.remove(seq)
        self.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.kv_ready_at = 0.0
        seq.num_preemptions += 1
        self.preemptions += 1
        self._push_waiting(seq)

    def _cache_full_blocks(self, seq: SimSequence) -> None:
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed // self._bs
        if full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq)
        self.pool.cache_blocks(seq.blocks, seq.block_hashes, seq.num_cached_blocks, full, self._bs, seq.lora)
        seq.num_cached_blocks = full

    def _finish(self, seq: SimSequence) -> None:
        if seq.status == "running":
            self._running.remove(seq)
        self.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        seq.status = "finished"
        del self._seqs[seq.request_id]

    def _record_hits(self, now: float, queries: int, hits: int) -> None:
        self._hit_window.add(_HitRecord(now, queries, hits))
        self._queries_total += queries
        self._hits_total += hits

    def _output(
        self, seq: SimSequence, tokens: list[int], delta: str, finish: FinishReason | None, t: float
    ) -> EngineOutput:
        return EngineOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            text=delta,
            finish_reason=finish,
            stop_reason=seq.stop_reason if finish == "stop" else None,
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


def remote_kv(transfer: dict[str, object], prompt_tokens: int, block_size: int) -> tuple[int, int]:
    """What a sim prefill replica's KV (``EngineRequest.kv_transfer``, from ``SimEngine.prefill``)
    gives a replica of ``block_size``: the prompt tokens it may load (whole blocks, never the
    last token, whose logits the decode replica computes) and the prefill replica's cache
    hits among them. Anything else (another engine's, another block size) gives nothing."""
    tokens, cached = transfer.get("tokens"), transfer.get("cached_tokens", 0)
    if (transfer.get("engine") != "sim" or transfer.get("block_size") != block_size
            or not isinstance(tokens, int) or not isinstance(cached, int) or tokens <= 0):
        return 0, 0
    loadable = min(tokens, prompt_tokens - 1) // block_size * block_size
    return loadable, min(max(cached, 0), loadable)
