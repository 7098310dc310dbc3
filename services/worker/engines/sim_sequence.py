"""What one request of the modelled replica generates, and its state in the core.

- ``TokenStream``: pseudo-text derived only from the request's seed (or id), its
  original prompt and the output position, so batching, preemption and migration never
  change what is generated; ``GuidedStream``: with ``sampling.structured``, a valid
  instance of the schema, regex, choice or grammar (``guided``), then EOS.
- ``SimSequence``: the core's state of one request (tokens, blocks, text) and
  ``SimSequence.sample``, its next token and the text it releases: ``logit_bias``,
  ``min_tokens``/EOS masking, stop tokens and stop strings, special-token text.

:class:`.sim_core.SimCore` schedules the sequences; see the module doc there.
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Sequence
from typing import Literal

import xxhash

from proto.hashing import pack_tokens, prefix_salt
from proto.messages import SamplingParams, StructuredOutput
from services.common.tokenizer import ByteTokenizer

from . import guided
from .base import EngineRequest, FinishReason
from .sim_blocks import KVBlock
from .sim_sampling import SPECIAL_TEXT, Bias

_TOK = ByteTokenizer()
EOS = _TOK.EOS
SPACE = ord(" ") + ByteTokenizer.OFFSET


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
            self.text = guided.generate(
                structured,
                random.Random(int.from_bytes(key, "little")),
                max(max_len, 1 << 12),
                prefix_cap=max_len,
            )
        self._tokens = _TOK.encode(self.text)

    @property
    def key(self) -> bytes:
        return self._key

    def token(self, i: int) -> int:
        if i < len(self._tokens):
            return self._tokens[i]
        return self._tokens[-1] if self.prefix_only and self._tokens else EOS  # a prefix never ends


Status = Literal["waiting", "running", "finished"]


class SimSequence:
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
        "kv_ready_at",
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
        "remote_cached",
        "remote_tokens",
        "request_id",
        "salt",
        "sampling",
        "scheduled_at",
        "special_gap",
        "status",
        "stop_context",
        "stop_reason",
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
        self.salt = prefix_salt(req.lora, req.cache_salt)
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
        # Prefill/decode split: prompt tokens whose KV a prefill replica computed (loaded,
        # not computed, at admission), and how many of them it found in its own cache.
        self.remote_tokens = 0
        self.remote_cached = 0
        self.kv_ready_at = 0.0  # while loading: when the KV has arrived
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
        self.stop_reason: int | str | None = None  # what stopped it (vLLM's stop_reason)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decoding(self) -> bool:
        """One token left to compute: the one sampled last step."""
        return bool(self.output_ids) and self.num_computed == len(self.token_ids) - 1

    def sample(self, max_model_len: int) -> tuple[int, str, FinishReason | None]:
        """Produce the next token and the text delta that may be released now.

        Order of checks follows vLLM (``check_stop``): past ``min_tokens``, EOS and stop
        token ids first, whose text is not output, then the length cap, then stop
        strings, which cut the text before the match and win over a length cap (vLLM's
        detokenizer finds them after the scheduler's check). ``stop_reason`` is set as
        vLLM's: the stop token id (None for EOS) or the matched stop string. With
        ``include_stop_str_in_output`` the stop token's text and the matched stop string
        stay in the text, and nothing is held back (vLLM's detokenizer does the same).
        """
        sp = self.sampling
        pos = self.output_offset + len(self.output_ids)  # absolute output position
        token = self.stream.token(pos)
        eos_masked = sp.ignore_eos or pos < sp.min_tokens
        if self.bias:
            token = self.bias.apply(token, eos_masked)
        if token == EOS and eos_masked:
            # vLLM masks EOS; the stream's separator is the natural stand-in.
            token = SPACE if SPACE not in self.bias.banned else self.bias.substitute(EOS, True)
        self.output_ids.append(token)
        self.token_ids.append(token)
        n_out = pos + 1
        finish: FinishReason | None = None
        stop_token = False
        if n_out >= sp.min_tokens and (token == EOS or token in sp.stop_token_ids):
            finish = "stop"
            stop_token = True
            self.stop_reason = None if token == EOS else token  # vLLM checks EOS first
        elif n_out >= sp.max_tokens or self.num_tokens >= max_model_len:
            finish = "length"
        added = ""
        if not stop_token or sp.include_stop_str_in_output:
            added = self._token_text(token)
            self.text += added
        include = sp.include_stop_str_in_output
        if sp.stop and n_out > sp.min_tokens and added:
            hit = self._find_stop(len(added))
            if hit is not None:
                start, stop_end, self.stop_reason = hit
                self.text = self.text[: stop_end if include else start]
                finish = "stop"
        if finish is not None:
            upto = len(self.text)
        elif include:
            upto = len(self.text)
        else:
            # Hold back what could still turn out to be the start of a stop string.
            upto = max(self.text_sent, len(self.text) - max(self.max_stop_len - 1, 0))
        delta = self.text[self.text_sent : upto]
        self.text_sent = upto
        return token, delta, finish

    def _token_text(self, token: int) -> str:
        """The text ``token`` adds. Bytes join into UTF-8 characters. Special tokens have
        text only with ``skip_special_tokens`` off; ``spaces_between_special_tokens``
        then sets them apart from the text around them by a space, as Hugging Face's
        decoding joins special tokens and text runs with spaces."""
        sp = self.sampling
        if ByteTokenizer.OFFSET <= token < _TOK.vocab_size:
            text = self.decoder.decode(bytes((token - ByteTokenizer.OFFSET,)))
            if text and self.special_gap:
                self.special_gap = False
                text = " " + text
            return text
        name = SPECIAL_TEXT.get(token)
        if name is None or sp.skip_special_tokens:
            return ""
        if sp.spaces_between_special_tokens:
            if self.text or self.output_offset:
                name = " " + name
            self.special_gap = True
        return name

    def _find_stop(self, new_chars: int) -> tuple[int, int, str] | None:
        """(start, end, stop) in ``self.text`` of the stop string that completes earliest within
        the newest ``new_chars`` characters, ties in list order (vLLM's rule); starts
        inside the prior output clamp to 0."""
        full = self.stop_context + self.text
        best: tuple[int, int, str] | None = None
        for stop in self.sampling.stop:
            if not stop:
                continue
            at = full.find(stop, max(0, len(full) - new_chars - len(stop) + 1))
            if at >= 0 and (best is None or at + len(stop) < best[1]):
                best = (at, at + len(stop), stop)
        if best is None:
            return None
        ctx = len(self.stop_context)
        return max(0, best[0] - ctx), max(0, best[1] - ctx), best[2]
