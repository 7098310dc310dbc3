"""Chat templates: turn OpenAI-style messages into the prompt text a model was trained on.

Templates are Jinja2, rendered the way Hugging Face transformers renders them
(``ImmutableSandboxedEnvironment``, ``trim_blocks``/``lstrip_blocks``, the loopcontrols
extension, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII,
``bos_token``/``eos_token`` and ``add_generation_prompt`` in the context), so a model's
``tokenizer_config.json`` template produces the same prompt here as in vLLM.

Templates come from operators, but a broken or hostile one must not take the gateway
down: the sandbox refuses attribute tricks and mutation, and on top of it every render
has a budget — output length, steps (loop iterations, calls, operators, lookups) and
wall time — plus size checks on the operators and calls that can build huge values
from small ones (``"x" * 10**9``, ``~`` doubling in a loop, ``center(10**9)``,
``10 ** 10**9``, ``"%999999999d" % 1``). Every failure is a ``ChatTemplateError``.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, the format of the sim models (and of Qwen and many others). With the byte
# tokenizer every character is a byte token, so token counts are easy to predict.
# With tools it renders them the Hermes/Qwen way, so the sim path of tool calling reads
# like a real model's prompt: the tools as JSON in the system turn (after the client's
# system message, if any), an assistant's calls as <tool_call> JSON, results as
# <tool_response>. Without tools the output is plain ChatML, as before.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nTo call a function, reply with a JSON object within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ErrorReason = Literal["raised", "too_long", "budget", "broken"]


class ChatTemplateError(Exception):
    """Compiling or rendering a chat template failed.

    ``reason`` says whose problem it is:
    ``raised``   the template refused the conversation via ``raise_exception`` (e.g.
                 "roles must alternate") — the client's to fix;
    ``too_long`` the rendered prompt passed ``max_output_chars`` — the client's;
    ``budget``   rendering took more steps or time than allowed — the conversation is
                 too big for this template;
    ``broken``   the template itself failed (syntax error, undefined name, sandbox
                 violation) — the operator's to fix.
    """

    def __init__(self, message: str, reason: ErrorReason) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason

    @property
    def message(self) -> str:
        return str(self.args[0])


class _Raised(jinja2.TemplateError):
    """What ``raise_exception`` raises inside a template."""


class _Refused(Exception):
    """A budget or size check stopped the render."""

    def __init__(self, message: str, reason: ErrorReason) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason


class _Budget:
    __slots__ = ("clock", "deadline", "steps_left")

    def __init__(self, steps: int, seconds: float, clock: Callable[[], float]) -> None:
        self.steps_left = steps
        self.clock = clock
        self.deadline = clock() + seconds

    def tick(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _Refused("chat template rendering exceeded its step budget", "budget")
        if self.clock() > self.deadline:
            raise _Refused("chat template rendering exceeded its time budget", "budget")


# The budget of the render in progress. A ContextVar rather than an attribute of the
# environment so concurrent renders (threads, executor) never share one.
_current: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _tick() -> None:
    budget = _current.get()
    if budget is not None:  # None while Jinja constant-folds at compile time
        budget.tick()


class _CountedList(list[Any]):
    """A list whose iteration spends the render's budget (nested loops over messages)."""

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            _tick()
            yield item


class _CountedRange(Sequence[int]):
    """``range`` for templates: same sequence, but iteration spends the budget.

    Jinja's own sandbox range only caps one range's length (100 000), which still lets
    nested loops run for hours without output.
    """

    __slots__ = ("_r",)

    def __init__(self, r: range) -> None:
        self._r = r

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, index: Any) -> Any:
        item = self._r[index]
        return _CountedRange(item) if isinstance(item, range) else item

    def __iter__(self) -> Iterator[int]:
        for item in self._r:
            _tick()
            yield item

    def __reversed__(self) -> Iterator[int]:
        return iter(_CountedRange(self._r[::-1]))

    def __repr__(self) -> str:
        return repr(self._r)


_PERCENT_WIDTH = re.compile(r"%[-+ #0]*(?:\d{7,}|\*)|%[-+ #0]*\d*\.(?:\d{7,}|\*)")
_FORMAT_WIDTH = re.compile(r"\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")
_MAX_INT_BITS = 1 << 16  # big-int arithmetic past this is a CPU trap, never a prompt


class _Generator(CodeGenerator):
    """Routes ``~`` (string concatenation) through a size check.

    ``{% set ns.s = ns.s ~ ns.s %}`` in a loop doubles a string per iteration without
    calling anything the sandbox can intercept.
    """

    @optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Environment(ImmutableSandboxedEnvironment):
    code_generator_class = _Generator
    # The operators that can make a value much bigger than their operands.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_chars: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_chars = max_chars

    def _check_size(self, size: int) -> None:
        if size > self.max_chars:
            raise _Refused(f"chat template built a value of {size} characters (limit {self.max_chars})", "too_long")

    def _check_args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        # Widths, counts and indents bigger than the output limit can only be an attack:
        # str.center/ljust/zfill, the center/indent/wordwrap filters, range(...).
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
                raise _Refused(f"chat template passed an argument of {value} (limit {self.max_chars})", "too_long")

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        _tick()
        strings = [str(p) for p in parts]
        self._check_size(sum(map(len, strings)))
        return "".join(strings)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise _Refused("chat template multiplied integers too large", "budget")
            elif isinstance(left, (str, list, tuple)) and isinstance(right, int):
                self._check_size(len(left) * max(right, 0))
            elif isinstance(right, (str, list, tuple)) and isinstance(left, int):
                self._check_size(len(right) * max(left, 0))
        elif operator == "**":
            if isinstance(right, int) and abs(right) > 1024 and left not in (0, 1, -1):
                raise _Refused("chat template raised a number to a huge power", "budget")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                self._check_size(len(left) + len(right))
        elif operator == "%" and isinstance(left, str) and _PERCENT_WIDTH.search(left):
            raise _Refused("chat template used a huge or '*' width in %-formatting", "too_long")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        __self._check_args(args, kwargs)
        # str.format arrives wrapped by the sandbox; the format string is the bound self.
        target = getattr(__obj, "__wrapped__", __obj)
        fmt = getattr(target, "__self__", None)
        if isinstance(fmt, str) and getattr(target, "__name__", "") in ("format", "format_map"):
            if _FORMAT_WIDTH.search(fmt):
                raise _Refused("chat template used a huge width in str.format", "too_long")
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask
    marker, used by some templates) and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: object) -> None:
    raise _Raised(str(message))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: unlike Jinja's, it does not HTML-escape and keeps non-ASCII.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _bounded_filter(env: _Environment, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    # functools.wraps copies __dict__, which keeps Jinja's pass_context/pass_environment marks.
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _tick()
        env._check_args(args, kwargs)
        # the format filter is %-formatting: same width check as the % operator
        if name == "format" and any(isinstance(a, str) and _PERCENT_WIDTH.search(a) for a in args):
            raise _Refused("chat template used a huge or '*' width in the format filter", "too_long")
        return func(*args, **kwargs)

    return wrapper


class ChatTemplate:
    """A compiled chat template with a bounded renderer.

    ``source`` None means ``DEFAULT_CHAT_TEMPLATE``. Construction compiles the template
    and raises ``ChatTemplateError(reason="broken")`` for a syntax error, so a bad
    operator template fails when the model is configured, not on the first request.
    ``now`` feeds ``strftime_now`` (Llama 3.x templates print today's date); ``clock``
    (monotonic seconds) measures the render's time budget. Both are injectable for tests.
    """

    def __init__(
        self,
        source: str | None = None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        max_output_chars: int = 8_000_000,
        max_steps: int = 5_000_000,
        max_seconds: float = 2.0,
        now: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = DEFAULT_CHAT_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.max_output_chars = max_output_chars
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self._clock = clock
        env = _Environment(
            max_output_chars,
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        )
        env.globals.pop("lipsum", None)  # lipsum(n=...) is an unbounded text generator
        env.globals["range"] = lambda *args: _CountedRange(range(*args))
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.fromtimestamp(now()).strftime(str(fmt))
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(env, name, f) for name, f in env.filters.items()}
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc} (line {exc.lineno})", "broken") from exc
        except Exception as exc:  # a template that breaks Jinja's compiler in other ways
            raise ChatTemplateError(f"chat template does not compile: {exc}", "broken") from exc

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: object,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **kwargs: Any,
    ) -> ChatTemplate:
        """The tokenizer's own template (``HFTokenizer.chat_template``) or the default.

        ``bos_token``/``eos_token`` are the special tokens' text (``"<|begin_of_text|>"``),
        taken from the tokenizer's ``bos_token``/``eos_token`` string attributes when it has
        them; templates such as Llama's print ``bos_token`` into the prompt.
        """
        source = getattr(tokenizer, "chat_template", None)
        bos = bos_token if bos_token is not None else getattr(tokenizer, "bos_token", "")
        eos = eos_token if eos_token is not None else getattr(tokenizer, "eos_token", "")
        return cls(
            source if isinstance(source, str) else None,
            bos_token=bos if isinstance(bos, str) else "",
            eos_token=eos if isinstance(eos, str) else "",
            **kwargs,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        extra_context: Mapping[str, Any] | None = None,
        max_output_chars: int | None = None,
    ) -> str:
        """The prompt text for ``messages``.

        Messages are dicts with ``role``, ``content`` and maybe ``name``; an assistant's
        may carry ``tool_calls`` (``[{"id", "type", "function": {"name", "arguments":
        dict}}]``), a tool message ``tool_call_id``. ``tools`` is transformers'
        ``apply_chat_template(tools=...)``: the request's tool definitions
        (``{"type": "function", "function": {...}}``), None without tools.
        ``continue_final_message``: the prompt ends inside the last message (its end-of-turn
        markup cut off) so the model continues it, as transformers does it; it excludes
        ``add_generation_prompt``.

        Raises ``ChatTemplateError`` and nothing else.
        """
        if continue_final_message:
            return self._continue(messages, tools, extra_context, max_output_chars)
        limit = self.max_output_chars if max_output_chars is None else min(max_output_chars, self.max_output_chars)
        # tools/documents are None, not undefined, as transformers passes them: templates
        # test ``tools is not none`` (undefined would count as "not none").
        context: dict[str, Any] = {"tools": None, "documents": None}
        context.update(extra_context or {})
        if tools is not None:
            # Templates loop over the tools (and print each as JSON): iterating spends the budget.
            context["tools"] = _CountedList(dict(t) for t in tools)
        context.update(
            messages=_CountedList(dict(m) for m in messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        token = _current.set(_Budget(self.max_steps, self.max_seconds, self._clock))
        try:
            parts: list[str] = []
            size = 0
            for chunk in self._template.generate(context):
                size += len(chunk)
                if size > limit:
                    raise _Refused(
                        f"the rendered prompt is longer than {limit} characters", "too_long"
                    )
                parts.append(chunk)
            return "".join(parts)
        except _Raised as exc:
            raise ChatTemplateError(exc.message or "the chat template rejected the conversation", "raised") from None
        except _Refused as exc:
            raise ChatTemplateError(str(exc), exc.reason) from None
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply", "broken") from None
        except MemoryError:
            raise ChatTemplateError("chat template ran out of memory", "too_long") from None
        except Exception as exc:
            # Template code can raise anything (TypeError, KeyError, SecurityError,
            # UndefinedError...): all of them mean the template is broken, not the request.
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}", "broken") from None
        finally:
            _current.reset(token)

    def _continue(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        extra_context: Mapping[str, Any] | None,
        max_output_chars: int | None,
    ) -> str:
        # transformers' render_jinja_template: mark the end of the final message's content,
        # render, cut at the mark (and the spacing before it, if the template trimmed it).
        if not messages:
            raise ChatTemplateError("continue_final_message needs a final message to continue", "raised")
        final = messages[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message with text content", "raised")
        if "content" not in self.source:
            raise ChatTemplateError("continue_final_message is not possible with this chat template", "raised")
        marked = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self.render(marked, add_generation_prompt=False, tools=tools, extra_context=extra_context,
                           max_output_chars=None if max_output_chars is None else max_output_chars + len(_CONTINUE_TAG))
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError(
                "continue_final_message: the chat template drops part of the final message, so it cannot be continued",
                "raised",
            )
        at = text.rindex(tag)
        return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker
