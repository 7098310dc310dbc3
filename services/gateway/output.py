"""From a request's token chunks to its OpenAI choices (pure, deterministic).

One ``ChoiceAssembler`` per request turns each worker chunk into ``ChoiceDelta``s: per
choice, the content, reasoning and tool-call deltas and the logprobs of its tokens,
and the choice's finish. Every front door formats those same deltas: SSE chunks and
the NATS stream (``events``), WebSocket messages (``ws_api``), and the whole non-streamed
response (``ChoiceAssembler.response``). The same chunks always give the same deltas
(tool-call ids derive from the request id), so a gateway replaying a stream from
JetStream rebuilds exactly the events a client already has.

Per choice the text goes through, in order: the reasoning parser (``<think>`` text goes to
``reasoning_content``), then the tool-call side: the model's tool parser (``auto``), or
the forced shapes of guided decoding (``required``: a JSON array of ``{name,
parameters}``; a named function: the text is its arguments), as vLLM's server does.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET, UnsetType

from proto import OutputOptions, TokenChunk, TokenLogprob, Usage
from services.common.parsers import (
    ContentDelta,
    ReasoningDelta,
    merge_by_index,
    reasoning_parser,
    tool_parser,
)

from .openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    CompletionUsage,
    FunctionCall,
    FunctionCallDelta,
    LogprobEntry,
    PromptLogprob,
    PromptLogprobs,
    RequestKind,
    TextCompletion,
    ToolCall,
    ToolCallDelta,
    TopLogprobEntry,
    encode_json,
    response_id,
    usage_from_proto,
)
from .tools import ForcedReply, ToolPlan, forced_reply


class _ToolStream:
    """The model's tool parser (``tool_choice`` auto) as (content, call deltas) per feed."""

    def __init__(self, name: str, request_id: str, choice: int, *, mistral_ids: bool = False) -> None:
        self._calls = 0

        def next_id() -> str:
            self._calls += 1
            return tool_call_id(request_id, choice, self._calls - 1, mistral=mistral_ids)

        self._parser = tool_parser(name, id_factory=next_id)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return _split(self._parser.feed(text)) if text else ("", [])

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return _split(self._parser.finish())


def _split(events: list[Any]) -> tuple[str, list[ToolCallDelta]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [e for e in events if isinstance(e, ToolCallDelta)]


class _ReasoningStream:
    """The model's reasoning parser as (reasoning, content) per feed."""

    def __init__(self, options: OutputOptions) -> None:
        self._parser = reasoning_parser(options.reasoning_parser, enable_thinking=options.thinking,
                                        end_token_id=options.reasoning_end_token_id)

    @property
    def reasoning_tokens(self) -> int:
        return int(self._parser.reasoning_tokens)

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, str]:
        return _sides(self._parser.feed(text, token_ids))

    def finish(self) -> tuple[str, str]:
        return _sides(self._parser.finish())


def _sides(events: list[Any]) -> tuple[str, str]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning, content


def _prompt_position(lp: TokenLogprob | None) -> dict[str, PromptLogprob] | None:
    """One prompt position as vLLM answers it: the prompt token first, then the most
    likely (the engine computed ``prompt_logprobs`` of them, ranked 1..k), keyed by token id."""
    if lp is None:
        return None
    rank = lp.rank or next((i + 1 for i, t in enumerate(lp.top) if t.token_id == lp.token_id), None)
    out = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=rank, decoded_token=lp.token)}
    for i, t in enumerate(lp.top):
        out.setdefault(str(t.token_id), PromptLogprob(logprob=t.logprob, rank=i + 1, decoded_token=t.token))
    return out


_ALNUM = string.ascii_letters + string.digits


def tool_call_id(request_id: str, choice: int, call: int, *, mistral: bool = False) -> str:
    """A tool call's id: derived, so a replayed stream repeats it. ``mistral``: 9
    alphanumerics, the only ids Mistral's chat templates take back in a conversation
    (vLLM's ``MistralToolCall``); else ``call_`` and 24 hex digits, as OpenAI's."""
    digest = hashlib.blake2s(f"{request_id}/{choice}/{call}".encode(), digest_size=12).digest()
    if mistral:
        return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])
    return f"call_{digest.hex()}"


@dataclass(slots=True)
class ChoiceDelta:
    """What one chunk added to one choice."""

    index: int
    first: bool = False  # the choice's first delta (chat: the role goes out with it)
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    chat_logprobs: list[LogprobEntry] | None = None
    completion_logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # with finish_reason: the stop string or token id (vLLM's)
    # A reasoning or tool parser took this chunk's text and has nothing to send yet: like
    # vLLM's server, no empty delta goes out for it (a plain choice's textless tokens do).
    parsed: bool = False

    @property
    def has_output(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.token_ids)


class _ForcedCalls:
    """Tool calls forced by guided decoding. ``function``: the whole text is the named
    function's arguments, streamed as they come. ``required``: a JSON array of
    ``{"name", "parameters"}``; each call goes out whole once its object closes."""

    def __init__(self, mode: str, name: str, request_id: str, choice: int, *, mistral_ids: bool = False) -> None:
        self.mode = mode
        self.name = name
        self.request_id = request_id
        self.choice = choice
        self.mistral_ids = mistral_ids
        self.calls = 0
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._start = -1

    def feed(self, text: str) -> list[ToolCallDelta]:
        if not text:
            return []
        if self.mode == "function":
            if self.calls == 0:  # the call opens with its first arguments, in one entry (as vLLM)
                self.calls = 1
                return [ToolCallDelta(index=0, id=self.call_id(0), type="function",
                                      function=FunctionCallDelta(name=self.name, arguments=text))]
            return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))]
        self._text += text
        return self._scan()

    def _scan(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        text = self._text
        for i in range(self._scanned, len(text)):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                continue
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
                if c == "{" and self._depth == 2:
                    self._start = i
            elif c in "}]":
                if c == "}" and self._depth == 2 and self._start >= 0:
                    call = _call_from_object(text[self._start : i + 1])
                    if call is not None:
                        name, arguments = call
                        out.append(ToolCallDelta(
                            index=self.calls, id=self.call_id(self.calls),
                            type="function", function=FunctionCallDelta(name=name, arguments=arguments)))
                        self.calls += 1
                    self._start = -1
                self._depth -= 1
        self._scanned = len(text)
        return out

    def call_id(self, call: int) -> str:
        return tool_call_id(self.request_id, self.choice, call, mistral=self.mistral_ids)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call_from_object(text: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    # As tools.forced_reply (vLLM): the parameters re-serialised, "null" when absent.
    return obj["name"], json.dumps(obj.get("parameters"), ensure_ascii=False)


@dataclass(slots=True)
class _Choice:
    index: int
    started: bool = False
    finish_reason: str | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # index → id, name, arguments parts
    chat_logprobs: list[LogprobEntry] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    text_offset: int = 0
    reasoning_stream: _ReasoningStream | None = None
    tool_stream: _ToolStream | None = None
    forced: _ForcedCalls | None = None
    forced_text: list[str] = field(default_factory=list)  # a forced call's raw output
    tool_text: list[str] = field(default_factory=list)  # what the tool parser read
    tokens: int = 0  # completion tokens so far
    engine_finish: str | None = None
    stop_reason: int | str | None = None


class ChoiceAssembler:
    def __init__(self, kind: RequestKind, request_id: str, model: str, created: int, options: OutputOptions,
                 include_usage: bool = False) -> None:
        self.kind = kind
        self.request_id = request_id
        self.id = response_id(kind, request_id)
        self.model = model
        self.created = created
        self.options = options
        self.include_usage = include_usage
        self._choices: dict[int, _Choice] = {}
        self.reasoning_tokens = 0
        self._prompt_logprobs: PromptLogprobs | None = None

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            o = self.options
            choice = _Choice(index)
            if o.reasoning_parser:
                choice.reasoning_stream = _ReasoningStream(o)
            if o.tool_choice == "auto" and o.tool_parser:
                choice.tool_stream = _ToolStream(o.tool_parser, self.request_id, index, mistral_ids=o.mistral_call_ids)
            elif o.tool_choice in ("required", "function"):
                choice.forced = _ForcedCalls(o.tool_choice, o.tool_name, self.request_id, index,
                                             mistral_ids=o.mistral_call_ids)
            if self.kind == "completion" and o.echo:
                choice.text_offset = 0
            self._choices[index] = choice
        return choice

    # ---- chunks → deltas -----------------------------------------------------------
    def deltas(self, chunk: TokenChunk) -> list[ChoiceDelta]:
        """What ``chunk`` adds, per choice (feed every chunk of the request, in order)."""
        out: list[ChoiceDelta] = []
        if chunk.prompt_logprobs is not None and self.options.prompt_logprobs and self._prompt_logprobs is None:
            self._prompt_logprobs = [_prompt_position(lp) for lp in chunk.prompt_logprobs]
        if (chunk.prompt_logprobs is not None and self.kind == "completion") or (chunk.seq == 0 and self.options.echo):
            out.extend(self._echo(chunk))
        single = self.options.n <= 1
        has_tokens = bool(chunk.token_ids or chunk.text)
        finish = chunk.choice_finish_reason or (chunk.finish_reason if single else None)
        if has_tokens or finish is not None or (single and chunk.seq == 0):
            out.append(self._advance(chunk.index, chunk.text, chunk.token_ids, chunk.logprobs, finish,
                                     chunk.stop_reason))
        return out

    def _echo(self, chunk: TokenChunk) -> list[ChoiceDelta]:
        """``echo``: completions' prompt (and its logprobs), or vLLM's chat echo (the final
        assistant message continued), opens every choice."""
        out = []
        for i in range(max(self.options.n, 1)):
            choice = self._choice(i)
            if choice.started:
                continue
            delta = ChoiceDelta(index=i, first=True)
            choice.started = True
            if self.options.echo:
                delta.content = self.options.echo
                choice.content.append(self.options.echo)
            if self.kind == "completion" and self.options.logprobs and chunk.prompt_logprobs is not None:
                delta.completion_logprobs = self._completion_logprobs(choice, chunk.prompt_logprobs)
            elif self.options.echo:
                choice.text_offset += len(self.options.echo)
            out.append(delta)
        return out

    def _advance(self, index: int, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                 finish: str | None, stop_reason: int | str | None = None) -> ChoiceDelta:
        choice = self._choice(index)
        delta = ChoiceDelta(index=index, first=not choice.started, token_ids=list(token_ids))
        choice.started = True
        content = text
        if choice.reasoning_stream is not None:
            reasoning, content = choice.reasoning_stream.feed(text, token_ids)
            if finish is not None:
                more_reasoning, more_content = choice.reasoning_stream.finish()
                reasoning += more_reasoning
                content += more_content
            delta.reasoning = reasoning
        if choice.tool_stream is not None:
            choice.tool_text.append(content)
            content, calls = choice.tool_stream.feed(content)
            delta.tool_calls.extend(calls)
            if finish is not None:
                more, calls = choice.tool_stream.finish()
                content += more
                delta.tool_calls.extend(calls)
        elif choice.forced is not None:
            choice.forced_text.append(content)
            delta.tool_calls.extend(choice.forced.feed(content))
            content = ""
        delta.tool_calls = merge_by_index(delta.tool_calls)
        delta.content = content
        delta.parsed = choice.reasoning_stream is not None or choice.tool_stream is not None or choice.forced is not None
        if logprobs is not None and self.options.logprobs:
            if self.kind == "chat":
                delta.chat_logprobs = [self._entry(lp) for lp in logprobs]
                choice.chat_logprobs.extend(delta.chat_logprobs)
            else:
                delta.completion_logprobs = self._completion_logprobs(choice, logprobs)
        self._record(choice, delta)
        if not self.options.parallel_tool_calls:
            # As vLLM: every call is parsed (and recorded), only the first is answered.
            delta.tool_calls = [call for call in delta.tool_calls if call.index == 0]
        if finish is not None:
            choice.engine_finish = finish
            delta.finish_reason = choice.finish_reason = self._finish_reason(choice, finish)
            delta.stop_reason = choice.stop_reason = stop_reason if finish == "stop" else None
            if choice.reasoning_stream is not None:
                self.reasoning_tokens += choice.reasoning_stream.reasoning_tokens
        return delta

    def _record(self, choice: _Choice, delta: ChoiceDelta) -> None:
        choice.tokens += len(delta.token_ids)
        if delta.content:
            choice.content.append(delta.content)
        if delta.reasoning:
            choice.reasoning.append(delta.reasoning)
        for call in delta.tool_calls:
            entry = choice.calls.setdefault(call.index, {"id": "", "name": "", "arguments": []})
            if isinstance(call.id, str):
                entry["id"] = call.id
            if isinstance(call.function.name, str):
                entry["name"] = call.function.name
            if call.function.arguments:
                entry["arguments"].append(call.function.arguments)

    def _finish_reason(self, choice: _Choice, finish: str) -> str:
        # As vLLM: calls found by the parser, or a forced "required" array, end as
        # "tool_calls"; a named function's forced call keeps the engine's reason.
        if finish == "stop" and choice.calls and self.options.tool_choice in ("auto", "required"):
            return "tool_calls"
        return finish

    def _entry(self, lp: TokenLogprob) -> LogprobEntry:
        k = self.options.top_logprobs
        return LogprobEntry(
            token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode("utf-8", errors="replace")),
            top_logprobs=[TopLogprobEntry(token=t.token, logprob=t.logprob,
                                          bytes=list(t.token.encode("utf-8", errors="replace"))) for t in lp.top[:k]],
        )

    def _completion_logprobs(self, choice: _Choice, logprobs: list[TokenLogprob] | list[TokenLogprob | None]
                             ) -> CompletionLogprobs:
        k = self.options.top_logprobs
        out = CompletionLogprobs()
        for lp in logprobs:
            out.text_offset.append(choice.text_offset)
            if lp is None:  # the prompt's first token: nothing precedes it
                out.tokens.append(self.options.echo_first_token)
                choice.text_offset += len(self.options.echo_first_token)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.tokens.append(lp.token)
            out.token_logprobs.append(lp.logprob)
            top = {t.token: t.logprob for t in lp.top[:k]}
            top.setdefault(lp.token, lp.logprob)  # vLLM lists the sampled token too
            out.top_logprobs.append(top)
            choice.text_offset += len(lp.token)
        total = choice.completion_logprobs
        total.text_offset.extend(out.text_offset)
        total.tokens.extend(out.tokens)
        total.token_logprobs.extend(out.token_logprobs)
        total.top_logprobs.extend(out.top_logprobs)
        return out

    # ---- usage ---------------------------------------------------------------------------
    def usage(self, usage: Usage) -> CompletionUsage:
        u = usage_from_proto(usage)
        if self.options.reasoning_parser:
            u.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens)
        return u

    # ---- streamed chunks -------------------------------------------------------------------
    def chunk_json(self, delta: ChoiceDelta) -> list[bytes]:
        """The streamed chunk(s) of one delta: ``chat.completion.chunk`` or ``text_completion``."""
        usage = self._usage_so_far(self._choices[delta.index].tokens)
        if self.kind != "chat":
            if not delta.has_output and delta.finish_reason is None and delta.completion_logprobs is None:
                return []
            choice = CompletionChoice(index=delta.index, text=delta.content, logprobs=delta.completion_logprobs,
                                      finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
            return [encode_json(TextCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                               usage=usage))]
        out = []
        logprobs = ChoiceLogprobs(content=delta.chat_logprobs) if delta.chat_logprobs is not None else None
        if delta.first:
            out.append(self._chat_chunk(ChatDelta(role="assistant", content=""), delta.index, None, None,
                                        self._usage_so_far(0)))
        if delta.reasoning or delta.content or delta.tool_calls or (
                delta.token_ids and delta.finish_reason is None and (not delta.parsed or delta.chat_logprobs)):
            # Tokens that render no text (special tokens, a UTF-8 sequence still incomplete)
            # still get an empty delta, as vLLM's server sends: the client sees progress.
            # Not text a parser holds back (a tool call being written): vLLM skips those,
            # unless they carry logprobs (vLLM loses them; we do not).
            out.append(self._chat_chunk(ChatDelta(
                content=delta.content if delta.content or not (delta.reasoning or delta.tool_calls) else None,
                reasoning_content=delta.reasoning or None, reasoning=delta.reasoning or None,
                tool_calls=delta.tool_calls or None,
            ), delta.index, logprobs, None, usage))
            logprobs = None
        if delta.finish_reason is not None:
            out.append(self._chat_chunk(ChatDelta(), delta.index, logprobs, delta.finish_reason, usage,
                                        delta.stop_reason))
        return out

    def _usage_so_far(self, completion_tokens: int) -> CompletionUsage | UnsetType | None:
        """A streamed chunk's ``usage``: absent without ``include_usage``; null until the
        last chunk, as OpenAI's; with vLLM's ``continuous_usage_stats``, the choice's tokens
        so far (as vLLM counts them)."""
        if not self.include_usage:
            return UNSET
        if not self.options.continuous_usage:
            return None
        prompt = self.options.prompt_tokens
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion_tokens,
                               total_tokens=prompt + completion_tokens)

    def _chat_chunk(self, delta: ChatDelta, index: int, logprobs: ChoiceLogprobs | None, finish: str | None,
                    usage: CompletionUsage | UnsetType | None, stop_reason: int | str | None = None) -> bytes:
        return encode_json(ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                     stop_reason=stop_reason if finish is not None else UNSET)],
            usage=usage,
        ))

    def usage_chunk(self, usage: Usage) -> bytes:
        """The extra last chunk of ``include_usage``: no choices, the request's usage."""
        if self.kind == "chat":
            return encode_json(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                                   usage=self.usage(usage)))
        return encode_json(TextCompletion(id=self.id, created=self.created, model=self.model, choices=[],
                                          usage=self.usage(usage)))

    def _forced_reply(self, c: _Choice) -> ForcedReply:
        o = self.options
        plan = ToolPlan(choice="named" if o.tool_choice == "function" else "required", function_name=o.tool_name or None)
        counter = iter(range(1 << 30))
        return forced_reply(plan, "".join(c.forced_text), c.engine_finish,
                            new_id=lambda: tool_call_id(self.request_id, c.index, next(counter),
                                                        mistral=o.mistral_call_ids))

    # ---- the whole response ------------------------------------------------------------------
    def response(self, usage: Usage | None) -> bytes:
        """The non-streamed response, once every chunk went through ``deltas``."""
        u = self.usage(usage) if usage is not None else None
        indices = range(max(self.options.n, 1))
        prompt_logprobs = self._prompt_logprobs if self._prompt_logprobs is not None else UNSET
        if self.kind != "chat":
            return encode_json(TextCompletion(id=self.id, created=self.created, model=self.model, usage=u, choices=[
                CompletionChoice(index=i, text="".join(c.content), finish_reason=c.finish_reason,
                                 stop_reason=c.stop_reason,
                                 logprobs=c.completion_logprobs if self.options.logprobs else None,
                                 prompt_logprobs=prompt_logprobs)
                for i in indices for c in [self._choice(i)]
            ]))
        choices = []
        for i in indices:
            c = self._choice(i)
            finish = c.finish_reason
            content: str | None = "".join(c.content)
            if c.forced is not None:
                # The whole output, as vLLM's server reads it: a required array counts only
                # when all of it is valid (one cut off by max_tokens yields no calls).
                reply = self._forced_reply(c)
                calls, finish = reply.tool_calls, reply.finish_reason
            else:
                calls = [ToolCall(id=e["id"], function=FunctionCall(name=e["name"], arguments="".join(e["arguments"])))
                         for _, e in sorted(c.calls.items())]
                if c.engine_finish == "stop" and calls and not all(_is_json(call.function.arguments)
                                                                   for call in calls):
                    # A malformed call in an output that ended by itself: vLLM's parsers
                    # answer the whole output as its text (a streamed answer has sent the
                    # calls as they came, as vLLM's; one cut off by max_tokens keeps its
                    # partial arguments, as OpenAI's).
                    content, calls = "".join(c.tool_text), []
                    finish = c.engine_finish or finish
                if not self.options.parallel_tool_calls:
                    calls = calls[:1]
            if calls and not content and self.options.tool_choice == "auto":
                content = None
            message = AssistantMessage(content=content, tool_calls=calls or UNSET)
            if self.options.reasoning_parser:
                message.reasoning_content = message.reasoning = "".join(c.reasoning) or None
            choices.append(ChatChoice(
                index=i, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                logprobs=ChoiceLogprobs(content=c.chat_logprobs) if self.options.logprobs else None,
            ))
        return encode_json(ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=u,
                                          prompt_logprobs=prompt_logprobs))


def merge_batch(responses: list[bytes], n: int) -> bytes:
    """One ``text_completion`` from the whole responses to a batch's prompts, in prompt
    order, as OpenAI answers a batch: prompt i's choice j at index ``i * n + j``, the usage
    summed; the id, created and model are the first response's."""
    merged: dict[str, Any] | None = None
    for i, body in enumerate(responses):
        response = json.loads(body)
        for choice in response["choices"]:
            choice["index"] += i * n
        if merged is None:
            merged = response
            continue
        merged["choices"].extend(response["choices"])
        _add_usage(merged, response.get("usage"))
    assert merged is not None, "a batch has prompts"
    merged["choices"].sort(key=lambda choice: choice["index"])
    return encode_json(merged)


def _add_usage(into: dict[str, Any], usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    total = into.setdefault("usage", {})
    for name, value in usage.items():
        if isinstance(value, dict):
            details = total.setdefault(name, {}) or {}
            total[name] = {k: details.get(k, 0) + v for k, v in value.items() if isinstance(v, int)}
        elif isinstance(value, int):
            total[name] = total.get(name, 0) + value
