"""OpenAI's Responses API (``/v1/responses``) as a translation over chat completions (pure).

A Responses request becomes a chat completions body (``plan_chat``), which goes down
the very path ``/v1/chat/completions`` takes (validation, chat template, admission,
router, worker, the reasoning and tool-call parsers); what comes back is translated:
the whole ``chat.completion`` into a Response object (``response_from_chat``), or each
streamed ``chat.completion.chunk`` into Responses' typed SSE events (``ResponseStream``).
So every chat feature (tools, structured output, logprobs, reasoning) serves Responses
too, and a chat validation error comes back naming the Responses field it came from
(``ChatPlan.api_error``).

Conversation state (``store`` + ``previous_response_id``) is the caller's: a stored
response keeps its conversation (input items, the previous ones included) and its
output; a continuation passes them as ``history``. Instructions never carry over, as
OpenAI documents.

Ids derive from the mesh request id (``resp_<rid>``, ``msg_<rid>_<n>``, ...), so the
streamed and the non-streamed translation of the same generation name the same items.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec
from msgspec import Struct

from .errors import ApiError, bad_request, clip, invalid_json

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
_REASONING_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh"}
_INPUT_ROLES = {"user", "assistant", "system", "developer"}
# vLLM's sampling extensions: the chat path takes them under the same names (and
# refuses or validates them there), so they pass through unchanged rather than being
# silently dropped.
PASSTHROUGH = ("seed", "top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
               "spaces_between_special_tokens", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


# --------------------------------------------------------------------------- request


class ResponsesRequest(Struct, kw_only=True):
    """The fields of a ``POST /v1/responses`` body that meshserve reads; other unknown
    fields are ignored (harmless ones such as ``service_tier``, ``safety_identifier``)."""

    model: str = ""
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    stream: bool | None = None
    truncation: str | None = None
    # Refused when set: each would change the output and meshserve does not do it.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: list[Any] | None = None
    moderation: Any = None


@dataclass(slots=True)
class ParsedRequest:
    request: ResponsesRequest
    passthrough: dict[str, Any]  # PASSTHROUGH fields present in the body

    @property
    def store(self) -> bool:
        return self.request.store is not False  # OpenAI's default: stored

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
# Chat completions fields clients send to /v1/responses by mistake: each would change the
# output, so each is a 400 naming the Responses field to use.
_CHAT_ONLY = {"messages": "'input'", "response_format": "'text.format'", "max_tokens": "'max_output_tokens'",
              "max_completion_tokens": "'max_output_tokens'", "n": "one output per response (send n requests)",
              "logprobs": "include ['message.output_text.logprobs'] and 'top_logprobs'"}


def _unsupported(param: str, message: str) -> NoReturn:
    raise bad_request(message, param, "unsupported_parameter")


def _invalid(param: str, message: str, code: str = "invalid_value") -> NoReturn:
    raise bad_request(f"Invalid '{param}': {message}", param, code)


def parse_responses_request(body: bytes | str) -> ParsedRequest:
    """Decode and check a ``/v1/responses`` body; ``ApiError`` 400 naming the field."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise invalid_json(str(exc)) from None
    except RecursionError:
        raise invalid_json("JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise invalid_json("the body is not a JSON object")
    try:
        req = msgspec.convert(raw, ResponsesRequest)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = _AT_PATH.search(text)
        param = at.group("path").lstrip(".") if at else None
        detail = text[: at.start()] if at else text
        raise bad_request(f"Invalid value for '{param}': {clip(detail)}." if param else f"Invalid request body: {clip(detail)}.",
                          param, "invalid_type") from None
    for name, instead in _CHAT_ONLY.items():
        if raw.get(name) is not None:  # a chat field would be ignored here: say what the Responses API calls it
            _unsupported(name, f"'{name}' is a chat completions field; the Responses API takes {instead}.")
    _check(req)
    return ParsedRequest(req, {k: raw[k] for k in PASSTHROUGH if raw.get(k) is not None})


def _check(req: ResponsesRequest) -> None:
    if req.input is None:
        raise bad_request("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    if req.background:
        _unsupported("background", "Background responses are not supported: send the request and read its answer.")
    if req.conversation is not None:
        _unsupported("conversation", "The Conversations API is not supported; use 'previous_response_id'.")
    if req.prompt is not None:
        _unsupported("prompt", "Prompt templates ('prompt') are not supported.")
    if req.max_tool_calls is not None:
        _unsupported("max_tool_calls", "max_tool_calls is not supported.")
    if req.context_management:
        _unsupported("context_management", "context_management (compaction) is not supported.")
    if req.moderation is not None:
        _unsupported("moderation", "moderation is not supported.")
    if req.truncation not in (None, "disabled"):
        _unsupported("truncation", "Only truncation 'disabled' is supported: a conversation that does not fit is a 400.")
    for name in req.include or []:
        if name != LOGPROBS_INCLUDE:
            _unsupported("include", f"include {clip(name)!r} is not supported; only {LOGPROBS_INCLUDE!r} is.")
    if req.previous_response_id is not None and not RESPONSE_ID.match(req.previous_response_id):
        _invalid("previous_response_id", f"{clip(req.previous_response_id)!r} is not a response id (resp_...).")
    if req.reasoning is not None:
        effort = req.reasoning.get("effort")
        if effort is not None and (not isinstance(effort, str) or effort not in _REASONING_EFFORTS):
            _invalid("reasoning.effort", f"{clip(str(effort))!r} is not one of {sorted(_REASONING_EFFORTS)}.")
        for name in ("summary", "generate_summary"):
            if req.reasoning.get(name) is not None:
                _unsupported(f"reasoning.{name}", "Reasoning summaries are not supported; the reasoning text comes as"
                                                  " a 'reasoning' output item.")
    if req.text is not None:
        verbosity = req.text.get("verbosity")
        if verbosity not in (None, "medium"):
            _unsupported("text.verbosity", "Only text.verbosity 'medium' is supported.")
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA_PAIRS:
            _invalid("metadata", f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed.")
        for k, v in req.metadata.items():
            if len(k) > MAX_METADATA_KEY:
                _invalid("metadata", f"keys are at most {MAX_METADATA_KEY} characters.")
            if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
                _invalid("metadata", f"values are strings of at most {MAX_METADATA_VALUE} characters.")
    for name in ("temperature", "top_p"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            _invalid(name, "must be a finite number.")


# --------------------------------------------------------------- request → chat body


def _text_of(parts: Any, param: str, kinds: tuple[str, ...]) -> str:
    """The text of a content string or list of text parts; anything else is a 400."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        _invalid(param, "must be a string or a list of content parts.", "invalid_type")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            _invalid(f"{param}[{j}]", "must be a content part object.", "invalid_type")
        kind = part.get("type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in kinds:
            raise bad_request(f"Content part type {clip(str(kind))!r} is not supported here: this model takes text"
                              f" ({', '.join(kinds)}).", f"{param}[{j}].type", "unsupported_value")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"Missing required parameter: '{param}[{j}].text'.", f"{param}[{j}].text",
                              "missing_required_parameter")
        texts.append(text)
    # The chat path joins text parts with newlines (as vLLM); the same here.
    return "\n".join(texts)


def _required_str(item: Mapping[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"Missing required parameter: '{param}.{name}'.", f"{param}.{name}", "missing_required_parameter")
    return value


def _messages_from_items(items: list[Any], params: list[str], messages: list[dict[str, Any]],
                         message_params: list[str]) -> None:
    """Append the chat messages of Responses input items (``params[i]`` names item i).

    As vLLM does, a reasoning item, an assistant message and function calls in a row
    make one assistant message (content, ``reasoning_content``, ``tool_calls``).
    """
    for item, param in zip(items, params, strict=True):
        if not isinstance(item, dict):
            _invalid(param, "must be an input item object.", "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        last = messages[-1] if messages else None
        assistant = last if last is not None and last["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _INPUT_ROLES:
                raise bad_request(f"Invalid value for '{param}.role': {clip(str(role))!r} is not supported; use user,"
                                  " assistant, system or developer.", f"{param}.role", "unsupported_value")
            if "content" not in item:
                raise bad_request(f"Missing required parameter: '{param}.content'.", f"{param}.content",
                                  "missing_required_parameter")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            text = _text_of(item["content"], f"{param}.content", (*kinds, "text"))
            if role == "assistant" and assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                continue
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _required_str(item, "call_id", param), "type": "function",
                    "function": {"name": _required_str(item, "name", param),
                                 "arguments": _required_str(item, "arguments", param)}}
            if assistant is not None:
                assistant.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if output is None:
                raise bad_request(f"Missing required parameter: '{param}.output'.", f"{param}.output",
                                  "missing_required_parameter")
            messages.append({"role": "tool", "tool_call_id": _required_str(item, "call_id", param),
                             "content": _text_of(output, f"{param}.output", ("input_text", "output_text", "text"))})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                _unsupported(f"{param}.encrypted_content", "Encrypted reasoning is not supported.")
            reasoning = ""
            if item.get("content"):
                reasoning = _text_of(item["content"], f"{param}.content", ("reasoning_text",))
            elif item.get("summary"):  # as vLLM: the summary when there is no content
                reasoning = _text_of(item["summary"], f"{param}.summary", ("summary_text",))
            if assistant is not None and assistant.get("reasoning_content") is None:
                assistant["reasoning_content"] = reasoning
                continue
            messages.append({"role": "assistant", "content": None, "reasoning_content": reasoning})
        else:
            raise bad_request(f"Input item type {clip(str(kind))!r} is not supported; use message, function_call,"
                              " function_call_output or reasoning.", f"{param}.type", "unsupported_value")
        message_params.append(param)


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools → chat's nested ``{"type", "function": {...}}``."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"Tool type {clip(str(tool.get('type')))!r} is not supported: meshserve runs function"
                              " tools only.", f"tools[{i}].type", "unsupported_value")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        if "name" not in function:
            raise bad_request(f"Missing required parameter: 'tools[{i}].name'.", f"tools[{i}].name",
                              "missing_required_parameter")
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any], tools: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """(chat tool_choice, the tools the model may call)."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            _invalid("tool_choice", f"{clip(choice)!r} is not one of 'none', 'auto', 'required'.")
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("Missing required parameter: 'tool_choice.name'.", "tool_choice.name",
                              "missing_required_parameter")
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode = choice.get("mode")
        allowed = choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            _invalid("tool_choice", "allowed_tools needs 'mode' (auto or required) and a list of 'tools'.")
        names = [t["name"] for t in allowed
                 if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)]
        if len(names) != len(allowed):
            _unsupported("tool_choice.tools", "allowed_tools may name function tools only ({type: function, name}).")
        # Only the allowed tools are offered: the model cannot call the others.
        return mode, [t for t in tools if isinstance(t.get("name"), str) and t["name"] in names]
    raise bad_request(f"tool_choice type {clip(str(kind))!r} is not supported: use none, auto, required, a function"
                      " or allowed_tools.", "tool_choice.type", "unsupported_value")


def _chat_response_format(fmt: Any) -> dict[str, Any] | None:
    """``text.format`` → chat ``response_format`` (None: plain text)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        _invalid("text.format", "must be an object.", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format type {clip(str(kind))!r} is not supported: use text, json_object or json_schema.",
                      "text.format.type", "unsupported_value")


# Chat parameters whose Responses name differs (error params are mapped back).
_CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "session_id": "prompt_cache_key", "reasoning_effort": "reasoning.effort", "logprobs": "include"}
_INDEXED = re.compile(r"^(?P<name>messages|tools)\[(?P<i>\d+)\](?P<rest>.*)$")


@dataclass(slots=True)
class ChatPlan:
    """A Responses request as a chat completions body, and what maps the answer back."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # history + this request's input items: what a continuation prepends
    message_params: list[str]  # per chat message: the Responses field it came from
    tools: list[dict[str, Any]]  # the Responses tools, echoed in the Response
    tool_choice: Any
    text_format: dict[str, Any]
    logprobs: bool
    tool_params: list[str] = field(default_factory=list)  # per chat tool: the Responses field

    def api_error(self, exc: ApiError) -> ApiError:
        """A chat validation error, its ``param`` renamed to the Responses field."""
        param = exc.param
        if param is None:
            return exc
        indexed = _INDEXED.match(param)
        if indexed:
            i = int(indexed["i"])
            names = self.message_params if indexed["name"] == "messages" else self.tool_params
            rest = indexed["rest"].replace(".function.", ".", 1) if indexed["name"] == "tools" else ""
            param = (names[i] + rest) if i < len(names) else ("input" if indexed["name"] == "messages" else "tools")
        elif param == "messages":
            param = "input"
        elif param.startswith("response_format"):
            param = "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
        else:
            param = _CHAT_PARAMS.get(param, param)
        return ApiError(exc.status, exc.message, exc.type, param, exc.code, exc.retry_after)


def plan_chat(parsed: ParsedRequest, history: list[dict[str, Any]] | None = None) -> ChatPlan:
    """The chat completions body of a Responses request; ``history``: the stored
    conversation and output of ``previous_response_id``. ApiError 400 naming the field."""
    req = parsed.request
    messages: list[dict[str, Any]] = []
    message_params: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        message_params.append("instructions")
    past = list(history or [])
    _messages_from_items(past, ["previous_response_id"] * len(past), messages, message_params)
    assert req.input is not None  # _check
    if isinstance(req.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": req.input}]
        params = ["input"]
    else:
        items = req.input
        params = [f"input[{i}]" for i in range(len(items))]
    _messages_from_items(items, params, messages, message_params)

    body: dict[str, Any] = {"model": req.model, "messages": messages, **parsed.passthrough}
    tools = req.tools or []
    tool_choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
    offered = tools
    if req.tool_choice is not None:
        body["tool_choice"], offered = _chat_tool_choice(req.tool_choice, tools)
    tool_params = [f"tools[{tools.index(t)}]" for t in offered]
    if offered:
        body["tools"] = _chat_tools(offered)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = (req.text or {}).get("format")
    response_format = _chat_response_format(fmt)
    if response_format is not None:
        body["response_format"] = response_format
    logprobs = LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)
    if logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    for name in ("temperature", "top_p", "user", "metadata"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.prompt_cache_key is not None:
        body["session_id"] = req.prompt_cache_key  # the same intent: requests that share it share a replica's cache
    if parsed.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return ChatPlan(body=body, conversation=past + items, message_params=message_params, tools=tools,
                    tool_choice=tool_choice, text_format=fmt if isinstance(fmt, dict) else {"type": "text"},
                    logprobs=logprobs, tool_params=tool_params)


# ------------------------------------------------------------- chat → Response object


@dataclass(slots=True)
class ResponseContext:
    """What a Response object echoes of its request, and its ids."""

    request_id: str  # the mesh request id: every id derives from it
    created_at: int
    model: str
    plan: ChatPlan
    request: ResponsesRequest
    temperature: float | None = None  # the sampling the chat path resolved
    top_p: float | None = None
    store: bool = True

    @property
    def response_id(self) -> str:
        return f"resp_{self.request_id}"

    def item_id(self, prefix: str, output_index: int) -> str:
        return f"{prefix}_{self.request_id}_{output_index}"

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, *,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        req = self.request
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": self.store, "temperature": self.temperature,
            "text": {"format": self.plan.text_format, "verbosity": "medium"},
            "tool_choice": self.plan.tool_choice, "tools": self.plan.tools,
            "top_logprobs": req.top_logprobs, "top_p": self.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }


def usage_from_chat(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage → Responses usage (input/output tokens and their details)."""
    if not usage:
        return None
    prompt = usage.get("prompt_tokens", 0)
    completion = usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        # cache_write_tokens counts OpenAI's explicit prompt-cache writes: none here.
        "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                 "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
        "total_tokens": usage.get("total_tokens", prompt + completion),
    }


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """(response status, incomplete reason) of a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "content_filter":
        return "incomplete", "content_filter"
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def _logprobs(entries: list[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat logprob entries → Responses ``output_text`` logprobs (the same fields). As in
    vLLM's Responses server, a message's logprobs are those of every generated token
    (reasoning and tool-call tokens included): the chat path reports them per choice."""
    return [{"token": e.get("token", ""), "bytes": e.get("bytes") or [], "logprob": e.get("logprob", 0.0),
             "top_logprobs": [{"token": t.get("token", ""), "bytes": t.get("bytes") or [], "logprob": t.get("logprob", 0.0)}
                              for t in e.get("top_logprobs") or []]}
            for e in entries or []]


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_from_chat(completion: Mapping[str, Any], ctx: ResponseContext) -> dict[str, Any]:
    """The Response object of a whole ``chat.completion`` (its first choice)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status, incomplete = _status(choice.get("finish_reason"))
    item_status = "completed" if status == "completed" else "incomplete"
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        output.append(_reasoning_item(ctx.item_id("rs", len(output)), reasoning, item_status))
    if message.get("content"):
        logprobs = _logprobs((choice.get("logprobs") or {}).get("content")) if ctx.plan.logprobs else []
        output.append(_message_item(ctx.item_id("msg", len(output)), [_text_part(message["content"], logprobs)],
                                    item_status))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        index = len(output)
        output.append(_call_item(ctx.item_id("fc", index), call.get("id") or f"call_{ctx.request_id}_{index}",
                                 function.get("name", ""), function.get("arguments", ""), "completed"))
    return ctx.response(status, output, usage_from_chat(completion.get("usage")), incomplete=incomplete)


# ---------------------------------------------------------- chat chunks → SSE events

_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class _Open:
    """The output item being streamed."""

    kind: str  # "reasoning", "message" or "function_call"
    index: int  # output_index
    item_id: str
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_index: int = -1  # the chat tool call index (function_call)
    call_id: str = ""
    name: str = ""


class ResponseStream:
    """Chat chunk dicts in, Responses SSE frames out (``event: <type>`` + ``data``).

    ``start()`` once (``response.created``, ``response.in_progress``); ``feed(chunk)``
    per ``chat.completion.chunk`` (the usage chunk included); then ``finish()`` at the
    chat stream's end, or ``fail(error)`` for its error event. After either,
    ``response`` is the final Response object (store it, then send ``final()``, its
    last event) and further input yields nothing. Each event carries its
    ``sequence_number``.
    """

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # closed items
        self.open: _Open | None = None
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.response: dict[str, Any] | None = None
        self._final_sent = False
        # Logprobs not sent yet: those of reasoning or tool-call tokens ride the next text
        # delta, so the message's logprobs cover every generated token as in the whole response.
        self.pending_logprobs: list[dict[str, Any]] = []

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = _encoder.encode({"type": kind, "sequence_number": self.sequence, **payload})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self) -> bytes:
        in_progress = self.ctx.response("in_progress", [], None)
        return (self._event("response.created", {"response": in_progress})
                + self._event("response.in_progress", {"response": in_progress}))

    # ---- items --------------------------------------------------------------------------
    def _next_index(self) -> int:
        return len(self.output)

    def _open_item(self, kind: str, *, call: Mapping[str, Any] | None = None) -> list[bytes]:
        index = self._next_index()
        if kind == "reasoning":
            item = _Open(kind, index, self.ctx.item_id("rs", index))
            return [self._event("response.output_item.added", {"output_index": index, "item": {
                        "id": item.item_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}}),
                    self._set_open(item, self._event("response.content_part.added", {
                        "item_id": item.item_id, "output_index": index, "content_index": 0,
                        "part": {"type": "reasoning_text", "text": ""}}))]
        if kind == "message":
            item = _Open(kind, index, self.ctx.item_id("msg", index))
            return [self._event("response.output_item.added", {"output_index": index, "item": _message_item(
                        item.item_id, [], "in_progress")}),
                    self._set_open(item, self._event("response.content_part.added", {
                        "item_id": item.item_id, "output_index": index, "content_index": 0, "part": _text_part("", [])}))]
        assert call is not None
        function = call.get("function") or {}
        item = _Open(kind, index, self.ctx.item_id("fc", index), call_index=call.get("index", 0),
                     call_id=call.get("id") or f"call_{self.ctx.request_id}_{index}", name=function.get("name") or "")
        return [self._set_open(item, self._event("response.output_item.added", {"output_index": index, "item": _call_item(
            item.item_id, item.call_id, item.name, "", "in_progress")}))]

    def _set_open(self, item: _Open, frame: bytes) -> bytes:
        self.open = item
        return frame

    def _close(self, status: str) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        self.open = None
        text = "".join(item.text)
        common = {"item_id": item.item_id, "output_index": item.index}
        if item.kind == "reasoning":
            done = _reasoning_item(item.item_id, text, status)
            frames = [self._event("response.reasoning_text.done", {**common, "content_index": 0, "text": text}),
                      self._event("response.content_part.done", {**common, "content_index": 0,
                                                                 "part": {"type": "reasoning_text", "text": text}})]
        elif item.kind == "message":
            item.logprobs += self.pending_logprobs  # e.g. the end-of-sequence token's, on the finish chunk
            self.pending_logprobs = []
            part = _text_part(text, item.logprobs)
            done = _message_item(item.item_id, [part], status)
            frames = [self._event("response.output_text.done", {**common, "content_index": 0, "text": text,
                                                               "logprobs": item.logprobs}),
                      self._event("response.content_part.done", {**common, "content_index": 0, "part": part})]
        else:
            done = _call_item(item.item_id, item.call_id, item.name, text, "completed")
            frames = [self._event("response.function_call_arguments.done", {**common, "name": item.name,
                                                                            "arguments": text})]
        self.output.append(done)
        frames.append(self._event("response.output_item.done", {"output_index": item.index, "item": done}))
        return frames

    def _switch(self, kind: str, *, call_index: int = -1) -> list[bytes]:
        """Close the open item unless it is ``kind`` (and that tool call)."""
        if self.open is not None and self.open.kind == kind and self.open.call_index == call_index:
            return []
        return self._close("completed")

    # ---- input --------------------------------------------------------------------------
    def feed(self, chunk: Mapping[str, Any]) -> bytes:
        """The events of one ``chat.completion.chunk`` (a usage-only chunk gives none)."""
        if self.response is not None:
            return b""
        if chunk.get("usage"):
            self.usage = usage_from_chat(chunk["usage"])
        frames: list[bytes] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # Responses has one choice
            delta = choice.get("delta") or {}
            if self.ctx.plan.logprobs:
                self.pending_logprobs += _logprobs((choice.get("logprobs") or {}).get("content"))
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                frames += self._switch("reasoning")
                if self.open is None:
                    frames += self._open_item("reasoning")
                assert self.open is not None
                self.open.text.append(reasoning)
                frames.append(self._event("response.reasoning_text.delta", {
                    "item_id": self.open.item_id, "output_index": self.open.index, "content_index": 0, "delta": reasoning}))
            content = delta.get("content")
            if content:
                frames += self._switch("message")
                if self.open is None:
                    frames += self._open_item("message")
                assert self.open is not None
                logprobs, self.pending_logprobs = self.pending_logprobs, []
                self.open.text.append(content)
                self.open.logprobs += logprobs
                frames.append(self._event("response.output_text.delta", {
                    "item_id": self.open.item_id, "output_index": self.open.index, "content_index": 0, "delta": content,
                    "logprobs": logprobs}))
            for call in delta.get("tool_calls") or []:
                frames += self._switch("function_call", call_index=call.get("index", 0))
                if self.open is None:
                    frames += self._open_item("function_call", call=call)
                assert self.open is not None
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    self.open.text.append(arguments)
                    frames.append(self._event("response.function_call_arguments.delta", {
                        "item_id": self.open.item_id, "output_index": self.open.index, "delta": arguments}))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(frames)

    def finish(self) -> bytes:
        """The chat stream ended: close the open item; ``response`` is final (then ``final()``)."""
        if self.response is not None:
            return b""
        status, incomplete = _status(self.finish_reason)
        frames = self._close("completed" if status == "completed" else "incomplete")
        messages = [item for item in self.output if item["type"] == "message"]
        if messages and self.pending_logprobs:  # tokens after the message closed (a tool call's)
            messages[-1]["content"][0]["logprobs"] = messages[-1]["content"][0]["logprobs"] + self.pending_logprobs
        self.response = self.ctx.response(status, self.output, self.usage, incomplete=incomplete)
        return b"".join(frames)

    def fail(self, error: Mapping[str, Any]) -> bytes:
        """The chat stream's error event (``{"message", "type", "param", "code"}``): the
        response failed, with what was generated so far (then ``final()``)."""
        if self.response is not None:
            return b""
        frames = self._close("incomplete")
        code = error.get("code") if error.get("code") == "rate_limit_exceeded" else "server_error"
        self.response = self.ctx.response("failed", self.output, self.usage,
                                          error={"code": code, "message": str(error.get("message", ""))})
        return b"".join(frames)

    def final(self) -> bytes:
        """The last event, of the final ``response``: ``response.completed``, or
        ``response.incomplete`` (it hit ``max_output_tokens``), or ``response.failed``."""
        assert self.response is not None, "finish() or fail() first"
        if self._final_sent:
            return b""
        self._final_sent = True
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            self.response["status"], "response.failed")
        return self._event(kind, {"response": self.response})


def stored_history(conversation: list[dict[str, Any]], response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What a continuation of a stored response prepends: its conversation, then its output."""
    return [*conversation, *(response.get("output") or [])]
