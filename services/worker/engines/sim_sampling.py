"""The sim's sampler surface: logit_bias, log probabilities and special-token text.

Pure and deterministic: every value derives from the request's stream key (or the
engine seed and the prompt) and the position, so batching, preemption and migration
never change it.

- **logit_bias**: a bias ≥ 100 forces its token and one ≤ -100 bans it, which is what
  such a bias does to an engine's sampler (softmax saturates); smaller biases cannot be
  modelled without logits and are accepted without effect, like temperature.
- **Log probabilities**: a plausible distribution per position. The sampled token sits
  at rank 0 most of the time, sometimes 1 or 2, always within the ``k`` returned; the
  probabilities decrease strictly and sum to at most 1 (every log probability < 0). The
  sampling parameters bound the rank as they bound a real sampler: greedy
  (temperature 0, top_k 1) and forced tokens are top-1, top_k caps the rank, min_p
  keeps the sampled token's probability ≥ min_p × the top one, top_p keeps the mass
  ranked above it below top_p. Alternatives are other printable bytes and EOS.
- **Special tokens** (PAD, BOS, EOS of ``ByteTokenizer``) have no text in the
  tokenizer; here they are named ``<pad>``, ``<s>``, ``</s>``: that is their text in
  log probabilities, and in output text when ``skip_special_tokens`` is false.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import xxhash

from proto.messages import SamplingParams, TokenLogprob, TopLogprob
from services.common.tokenizer import ByteTokenizer

_TOK = ByteTokenizer()
VOCAB = _TOK.vocab_size
SPECIAL_TEXT = {ByteTokenizer.PAD: "<pad>", ByteTokenizer.BOS: "<s>", ByteTokenizer.EOS: "</s>"}
FORCE_BIAS = 100.0
BAN_BIAS = -100.0
# Candidates for the alternatives in a top list: printable ASCII and EOS.
_POOL = [*(b + ByteTokenizer.OFFSET for b in range(32, 127)), ByteTokenizer.EOS]
_PRINTABLE = range(32 + ByteTokenizer.OFFSET, 127 + ByteTokenizer.OFFSET)


def token_text(token_id: int) -> str:
    """A token's text decoded alone (a lone non-ASCII byte is U+FFFD, as in vLLM)."""
    special = SPECIAL_TEXT.get(token_id)
    return special if special is not None else _TOK.decode([token_id])


class Bias:
    """The part of ``logit_bias`` a sampler without logits can honour: forced and banned
    tokens. Ids outside the vocabulary are ignored (the gateway checks them)."""

    __slots__ = ("banned", "forced")

    def __init__(self, logit_bias: Mapping[int, float]) -> None:
        live = {t: b for t, b in logit_bias.items() if 0 <= t < VOCAB}
        # Most favoured first; equal biases in id order.
        self.forced = sorted((t for t, b in live.items() if b >= FORCE_BIAS), key=lambda t: (-live[t], t))
        self.banned = frozenset(t for t, b in live.items() if b <= BAN_BIAS)
        top = live[self.forced[0]] if self.forced else 0.0
        self.forced = [t for t in self.forced if live[t] == top]  # the sampler only ever takes the top

    def __bool__(self) -> bool:
        return bool(self.forced or self.banned)

    def apply(self, token: int, eos_masked: bool) -> int:
        """The token the biased sampler emits where the unbiased one emits ``token``."""
        forced = [t for t in self.forced if not (eos_masked and t == ByteTokenizer.EOS)]
        if forced:
            # Equal top biases are equally likely: the stream's own token picks one.
            return forced[token % len(forced)]
        if token not in self.banned:
            return token
        return self.substitute(token, eos_masked)

    def substitute(self, token: int, eos_masked: bool) -> int:
        """The nearest allowed token: a printable byte after ``token`` (a space for EOS),
        else any allowed id; ``token`` itself when everything is banned."""
        start = ord(" ") + ByteTokenizer.OFFSET if token not in _PRINTABLE else token + 1
        first = _PRINTABLE.start
        span = len(_PRINTABLE)
        for k in range(span):
            cand = first + (start - first + k) % span
            if cand not in self.banned:
                return cand
        for cand in range(VOCAB):
            if cand not in self.banned and not (eos_masked and cand == ByteTokenizer.EOS):
                return cand
        return token


def _ranked(
    rng: random.Random,
    token: int,
    k: int,
    max_rank: int,
    sp: SamplingParams | None,
    forced: bool,
    banned: frozenset[int],
) -> TokenLogprob:
    """``token`` placed in a decreasing distribution of which the top ``k`` are listed."""
    k = min(max(k, 0), VOCAB)
    u = rng.random()
    rank = 0 if u < 0.75 else 1 if u < 0.92 else 2
    if k:
        rank = min(rank, k - 1)
    rank = min(rank, max_rank)
    if sp is not None:
        if forced or sp.temperature == 0 or sp.top_k == 1:
            rank = 0
        elif sp.top_k > 0:
            rank = min(rank, sp.top_k - 1)
    # p_i = remaining × f with f in [0.5, 0.95): each p exceeds the next, and the sum < 1.
    n = max(k, rank + 1)
    probs: list[float] = []
    remaining = 1.0
    for i in range(n):
        f = 1.0 - 1e-4 * rng.random() if forced and i == 0 else 0.5 + 0.45 * rng.random()
        p = max(remaining * f, 1e-300)
        probs.append(p)
        remaining -= p
    if sp is not None:
        while rank and sp.min_p > 0 and probs[rank] < sp.min_p * probs[0]:
            rank -= 1
        while rank and sp.top_p < 1.0 and sum(probs[:rank]) >= sp.top_p:
            rank -= 1
    others = [t for t in _POOL if t != token and t not in banned]
    need = n - 1
    if need > len(others):
        extra = [t for t in range(VOCAB) if t != token and t not in banned and t not in set(_POOL)]
        others += extra
    picked = rng.sample(others, min(need, len(others)))
    ids = [*picked[:rank], token, *picked[rank:]]
    top = [TopLogprob(t, token_text(t), math.log(p)) for t, p in zip(ids[:k], probs, strict=False)]
    return TokenLogprob(token, token_text(token), math.log(probs[rank]), top, rank + 1)


def sampled_logprob(key: bytes, pos: int, token: int, sp: SamplingParams, bias: Bias) -> TokenLogprob:
    """The log probability of the token sampled at output position ``pos``."""
    rng = random.Random(xxhash.xxh64_intdigest(key + b"lp" + pos.to_bytes(8, "little")))
    forced = token in bias.forced
    return _ranked(rng, token, sp.logprobs or 0, 2, sp, forced, bias.banned)


def prompt_logprobs(engine_seed: int, prompt: Sequence[int], k: int) -> list[TokenLogprob | None]:
    """One entry per prompt token, None for the first; each depends on the engine seed,
    the token and the one before it (as the model's next-token distribution would)."""
    out: list[TokenLogprob | None] = [None] if prompt else []
    seed = engine_seed.to_bytes(16, "little", signed=True) + b"prompt"
    for j in range(1, len(prompt)):
        h = xxhash.xxh64_intdigest(
            seed
            + j.to_bytes(8, "little")
            + prompt[j - 1].to_bytes(4, "little")
            + prompt[j].to_bytes(4, "little")
        )
        out.append(_ranked(random.Random(h), prompt[j], k, 2, None, False, frozenset()))
    return out
