"""One tool call's JSON object, read incrementally: the scanner every tool-call format
in :mod:`.tool_calls` shares (Hermes' ``<tool_call>`` body, a Llama 3 JSON call, a
Mistral array element or v11 ``[ARGS]`` value).
"""

from __future__ import annotations

import json

from services.common.parsers.jsonstream import JsonStream

WS = " \t\n\r"

_C_OPEN = 0  # expecting "{"
_C_FIRST = 1  # after "{": a key or "}"
_C_KEY = 2  # after ",": a key
_C_IN_KEY = 3
_C_COLON = 4
_C_VALUE = 5  # expecting a value
_C_IN_VALUE = 6
_C_AFTER = 7  # after a member: "," or "}"
_C_DONE = 8
_C_FAILED = 9


class CallObject:
    """Reads one ``{"name": "...", "<arguments key>": value, ...}`` object incrementally.

    ``name`` is set once the name string is complete; the arguments' canonical text is
    collected as it is read (:meth:`take_args`), whatever the key order. Other keys are
    validated and ignored, as vLLM ignores them.
    """

    def __init__(self, arg_keys: tuple[str, ...], args_optional: bool, raw_string_args: bool) -> None:
        self._arg_keys = arg_keys
        self._args_optional = args_optional
        self._raw_string_args = raw_string_args
        self._mode = _C_OPEN
        self._stream: JsonStream | None = None
        self._role = ""  # of the value being read: "name", "args" or "skip"
        self._text: list[str] = []  # canonical text of the key or name being read
        self._have_args = False
        self._args: list[str] = []
        self.name: str | None = None
        self.args_started = False

    @classmethod
    def bare_args(cls, name: str, raw_string_args: bool) -> CallObject:
        """Only the arguments value, the name being known (Mistral v11+ ``name[ARGS]{...}``)."""
        call = cls((), args_optional=False, raw_string_args=raw_string_args)
        call.name = name
        call._have_args = True
        call._role = "args"
        call._mode = _C_VALUE
        return call

    @property
    def done(self) -> bool:
        return self._mode == _C_DONE

    @property
    def failed(self) -> bool:
        return self._mode == _C_FAILED

    def take_args(self) -> str:
        out = "".join(self._args)
        self._args.clear()
        return out

    def _collect(self) -> None:
        assert self._stream is not None
        out = self._stream.take()
        if self._role == "args":
            self._args.append(out)
            self.args_started = self._stream.started
        elif self._role in ("name", "key"):
            self._text.append(out)

    def _value_read(self) -> None:
        if self._role == "name":
            self.name = json.loads("".join(self._text))
        # A bare arguments value (no enclosing object) ends the call with it.
        self._mode = _C_DONE if not self._arg_keys and self._role == "args" else _C_AFTER

    def _key_read(self) -> None:
        key = json.loads("".join(self._text))
        self._text = []
        if key == "name" and self.name is None:
            self._role = "name"
        elif key in self._arg_keys and not self._have_args:
            self._role = "args"
            self._have_args = True
        else:
            self._role = "skip"
        self._mode = _C_COLON

    def _close(self) -> None:
        if self.name is None:
            self._mode = _C_FAILED
            return
        if not self._have_args:
            if not self._args_optional:
                self._mode = _C_FAILED
                return
            self._args.append("{}")
            self.args_started = True
        self._mode = _C_DONE

    def feed(self, text: str, pos: int) -> int:
        n = len(text)
        while pos < n:
            mode = self._mode
            if mode in (_C_DONE, _C_FAILED):
                return pos
            if mode in (_C_IN_KEY, _C_IN_VALUE):
                assert self._stream is not None
                pos = self._stream.feed(text, pos)
                self._collect()
                if self._stream.failed:
                    self._mode = _C_FAILED
                elif self._stream.done:
                    self._stream = None
                    if mode == _C_IN_KEY:
                        self._key_read()
                    else:
                        self._value_read()
                continue
            ch = text[pos]
            if ch in WS:
                pos += 1
                continue
            if mode == _C_OPEN:
                if ch != "{":
                    self._mode = _C_FAILED
                    return pos
                self._mode = _C_FIRST
                pos += 1
            elif mode in (_C_FIRST, _C_KEY):
                if ch == '"':
                    self._role = "key"
                    self._text = []
                    self._stream = JsonStream()
                    self._mode = _C_IN_KEY
                elif ch == "}" and mode == _C_FIRST:
                    self._close()
                    pos += 1
                else:
                    self._mode = _C_FAILED
                    return pos
            elif mode == _C_COLON:
                if ch != ":":
                    self._mode = _C_FAILED
                    return pos
                self._mode = _C_VALUE
                pos += 1
            elif mode == _C_VALUE:
                if self._role == "name" and ch != '"':  # a name must be a string
                    self._mode = _C_FAILED
                    return pos
                self._text = []
                self._stream = JsonStream(raw_string=self._role == "args" and self._raw_string_args)
                self._mode = _C_IN_VALUE
            elif mode == _C_AFTER:
                if ch == ",":
                    self._mode = _C_KEY
                    pos += 1
                elif ch == "}":
                    self._close()
                    pos += 1
                else:
                    self._mode = _C_FAILED
                    return pos
        return pos

    def end(self) -> None:
        """No more input: a truncated arguments value yields what was generated of it."""
        if self._mode == _C_IN_VALUE and self._role == "args" and self._stream is not None:
            self._stream.end()
            self._collect()
