"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) as a
translation over chat completions (pure), as vLLM's and Dynamo's front ends serve it.

Clients written for Anthropic's API (its SDKs; agents pointed at ``ANTHROPIC_BASE_URL``)
take the path ``/v1/chat/completions`` takes: a Messages body becomes a chat completions
body (``plan_messages``), which goes through validation, the chat template, admission,
the router, a worker and the reasoning and tool-call parsers; what comes back is
translated, the whole ``chat.completion`` into a Message (``message_from_chat``), each
streamed ``chat.completion.chunk`` into the Messages API's SSE events
(``MessageStream``). Errors leave in Anthropic's shape (``anthropic_error_body``), the
field named as Anthropic names it (``messages.2.content.0.text: ...``). This module is
the request side; :mod:`.anthropic_output` the answer's.

Conversation blocks map as vLLM's ``/v1/messages`` maps them, so the two render the
same prompt: ``system`` text blocks are joined (Claude Code's per-request
``x-anthropic-billing-header`` block is dropped: it would defeat prefix caching),
``thinking`` blocks become the assistant's ``reasoning`` (which the template gets),
``tool_use`` blocks its
``tool_calls``, and each ``tool_result`` a ``tool`` message ahead of the rest of its user
message. What meshserve does not do is a 400 naming the field, never a silent drop:
images and documents (text models), server tools (web search, code execution, ...),
``thinking`` with a token budget (``enabled``: the engine would have to end the thinking
at the budget; vLLM's server refuses it too unless started with a reasoning config),
MCP servers, containers, context management. ``thinking`` ``adaptive`` is the model's own
thinking; ``disabled`` turns it off where the chat template can (``enable_thinking``).
``cache_control`` is accepted anywhere and changes nothing: every prefix is cached, and
``usage.cache_read_input_tokens`` says how much of the prompt was.

Where it departs from vLLM's ``/v1/messages`` on purpose: ``output_config.effort`` ``max``
is ``xhigh`` (the chat path's highest effort; vLLM passes ``max`` on); ``thinking``
``disabled`` sets the template's ``enable_thinking`` false (the chat path's way; vLLM
probes the template for a ``reasoning_effort`` that turns thinking off); an inline system
message stays where it is (vLLM moves it into the leading system prompt when the
template insists on one first, which here is that template's 400); deferred tools,
``tool_reference`` blocks and ``context_management`` are 400s.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from msgspec import Struct

from .chat_request import BILLING_HEADER
from .errors import ApiError, bad_request, clip
from .normalized import decode_object
from .responses_api import PASSTHROUGH as SAMPLING_PASSTHROUGH

ANTHROPIC_PATH = "/v1/messages"  # and what follows it: the routes answering Anthropic's errors
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
_SERVICE_TIERS = ("auto", "standard_only")
# vLLM's extensions of its Messages request, and the sampling extensions the Responses API
# passes on too (seed, guided decoding, ...; not ``stop``: here it is ``stop_sequences``):
# the chat path takes them under the same names, and refuses by name what it does not serve.
PASSTHROUGH = ("cache_salt", "chat_template_kwargs", "watermarking", "kv_transfer_params", "ec_transfer_params",
               "vllm_xargs", *(name for name in SAMPLING_PASSTHROUGH if name not in ("stop", "top_k")))


class MessagesRequest(Struct, kw_only=True):
    """The fields of a ``POST /v1/messages`` body that meshserve reads; unknown ones are
    ignored (as vLLM's server ignores them: SDK betas add fields)."""

    model: Any = None
    messages: Any = None
    max_tokens: Any = None  # required on /v1/messages: checked here, bounded by the chat path
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format
    service_tier: str | None = None
    cache_control: Any = None  # automatic prompt caching: every prefix is cached anyway
    # Refused when set: each would change the answer and meshserve does not do it.
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


def _unsupported(param: str, message: str) -> NoReturn:
    raise bad_request(message, param, "unsupported_parameter")


def _invalid(param: str, message: str, code: str = "invalid_value") -> NoReturn:
    raise bad_request(message, param, code)


def _missing(param: str) -> NoReturn:
    raise bad_request("Field required.", param, "missing_required_parameter")


def parse_messages_request(body: bytes | str, *, count_only: bool = False) -> tuple[MessagesRequest, dict[str, Any]]:
    """Decode and check a ``/v1/messages`` body (``count_only``: a ``count_tokens`` body,
    which has no ``max_tokens``). Returns the request and its PASSTHROUGH fields present;
    ``ApiError`` 400 naming the field."""
    raw, req = decode_object(body, MessagesRequest)
    if not isinstance(req.model, str) or not req.model:
        _missing("model") if req.model is None else _invalid("model", "Input should be a non-empty string.", "invalid_type")
    if not isinstance(req.messages, list):
        _missing("messages") if req.messages is None else _invalid("messages", "Input should be a valid list.",
                                                                   "invalid_type")
    if not count_only:
        if req.max_tokens is None:
            _missing("max_tokens")
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int):
            _invalid("max_tokens", "Input should be a valid integer.", "invalid_type")
    for name, value in (("container", req.container), ("mcp_servers", req.mcp_servers),
                        ("context_management", req.context_management)):
        if value is not None:
            _unsupported(name, f"{name} is not supported by this server.")
    if req.service_tier is not None and req.service_tier not in _SERVICE_TIERS:
        _invalid("service_tier", f"Input should be 'auto' or 'standard_only', got {clip(req.service_tier)!r}.")
    for name in ("temperature", "top_p"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            _invalid(name, "Input should be a finite number.")
    if req.metadata is not None and not isinstance(req.metadata.get("user_id", ""), str | None):
        _invalid("metadata.user_id", "Input should be a valid string.", "invalid_type")
    return req, {k: raw[k] for k in PASSTHROUGH if raw.get(k) is not None}


# --------------------------------------------------------------- request → chat body


def _block(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        _invalid(param, "Input should be a content block object.", "invalid_type")
    return value


def _string(block: Mapping[str, Any], name: str, param: str) -> str:
    value = block.get(name)
    if value is None:
        _missing(f"{param}.{name}")
    if not isinstance(value, str):
        _invalid(f"{param}.{name}", "Input should be a valid string.", "invalid_type")
    return value


def _not_text(kind: Any, param: str) -> NoReturn:
    if kind in ("image", "document", "search_result", "container_upload"):
        _unsupported(f"{param}.type", f"Content blocks of type {kind!r} are not supported: this server's models"
                                      " take text.")
    _invalid(f"{param}.type", f"Content block type {clip(str(kind))!r} is not supported here.")


def _system_text(content: Any, param: str, *, inline: bool = False) -> str:
    """A system prompt's text (blocks joined as vLLM joins them), less Claude Code's
    attribution header: a block holding it is dropped, and so is an inline system message
    that opens with it (vLLM's /v1/messages); the chat path drops the line from the rest."""
    if isinstance(content, str):
        return "" if inline and content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        _invalid(param, "Input should be a string or a list of text blocks.", "invalid_type")
    parts = []
    for j, value in enumerate(content):
        block = _block(value, f"{param}[{j}]")
        if block.get("type") != "text":
            _not_text(block.get("type"), f"{param}[{j}]")
        text = _string(block, "text", f"{param}[{j}]")
        if text and not text.startswith(BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def _tool_result_text(block: Mapping[str, Any], param: str) -> str:
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _invalid(f"{param}.content", "Input should be a string or a list of content blocks.", "invalid_type")
    texts = []
    for j, value in enumerate(content):
        part = _block(value, f"{param}.content[{j}]")
        if part.get("type") != "text":
            _not_text(part.get("type"), f"{param}.content[{j}]")
        texts.append(_string(part, "text", f"{param}.content[{j}]"))
    return "\n".join(texts)


def _convert_messages(messages: list[Any], out: list[dict[str, Any]], params: list[str]) -> None:
    """Append the chat messages of Anthropic ``messages`` (``params``: each one's field)."""
    for i, value in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(value, dict):
            _invalid(param, "Input should be a message object.", "invalid_type")
        role = value.get("role")
        if role not in ("user", "assistant", "system"):
            _invalid(f"{param}.role", f"Input should be 'user' or 'assistant', got {clip(str(role))!r}.")
        if "content" not in value:
            _missing(f"{param}.content")
        content = value["content"]
        if role == "system":  # not Anthropic's, but vLLM takes them in place (Claude Code's reminders)
            text = _system_text(content, f"{param}.content", inline=True)
            if text:
                out.append({"role": "system", "content": text})
                params.append(param)
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            params.append(param)
            continue
        if not isinstance(content, list):
            _invalid(f"{param}.content", "Input should be a string or a list of content blocks.", "invalid_type")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, raw_block in enumerate(content):
            bparam = f"{param}.content[{j}]"
            block = _block(raw_block, bparam)
            kind = block.get("type")
            if kind == "text":
                text = _string(block, "text", bparam)
                if text:
                    texts.append(text)
            elif kind == "thinking":
                reasoning.append(_string(block, "thinking", bparam))
            elif kind == "redacted_thinking":
                continue  # opaque (another provider's); accepted as clients hand whole turns back
            elif kind == "tool_use":
                if role != "assistant":
                    _invalid(f"{bparam}.type", "tool_use blocks belong in assistant messages.")
                arguments = block.get("input") or {}
                if not isinstance(arguments, dict):
                    _invalid(f"{bparam}.input", "Input should be a valid dictionary.", "invalid_type")
                calls.append({"id": _string(block, "id", bparam), "type": "function",
                              "function": {"name": _string(block, "name", bparam), "arguments": json.dumps(arguments)}})
            elif kind == "tool_result":
                if role != "user":
                    _invalid(f"{bparam}.type", "tool_result blocks belong in user messages.")
                # Each result a tool message of its own, ahead of the rest of the user's turn (vLLM's order).
                out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", bparam),
                            "content": _tool_result_text(block, bparam)})
                params.append(bparam)
            else:
                _not_text(kind, bparam)
        message: dict[str, Any] = {"role": role}
        if texts:
            message["content"] = "\n".join(texts)  # the chat path joins text parts so (vLLM's)
        if reasoning:
            message["reasoning"] = "".join(reasoning)  # rendered for templates that show it (vLLM's field)
        if calls:
            message["tool_calls"] = calls
        if role == "user" and "content" not in message:
            continue  # only tool results, already out
        out.append(message)
        params.append(param)


def _chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, value in enumerate(tools):
        param = f"tools[{i}]"
        tool = _block(value, param)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            _unsupported(f"{param}.type", f"Tool type {clip(str(kind))!r} is not supported: this server runs the"
                                          " client's own tools only (no server tools).")
        name = _string(tool, "name", param)
        schema = tool.get("input_schema")
        if schema is None:
            _missing(f"{param}.input_schema")
        if not isinstance(schema, dict):
            _invalid(f"{param}.input_schema", "Input should be a valid dictionary.", "invalid_type")
        if tool.get("defer_loading"):
            _unsupported(f"{param}.defer_loading", "Deferred tools (tool search) are not supported: every tool is"
                                                   " rendered into the prompt.")
        # The client's key order kept (the template renders it as given); type last when missing, as vLLM.
        function: dict[str, Any] = {"name": name, "parameters": {**schema, "type": schema.get("type", "object")}}
        if tool.get("description") is not None:
            function["description"] = _string(tool, "description", param)
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Mapping[str, Any]) -> Any:
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        name = choice.get("name")
        if name is None:
            _missing("tool_choice.name")
        if not isinstance(name, str) or not name:
            _invalid("tool_choice.name", "Input should be a non-empty string.", "invalid_type")
        return {"type": "function", "function": {"name": name}}
    _invalid("tool_choice.type", f"Input should be 'auto', 'any', 'tool' or 'none', got {clip(str(kind))!r}.")


# Chat parameters whose Messages name differs (error params are mapped back).
_CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata.user_id",
                "reasoning_effort": "output_config.effort", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
_INDEXED = re.compile(r"^(?P<name>messages|tools)\[(?P<i>\d+)\](?P<rest>.*)$")
# The chat path's context-length errors (normalized._resolve_max_tokens), and Anthropic's
# words for them: Claude Code reads these to compact a conversation or lower max_tokens.
_OVER_WITH_OUTPUT = re.compile(r"maximum context length is (?P<n>\d+) tokens\. However, you requested \d+ tokens"
                               r" \((?P<prompt>\d+) in the messages, (?P<out>\d+) in the completion\)")
_OVER_PROMPT = re.compile(r"maximum context length is (?P<n>\d+) tokens\. However, your messages resulted in"
                          r" (?P<prompt>\d+) tokens")


def _context_error(exc: ApiError) -> ApiError | None:
    over = _OVER_WITH_OUTPUT.search(exc.message)
    if over:
        message = (f"input length and `max_tokens` exceed context limit: {over['prompt']} + {over['out']} >"
                   f" {over['n']}, decrease input length or `max_tokens` and try again")
        return ApiError(exc.status, message, exc.type, None, exc.code)
    over = _OVER_PROMPT.search(exc.message)
    if over:
        return ApiError(exc.status, f"prompt is too long: {over['prompt']} tokens > {over['n']} maximum", exc.type,
                        None, exc.code)
    return None


@dataclass(slots=True)
class MessagesPlan:
    """A Messages request as a chat completions body, and what maps errors back."""

    body: dict[str, Any]
    message_params: list[str]  # per chat message: the Messages field it came from
    stream: bool
    format_param: str = "output_config.format"

    def api_error(self, exc: ApiError) -> ApiError:
        """A chat validation error, its ``param`` renamed to the Messages field."""
        if exc.code == "context_length_exceeded":
            said = _context_error(exc)
            if said is not None:
                return said
        param = exc.param
        if param is None:
            return exc
        indexed = _INDEXED.match(param)
        if indexed:
            i = int(indexed["i"])
            if indexed["name"] == "messages":
                param = self.message_params[i] if i < len(self.message_params) else "messages"
            else:
                param = f"tools[{i}]" + indexed["rest"].replace(".function.parameters", ".input_schema", 1).replace(
                    ".function", "", 1)
        elif param.startswith("response_format"):
            param = self.format_param
        elif param.startswith("tool_choice.function"):
            param = "tool_choice" + param[len("tool_choice.function"):]
        elif param in _CHAT_PARAMS:
            param = _CHAT_PARAMS[param]
        message = exc.message.replace(f"'{exc.param}'", f"'{param}'") if param != exc.param else exc.message
        return ApiError(exc.status, message, exc.type, param, exc.code, exc.retry_after)


def plan_messages(req: MessagesRequest, passthrough: Mapping[str, Any]) -> MessagesPlan:
    """The chat completions body of a Messages request. ApiError 400 naming the field."""
    messages: list[dict[str, Any]] = []
    params: list[str] = []
    if req.system is not None:
        system = _system_text(req.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
            params.append("system")
    assert isinstance(req.messages, list)  # parse_messages_request
    _convert_messages(req.messages, messages, params)
    body: dict[str, Any] = {"model": req.model, "messages": messages, **passthrough}
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.metadata and req.metadata.get("user_id"):
        body["user"] = req.metadata["user_id"]
    if req.tools:
        body["tools"] = _chat_tools(req.tools)
    if req.tool_choice is not None:
        choice = _chat_tool_choice(req.tool_choice)
        if req.tools or choice not in ("auto", "none"):  # chat refuses a choice without tools
            body["tool_choice"] = choice
        disable = req.tool_choice.get("disable_parallel_tool_use")
        if disable is not None:
            if not isinstance(disable, bool):
                _invalid("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean.", "invalid_type")
            body["parallel_tool_calls"] = not disable
    _thinking(req, body)
    format_param = _output_format(req, body)
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # message_delta carries the usage
    return MessagesPlan(body=body, message_params=params, stream=bool(req.stream), format_param=format_param)


def _thinking(req: MessagesRequest, body: dict[str, Any]) -> None:
    thinking = req.thinking
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int):
            _invalid("thinking.budget_tokens", "Input should be a valid integer.", "invalid_type")
        _unsupported("thinking.type", "Thinking with a token budget ('enabled') is not supported: this server cannot"
                                      " end a model's thinking at a budget. Send {\"type\": \"adaptive\"} (the model"
                                      " thinks as it does, within max_tokens) or {\"type\": \"disabled\"}.")
    if kind == "disabled":
        given = body.get("chat_template_kwargs") or {}
        if not isinstance(given, dict):
            _invalid("chat_template_kwargs", "Input should be a valid dictionary.", "invalid_type")
        kwargs = dict(given)
        kwargs.setdefault("enable_thinking", False)  # Qwen-style templates; the parser then reads no thinking
        body["chat_template_kwargs"] = kwargs
    elif kind != "adaptive":
        _invalid("thinking.type", f"Input should be 'enabled', 'disabled' or 'adaptive', got {clip(str(kind))!r}.")


def _output_format(req: MessagesRequest, body: dict[str, Any]) -> str:
    """Set ``response_format`` and ``reasoning_effort`` from ``output_config`` (or the
    beta's ``output_format``); returns the field a format error names."""
    config = req.output_config or {}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORTS:
            _invalid("output_config.effort", f"Input should be one of {', '.join(map(repr, _EFFORTS))}.")
        body["reasoning_effort"] = _EFFORTS[effort]
    fmt, param = config.get("format"), "output_config.format"
    if fmt is None and req.output_format is not None:
        fmt, param = req.output_format, "output_format"
    if fmt is None:
        return param
    if not isinstance(fmt, dict):
        _invalid(param, "Input should be a valid dictionary.", "invalid_type")
    if fmt.get("type") != "json_schema":
        _invalid(f"{param}.type", f"Input should be 'json_schema', got {clip(str(fmt.get('type')))!r}.")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        _missing(f"{param}.schema") if schema is None else _invalid(f"{param}.schema", "Input should be a valid"
                                                                                      " dictionary.", "invalid_type")
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    return param


def count_tokens_body(req: MessagesRequest, passthrough: Mapping[str, Any]) -> tuple[dict[str, Any], MessagesPlan]:
    """The chat form of ``/tokenize`` for a ``count_tokens`` body: the prompt the same
    request to ``/v1/messages`` would render (messages, system, tools, thinking)."""
    plan = plan_messages(req, passthrough)
    body: dict[str, Any] = {k: plan.body[k] for k in ("model", "messages", "tools", "chat_template_kwargs")
                            if k in plan.body}
    given = body.get("chat_template_kwargs")
    if "reasoning_effort" in plan.body and (given is None or isinstance(given, dict)):
        # A template variable on chat, so the same prompt; a given that is no object is /tokenize's 400.
        kwargs = body["chat_template_kwargs"] = dict(given or {})
        kwargs.setdefault("reasoning_effort", plan.body["reasoning_effort"])
    return body, plan
