"""Tool-call parsers: a model's output text → OpenAI ``tool_calls``, whole or streamed.

One state loop (:meth:`ToolCallParser._advance`) for every format, each format adding
its own states (markers, separators); each call's JSON object is read by
:class:`.callobject.CallObject`. The whole-text :meth:`ToolCallParser.parse` runs the
same machine over the whole text, so a streamed response reassembles to exactly the
non-streamed one however the text was split. Formats (vLLM's parser names):

- ``hermes`` (Hermes 2 Pro, Qwen2.5/Qwen3): ``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>``, one block per call, after optional content.
- ``llama3_json`` (also ``llama4_json``; Llama 3.x): the output is a JSON object
  ``{"name": ..., "parameters": ...}`` (``"arguments"`` also accepted), possibly after
  ``<|python_tag|>``; several are separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects
  (or one bare object), or the v11+ form ``[TOOL_CALLS]name[ARGS]{...}`` repeated.

``arguments`` is ``json.dumps(value, ensure_ascii=False)`` of what the model wrote, as in
vLLM's whole-text parsers (see :mod:`.jsonstream` for the rare differences); Mistral keeps
string-typed arguments as they are, as vLLM does.

Rules shared by the formats, following vLLM:

- Content streams as soon as it cannot be the start of a marker; only a possible partial
  marker is held back. Whitespace-only content before the calls becomes ``None``.
- A call's first delta goes out once its name is complete and its arguments have begun;
  the arguments then stream as they are read.
- Text that looks like a call but is not one (not JSON, no ``name``, no arguments where
  the format needs them, a truncated call whose arguments never began) is content: when
  it is the first call, the whole output is returned as content, with no tool calls.
- Text after the first call that is not a call is dropped (vLLM returns only the content
  before the first call).

Where vLLM's own streaming and non-streaming paths disagree, this module picks one
behaviour for both, since a streamed delta cannot be taken back:

- a call that breaks after its arguments began (cut off by ``max_tokens``, or malformed
  further on) is kept with the arguments read so far, as OpenAI and vLLM's streaming do
  (vLLM's whole-text parser returns the text as content instead, and so does the
  gateway's non-streamed answer when the output ended by itself: ``output.py``);
- a later call that is not one is dropped, earlier calls stand (vLLM's whole-text
  parser would return everything as content);
- ``llama3_json``: a bare JSON object counts only at the start of the output, and text
  before ``<|python_tag|>`` is content (vLLM's streaming rules; its whole-text parser
  searches for objects anywhere and drops the text around them). A JSON object at the
  start is held back until it is known to be a call or not.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Callable
from typing import ClassVar

from services.common.parsers.callobject import WS as _WS
from services.common.parsers.callobject import CallObject
from services.common.parsers.events import (
    ContentDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    ToolEvent,
)

IdFactory = Callable[[], str]

_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """``call_`` + 24 random hex digits (OpenAI's ids are ``call_`` + 24 characters)."""
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """9 random alphanumerics: Mistral's chat templates refuse any other tool-call id
    when the call comes back in the history."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _skip_ws(text: str) -> int:
    return len(text) - len(text.lstrip(_WS))


def assemble(events: list[ToolEvent]) -> tuple[str | None, list[ToolCall]]:
    """Fold streamed events into the whole-text result ``(content, tool_calls)``.

    ``content`` is ``None`` when calls were found and no text (or only whitespace)
    preceded them; with no calls it is the model's text, unchanged.
    """
    content: list[str] = []
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for ev in events:
        if isinstance(ev, ContentDelta):
            content.append(ev.text)
            continue
        if isinstance(ev.id, str):
            ids[ev.index] = ev.id
        if isinstance(ev.function.name, str):
            names[ev.index] = ev.function.name
        args.setdefault(ev.index, []).append(ev.function.arguments)
    calls = [
        ToolCall(id=ids[i], function=FunctionCall(name=names[i], arguments="".join(args[i])))
        for i in sorted(names)
    ]
    text = "".join(content)
    if calls:
        return (text or None), calls
    return text, calls


# ------------------------------------------------------------------ the parsers

# States every format shares; each format adds its own (strings, so they read in a debugger).
_CALL, _DROP, _FALLBACK = "call", "drop", "fallback"

# Outcomes of feeding the current call.
_MORE = 0  # needs more text
_CALL_DONE = 1
_CALL_BROKEN = 2  # announced, then malformed or cut off: kept as far as it went
_CALL_INVALID = 3  # never became a call


class ToolCallParser:
    """Incremental tool-call parser for one response (one choice); see the module doc.

    ``feed(delta_text)`` and ``finish()`` return events: :class:`ContentDelta` and
    :class:`ToolCallDelta` (OpenAI's streamed shape). ``parse(text)`` is the whole-text
    result, computed on a fresh parser so it never disturbs a stream in progress.
    """

    name: ClassVar[str]
    _arg_keys: ClassVar[tuple[str, ...]] = ("arguments",)
    _args_optional: ClassVar[bool] = False
    _raw_string_args: ClassVar[bool] = False
    _default_id: ClassVar[IdFactory] = staticmethod(openai_call_id)
    _initial_state: ClassVar[str]

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        self._id_factory = id_factory
        self._new_id: IdFactory = id_factory or type(self)._default_id
        self._events: list[ToolEvent] = []
        self._buf = ""  # text read but not yet consumed: a possible partial marker
        self._held: list[str] = []  # the first call's raw text, returned as content if it is not one
        self._holding = False
        self._ws = ""  # whitespace-only leading content, dropped if calls follow
        self._content_started = False
        self._index = 0  # announced calls so far
        self._call: CallObject | None = None
        self._announced = False
        self._fallback = False  # the first call was not one: everything is content
        self._finished = False
        self._state = self._initial_state

    # -- public

    def feed(self, delta_text: str) -> list[ToolEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta_text
        self._advance(final=False)
        return self._drain()

    def finish(self) -> list[ToolEvent]:
        if not self._finished:
            self._finished = True
            self._advance(final=True)
            if self._index == 0 and self._ws:
                self._events.append(ContentDelta(self._ws))
                self._ws = ""
        return self._drain()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        fresh = type(self)(self._id_factory)
        return assemble(fresh.feed(text) + fresh.finish())

    # -- the state loop

    def _advance(self, final: bool) -> None:
        """Run the states until one needs more text. The states after a fallback, after
        a dropped tail and inside a call are the same in every format; the format's own
        states (markers, separators) are its :meth:`_step`."""
        while True:
            state = self._state
            if state == _FALLBACK:
                self._content(self._consume(len(self._buf)))
                return
            if state == _DROP:
                self._buf = ""
                return
            if state == _CALL:
                outcome = self._feed_call(final)
                if outcome == _MORE:
                    return
                if outcome == _CALL_INVALID and self._index == 0:
                    self._fall_back()
                else:
                    self._state = self._after_call(outcome)
            elif not self._step(state, final):
                return

    # -- for the formats

    def _step(self, state: str, final: bool) -> bool:
        """Advance one of the format's own states; False when it needs more text."""
        raise NotImplementedError

    def _after_call(self, outcome: int) -> str:
        """The state after a call ended (``outcome``), unless it was an invalid first call."""
        raise NotImplementedError

    def _invalid(self) -> None:
        """Not a call where one must be: the first falls back to content, a later one
        drops the rest of the output."""
        if self._index == 0:
            self._fall_back()
        else:
            self._state = _DROP

    def _consume(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        if self._holding:
            self._held.append(text)
        return text

    def _content(self, text: str) -> None:
        """Text before the first call: content. After a call: dropped (vLLM)."""
        if not text or self._index > 0:
            return
        if self._content_started or self._fallback:
            self._events.append(ContentDelta(text))
        elif not text.strip(_WS):
            self._ws += text
        else:
            self._events.append(ContentDelta(self._ws + text))
            self._ws = ""
            self._content_started = True

    def _scan(self, marker: str, final: bool) -> bool:
        """Emit content up to ``marker`` and consume it; False when it is not (yet) there."""
        i = self._buf.find(marker)
        if i < 0:
            keep = 0 if final else partial_tag_overlap(self._buf, marker)
            self._content(self._consume(len(self._buf) - keep))
            return False
        self._content(self._consume(i))
        self._holding = self._index == 0
        self._consume(len(marker))
        return True

    def _fall_back(self) -> None:
        """The first call was not a call: the whole output is content."""
        text = "".join(self._held) + self._buf
        self._buf = ""
        self._held = []
        self._holding = False
        self._fallback = True
        self._state = _FALLBACK
        self._call = None
        self._content(self._ws + text)
        self._ws = ""

    def _start_call(self, call: CallObject | None = None) -> None:
        self._call = call or CallObject(self._arg_keys, self._args_optional, self._raw_string_args)
        self._announced = False
        self._state = _CALL

    def _feed_call(self, final: bool) -> int:
        call = self._call
        assert call is not None
        self._consume(call.feed(self._buf, 0))
        if final and not (call.done or call.failed):
            call.end()
        # Decided on what has been read, never on how it was split: a call announced
        # and then found malformed stays a call (its deltas are already out).
        if not self._announced and call.name is not None and call.args_started:
            self._events.append(
                ToolCallDelta(
                    index=self._index,
                    id=self._new_id(),
                    type="function",
                    function=FunctionCallDelta(name=call.name, arguments=""),
                )
            )
            self._announced = True
            self._holding = False
            self._held = []
            self._ws = ""
        if self._announced:
            args = call.take_args()
            if args:
                self._events.append(
                    ToolCallDelta(index=self._index, function=FunctionCallDelta(arguments=args))
                )
        if call.done or call.failed or final:
            self._call = None
            if self._announced:
                self._index += 1
                return _CALL_DONE if call.done else _CALL_BROKEN
            return _CALL_INVALID
        return _MORE

    def _drain(self) -> list[ToolEvent]:
        """The events since the last call, adjacent fragments of the same kind merged."""
        out: list[ToolEvent] = []
        for ev in self._events:
            prev = out[-1] if out else None
            if isinstance(ev, ContentDelta) and isinstance(prev, ContentDelta):
                out[-1] = ContentDelta(prev.text + ev.text)
            elif (
                isinstance(ev, ToolCallDelta)
                and isinstance(prev, ToolCallDelta)
                and prev.index == ev.index
                and not isinstance(ev.id, str)
                and not isinstance(prev.id, str)
            ):
                merged = prev.function.arguments + ev.function.arguments
                out[-1] = ToolCallDelta(index=ev.index, function=FunctionCallDelta(arguments=merged))
            else:
                out.append(ev)
        self._events = []
        return out


_SCAN, _AFTER = "scan", "after"


class HermesToolParser(ToolCallParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen).

    Some models mark the tags as special tokens: vLLM detokenizes with
    ``skip_special_tokens=False`` when tools are given, so the tags reach the text.
    """

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    _initial_state = _SCAN

    def _after_call(self, outcome: int) -> str:
        return _AFTER  # a later call that is not one is skipped, and the next one read

    def _step(self, state: str, final: bool) -> bool:
        if state == _SCAN:
            if not self._scan(self.START, final):
                return False
            self._start_call()
            return True
        # _AFTER: skip the rest of the call block up to "</tool_call>" (or the next
        # "<tool_call>": some models leave a block unclosed).
        ends = [i for i in (self._buf.find(self.END), self._buf.find(self.START)) if i >= 0]
        if not ends:
            keep = (
                0
                if final
                else max(
                    partial_tag_overlap(self._buf, self.END),
                    partial_tag_overlap(self._buf, self.START),
                )
            )
            self._consume(len(self._buf) - keep)
            return False
        i = min(ends)
        self._consume(i + len(self.END) if self._buf.startswith(self.END, i) else i)
        self._state = _SCAN
        return True


_START, _CONTENT, _BETWEEN = "start", "content", "between"


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.x JSON tool calls: ``[<|python_tag|>]{"name": "f", "parameters": {...}}``,
    several separated by ``;``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    _arg_keys = ("parameters", "arguments")
    _initial_state = _START

    def _after_call(self, outcome: int) -> str:
        return _BETWEEN if outcome == _CALL_DONE else _DROP

    def _step(self, state: str, final: bool) -> bool:
        if state == _START:
            # A call is a JSON object at the very start (after whitespace) or follows the tag.
            j = _skip_ws(self._buf)
            rest = self._buf[j:]
            if not rest:
                if final:
                    self._content(self._consume(len(self._buf)))
                return False
            if rest.startswith("{"):
                self._holding = True
                self._consume(j)
                self._start_call()
            elif self.TAG.startswith(rest) and not final:
                return False
            else:
                self._state = _CONTENT
            return True
        if state == _CONTENT:
            if not self._scan(self.TAG, final):
                return False
            self._start_call()
            return True
        # _BETWEEN: separators, then another call (or the tag before one), else the end.
        self._consume(len(self._buf) - len(self._buf.lstrip(_WS + ";")))
        if not self._buf:
            return False
        if self._buf.startswith("{"):
            self._start_call()
        elif self._buf.startswith(self.TAG):
            self._consume(len(self.TAG))
        elif self.TAG.startswith(self._buf) and not final:
            return False
        else:
            self._state = _DROP
        return True


_MARKER, _ARRAY_FIRST, _ARRAY_ELEM, _ARRAY_NEXT, _V11_NAME, _V11_NEXT = (
    "marker",
    "array_first",
    "array_elem",
    "array_next",
    "v11_name",
    "v11_next",
)
# The characters of a tool's name (services/gateway/tools.py's NAME_PATTERN: MCP's too).
_V11_NAME_RE = re.compile(r"[A-Za-z0-9_.:/\-]*")


class MistralToolParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (Mistral before the v11
    tokenizer), or ``[TOOL_CALLS]f[ARGS]{...}`` per call (v11+).

    ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: the worker must detokenize with
    ``skip_special_tokens=False`` for them to reach the text (vLLM does the same).
    """

    name = "mistral"
    BOT = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    _args_optional = True  # vLLM: a call without arguments gets "{}"
    _raw_string_args = True  # vLLM: string arguments are kept as they are
    _default_id = staticmethod(mistral_call_id)
    _initial_state = _CONTENT

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory)
        self._in_array = False
        self._call_was_v11 = False

    def _next_char(self, final: bool) -> str:
        """Skip whitespace; the next character, or "" when there is none yet."""
        self._consume(_skip_ws(self._buf))
        if not self._buf and final:
            self._invalid()
        return self._buf[:1]

    def _after_call(self, outcome: int) -> str:
        if outcome != _CALL_DONE:
            return _DROP
        if self._in_array:
            return _ARRAY_NEXT
        return _V11_NEXT if self._call_was_v11 else _DROP

    def _step(self, state: str, final: bool) -> bool:
        if state == _CONTENT:
            if not self._scan(self.BOT, final):
                return False
            self._state = _MARKER
        elif state == _MARKER:
            ch = self._next_char(final)
            if not ch:
                return False
            if ch == "[":
                self._consume(1)
                self._in_array = True
                self._state = _ARRAY_FIRST
            elif ch == "{":
                self._start_call()
            else:
                self._state = _V11_NAME
        elif state in (_ARRAY_FIRST, _ARRAY_ELEM):
            ch = self._next_char(final)
            if not ch:
                return False
            if ch == "{":
                self._start_call()
            elif ch == "]" and state == _ARRAY_FIRST:
                self._consume(1)
                self._invalid()  # an empty list of calls
            else:
                self._invalid()
        elif state == _ARRAY_NEXT:
            ch = self._next_char(final)
            if not ch:
                return False
            self._consume(1)
            self._state = _ARRAY_ELEM if ch == "," else _DROP
        elif state == _V11_NAME:
            i = self._buf.find(self.ARGS)
            head = self._buf if i < 0 else self._buf[:i]
            if i < 0:
                keep = partial_tag_overlap(self._buf, self.ARGS)
                if _V11_NAME_RE.fullmatch(self._buf[: len(self._buf) - keep]) is None or final:
                    self._invalid()
                return False
            if _V11_NAME_RE.fullmatch(head) is None or not head:
                self._invalid()
                return True
            self._consume(i + len(self.ARGS))
            self._start_call(CallObject.bare_args(head, self._raw_string_args))
            self._call_was_v11 = True
        else:  # _V11_NEXT
            ch = self._next_char(final=False)
            if not ch:
                return False
            if self._buf.startswith(self.BOT):
                self._consume(len(self.BOT))
                self._state = _V11_NAME
            elif self.BOT.startswith(self._buf) and not final:
                return False
            else:
                self._state = _DROP
        return True
