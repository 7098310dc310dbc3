"""Reasoning parser for the ``<think>…</think>`` family: reasoning_content vs content,
whole or streamed, and the count of reasoning tokens for usage.

Behaviour (vLLM 0.32's ``deepseek_r1`` and ``qwen3`` parsers, which agree on it):

- The output starts in reasoning: a model whose chat template already opened
  ``<think>`` in the prompt (DeepSeek-R1, Qwen3) writes only the closing tag, and
  everything before ``</think>`` is reasoning. A ``<think>`` the model does write is
  removed. With no ``</think>`` at all, the whole output is reasoning.
- Everything after the first ``</think>`` is content, verbatim.
- ``enable_thinking=False`` (the request's ``chat_template_kwargs``, as vLLM's ``qwen3``
  reads it): no reasoning, the whole output is content.
- Empty reasoning or content is ``None``.

Reasoning tokens (``completion_tokens_details.reasoning_tokens``) are the generated tokens
up to and including the end tag (so reasoning + content tokens = completion tokens).
Counted per fed delta:

- when ``end_token_id`` is given (``</think>`` is one token in the vocabulary, as for
  DeepSeek-R1 and Qwen3): the tokens up to and including that id, exactly;
- otherwise: every token of each delta that began before the end tag was complete, so a
  delta straddling the tag counts whole (exact when deltas are single tokens).

vLLM counts only the tokens strictly between the tags, and none when the start tag is in
the prompt; this module counts the hidden part of the output, which is what OpenAI's
field reports.

The split is decided on the text (so the tags must survive detokenization; they are
plain added tokens in these models), the count on the token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.parsers.events import ContentDelta, ReasoningDelta, ReasoningEvent
from services.common.parsers.tool_calls import partial_tag_overlap


class ThinkReasoningParser:
    """Incremental ``<think>…</think>`` splitter for one response (one choice)."""

    name = "think"
    START = "<think>"
    END = "</think>"

    def __init__(self, *, enable_thinking: bool = True, end_token_id: int | None = None) -> None:
        self._enable_thinking = enable_thinking
        self._end_token_id = end_token_id
        self._reasoning = enable_thinking  # still inside the reasoning part
        self._buf = ""  # a possible partial tag, held back
        self._tokens = 0
        self._finished = False

    @property
    def reasoning_tokens(self) -> int:
        """Reasoning tokens among the token ids fed so far (see the module doc)."""
        return self._tokens

    @property
    def in_reasoning(self) -> bool:
        """True until the end tag has been read (a tool-call parser waits for content)."""
        return self._reasoning

    def feed(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> list[ReasoningEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._reasoning:
            end_id = self._end_token_id
            if end_id is not None and end_id in delta_token_ids:
                self._tokens += list(delta_token_ids).index(end_id) + 1
            else:
                self._tokens += len(delta_token_ids)
        self._buf += delta_text
        return self._split(final=False)

    def finish(self) -> list[ReasoningEvent]:
        if self._finished:
            return []
        self._finished = True
        return self._split(final=True)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Whole-text ``(reasoning_content, content)``."""
        fresh = ThinkReasoningParser(enable_thinking=self._enable_thinking)
        reasoning: list[str] = []
        content: list[str] = []
        for ev in fresh.feed(text) + fresh.finish():
            (reasoning if isinstance(ev, ReasoningDelta) else content).append(ev.text)
        return "".join(reasoning) or None, "".join(content) or None

    def _split(self, final: bool) -> list[ReasoningEvent]:
        out: list[ReasoningEvent] = []
        reasoning: list[str] = []
        while self._reasoning:
            buf = self._buf
            end = buf.find(self.END)
            start = buf.find(self.START)
            if start >= 0 and (end < 0 or start < end):
                reasoning.append(buf[:start])  # a written <think> is dropped
                self._buf = buf[start + len(self.START) :]
                continue
            if end >= 0:
                reasoning.append(buf[:end])
                self._buf = buf[end + len(self.END) :]
                self._reasoning = False
                break
            keep = (
                0 if final else max(partial_tag_overlap(buf, self.START), partial_tag_overlap(buf, self.END))
            )
            reasoning.append(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            break
        text = "".join(reasoning)
        if text:
            out.append(ReasoningDelta(text))
        if not self._reasoning and self._buf:
            out.append(ContentDelta(self._buf))
            self._buf = ""
        return out
