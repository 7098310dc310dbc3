"""Coalescing of generated tokens into chunks (pure; the caller passes the clock).

The first token goes out at once (it is the TTFT the client sees); after that tokens
are held until ``max_tokens`` accumulate or ``interval_s`` passed since the last chunk,
so the message rate stays far below the token rate at large batch sizes.
"""

from __future__ import annotations

from proto.messages import TokenLogprob


class Coalescer:
    def __init__(self, interval_s: float, max_tokens: int) -> None:
        self.interval_s = interval_s
        self.max_tokens = max(1, max_tokens)
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] | None = None  # set once an output carries them
        self._last_flush: float | None = None  # None until the first chunk went out
        self.emitted = 0  # tokens handed out by take()

    def add(self, token_ids: list[int], text: str, now: float, logprobs: list[TokenLogprob] | None = None) -> None:
        self._token_ids.extend(token_ids)
        if text:
            self._text.append(text)
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)

    @property
    def pending(self) -> int:
        return len(self._token_ids)

    def should_flush(self, now: float, interval_s: float | None = None) -> bool:
        """``interval_s`` overrides the configured interval (the worker widens it at large batches)."""
        if not self._token_ids:
            return False
        if self._last_flush is None:
            return True
        interval = self.interval_s if interval_s is None else interval_s
        return len(self._token_ids) >= self.max_tokens or now - self._last_flush >= interval

    def take(self, now: float) -> tuple[list[int], str, list[TokenLogprob] | None]:
        """The held tokens, their text and (when the request asked) their logprobs."""
        token_ids, text, logprobs = self._token_ids, "".join(self._text), self._logprobs
        self._token_ids, self._text = [], []
        self._logprobs = [] if logprobs is not None else None
        self._last_flush = now
        self.emitted += len(token_ids)
        return token_ids, text, logprobs
