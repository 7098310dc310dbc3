"""Incremental JSON: validate a value as its text arrives and re-serialise it canonically.

Tool-call arguments are streamed as they are generated, and the concatenated fragments
must equal what a whole-text parse returns. vLLM's whole-text parsers return
``json.dumps(value, ensure_ascii=False)``; :class:`JsonStream` produces that same text,
piece by piece, as far as the input read so far determines it, so streaming and
whole-text agree by construction and both match vLLM's non-streaming output.

Canonical form (``json.dumps`` defaults): ``", "`` and ``": "`` separators, non-ASCII
kept, ``"``, ``\\`` and control characters escaped. Differences from
``json.dumps(json.loads(text))``, all on inputs a model rarely produces:

- duplicate object keys are kept in order (``json.loads`` keeps only the last);
- a lone UTF-16 surrogate escape stays an escape (``json.dumps`` would emit a bare
  surrogate, which is not valid UTF-8), or becomes U+FFFD in a raw string;
- ``NaN``/``Infinity`` are refused (they are not JSON), and a number too large for a
  float keeps its digits rather than becoming ``Infinity``.

The parser is strict like ``json.loads``: a raw control character inside a string is an
error. Errors are a state (``failed``), never an exception.
"""

from __future__ import annotations

import json
import math
import re

_WS = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
# A run of string characters that need no attention: not a quote, backslash or control.
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_HEX = frozenset("0123456789abcdefABCDEF")
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}


def _escape_char(ch: str) -> str:
    """``ch`` as ``json.dumps(..., ensure_ascii=False)`` writes it inside a string."""
    if ch == '"':
        return '\\"'
    if ch == "\\":
        return "\\\\"
    if ch < " ":
        short = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}.get(ch)
        return short if short is not None else f"\\u{ord(ch):04x}"
    return ch


def _canonical_number(token: str) -> str:
    value = json.loads(token)
    if isinstance(value, float) and not math.isfinite(value):
        return token  # json.dumps would write "Infinity", which is not JSON
    return json.dumps(value)


# Modes of the character machine.
_VALUE = 0  # expecting a value
_STRING = 1
_STR_ESC = 2  # after a backslash
_STR_U = 3  # collecting the 4 hex digits of \uXXXX
_NUMBER = 4
_LITERAL = 5
_OBJ_FIRST = 6  # after "{": a key or "}"
_OBJ_KEY = 7  # after ",": a key
_OBJ_COLON = 8
_AFTER = 9  # after a value inside a container: "," or the closer
_ARR_FIRST = 10  # after "[": a value or "]"
_DONE = 11
_FAILED = 12


class JsonStream:
    """One JSON value, fed in pieces; its canonical text comes out with :meth:`take`.

    ``feed(text, pos)`` consumes from ``text[pos:]`` and returns the index of the first
    character it did not consume: the end of ``text``, or the character just after the
    value once the value is complete (``done``), or the offending character (``failed``).
    A top-level number is complete only when a character that cannot continue it
    arrives, or at :meth:`end`.

    ``raw_string``: when the top-level value is a string, emit its decoded characters
    without quotes (Mistral's parser keeps string-typed ``arguments`` as they are).
    """

    def __init__(self, raw_string: bool = False) -> None:
        self._raw_string = raw_string
        self._out: list[str] = []
        self._stack: list[str] = []  # "{" or "[" per open container
        self._mode = _VALUE
        self._token = ""  # number, literal or \u digits being collected
        self._literal = ""
        self._key = False  # the string being read is an object key
        self._high: int | None = None  # a \uD8xx high surrogate waiting for its pair
        self.started = False  # the value's first character was read

    @property
    def done(self) -> bool:
        return self._mode == _DONE

    @property
    def failed(self) -> bool:
        return self._mode == _FAILED

    def take(self) -> str:
        """The canonical text produced since the last call."""
        out = "".join(self._out)
        self._out.clear()
        return out

    def _raw(self) -> bool:
        return self._raw_string and not self._stack

    def _emit_char(self, ch: str) -> None:
        self._out.append(ch if self._raw() else _escape_char(ch))

    def _emit_surrogate(self, code: int) -> None:
        self._out.append("\ufffd" if self._raw() else f"\\u{code:04x}")

    def _flush_high(self) -> None:
        if self._high is not None:
            self._emit_surrogate(self._high)
            self._high = None

    def _value_done(self) -> None:
        self._mode = _AFTER if self._stack else _DONE

    def _fail(self) -> None:
        self._mode = _FAILED

    def feed(self, text: str, pos: int = 0) -> int:
        n = len(text)
        while pos < n:
            mode = self._mode
            if mode in (_DONE, _FAILED):
                return pos
            ch = text[pos]
            if mode == _STRING:
                m = _PLAIN_RUN.match(text, pos)
                if m is not None:
                    self._flush_high()
                    run = m.group()
                    self._out.append(run)  # nothing in it needs escaping
                    pos = m.end()
                    continue
                if ch == "\\":
                    self._mode = _STR_ESC
                elif ch == '"':
                    self._flush_high()
                    if not self._raw():
                        self._out.append('"')
                    if self._key:
                        self._key = False
                        self._mode = _OBJ_COLON
                    else:
                        self._value_done()
                else:  # a raw control character: json.loads refuses it (strict)
                    self._fail()
                    return pos
                pos += 1
            elif mode == _STR_ESC:
                if ch == "u":
                    self._token = ""
                    self._mode = _STR_U
                elif ch in _SHORT_ESCAPES:
                    self._flush_high()
                    self._emit_char(_SHORT_ESCAPES[ch])
                    self._mode = _STRING
                else:
                    self._fail()
                    return pos
                pos += 1
            elif mode == _STR_U:
                if ch not in _HEX:
                    self._fail()
                    return pos
                self._token += ch
                pos += 1
                if len(self._token) == 4:
                    self._unicode(int(self._token, 16))
                    self._token = ""
                    self._mode = _STRING
            elif mode == _NUMBER:
                if ch in _NUMBER_CHARS:
                    self._token += ch
                    pos += 1
                elif not self._end_number():
                    return pos
                # else: the terminating character is read again in the new mode
            elif mode == _LITERAL:
                want = self._literal[len(self._token)]
                if ch != want:
                    self._fail()
                    return pos
                self._token += ch
                pos += 1
                if self._token == self._literal:
                    self._out.append(self._literal)
                    self._token = ""
                    self._value_done()
            elif ch in _WS:
                pos += 1
            elif mode == _ARR_FIRST and ch == "]":
                self._close()
                pos += 1
            elif mode in (_VALUE, _ARR_FIRST):
                if not self._start_value(ch):
                    return pos
                pos += 1
            elif mode in (_OBJ_FIRST, _OBJ_KEY):
                if ch == '"':
                    self._out.append('"')
                    self._key = True
                    self._mode = _STRING
                elif ch == "}" and mode == _OBJ_FIRST:
                    self._close()
                else:
                    self._fail()
                    return pos
                pos += 1
            elif mode == _OBJ_COLON:
                if ch != ":":
                    self._fail()
                    return pos
                self._out.append(": ")
                self._mode = _VALUE
                pos += 1
            elif mode == _AFTER:
                top = self._stack[-1]
                if ch == ",":
                    self._out.append(", ")
                    self._mode = _OBJ_KEY if top == "{" else _VALUE
                elif (ch == "}" and top == "{") or (ch == "]" and top == "["):
                    self._close()
                else:
                    self._fail()
                    return pos
                pos += 1
        return pos

    def _start_value(self, ch: str) -> bool:
        self.started = True
        if ch == "{":
            self._stack.append("{")
            self._out.append("{")
            self._mode = _OBJ_FIRST
        elif ch == "[":
            self._stack.append("[")
            self._out.append("[")
            self._mode = _ARR_FIRST
        elif ch == '"':
            if not self._raw():
                self._out.append('"')
            self._mode = _STRING
        elif ch == "-" or "0" <= ch <= "9":
            self._token = ch
            self._mode = _NUMBER
        elif ch in _LITERALS:
            self._literal = _LITERALS[ch]
            self._token = ch
            self._mode = _LITERAL
        else:
            self._fail()
            return False
        return True

    def _close(self) -> None:
        self._out.append("}" if self._stack.pop() == "{" else "]")
        self._value_done()

    def _end_number(self) -> bool:
        """The number token ended; emit it canonically. False when it is not a number."""
        token = self._token
        self._token = ""
        if not _NUMBER_RE.match(token):
            self._fail()
            return False
        try:
            self._out.append(_canonical_number(token))
        except ValueError:  # over Python's int digit limit: keep the digits
            self._out.append(token)
        self._value_done()
        return True

    def _unicode(self, code: int) -> None:
        if 0xDC00 <= code <= 0xDFFF and self._high is not None:
            pair = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
            self._emit_char(chr(pair))
            return
        self._flush_high()
        if 0xD800 <= code <= 0xDBFF:
            self._high = code
        elif 0xDC00 <= code <= 0xDFFF:
            self._emit_surrogate(code)
        else:
            self._emit_char(chr(code))

    def end(self) -> None:
        """No more input. Completes a pending top-level number; for a truncated value,
        emits what was read of its last token so partial text is not lost."""
        mode = self._mode
        if mode == _NUMBER:
            if not self._stack:
                self._end_number()
                return
            self._out.append(self._token)  # truncated: keep the digits as generated
        elif mode == _LITERAL:
            self._out.append(self._token)
        elif mode == _STR_ESC:
            self._flush_high()
            self._out.append("\\")
        elif mode == _STR_U:
            self._flush_high()
            self._out.append("\\u" + self._token)
        elif mode == _STRING:
            self._flush_high()
        self._token = ""
