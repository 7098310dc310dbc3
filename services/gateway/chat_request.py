"""``/v1/chat/completions`` bodies → ``NormalizedRequest``: the messages checked and
shaped as chat templates expect them, tools planned, logprob and reasoning options set,
the conversation rendered with the model's template and tokenized once. Same contract
as every parser (``normalized``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from proto.records import OutputOptions

from .chat_template import ChatTemplateError
from .errors import bad_request, clip, from_template_error
from .models import ModelSpec
from .normalized import (
    Body,
    NormalizedRequest,
    check_max_tokens,
    decode_body,
    encode_text,
    finish_request,
    resolve_model,
)
from .openai_api import REASONING_EFFORTS, ChatCompletionRequest, ContentPart, chat_request_decoder
from .sampling_fields import check_common, check_count, check_vllm_unserved, invalid, unsupported
from .tools import ToolPlan, history_fields, plan_tools

_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Claude Code's attribution line: its value changes on every request, so a system prompt
# that keeps it misses the prefix cache from there on (vLLM drops it too).
BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(content: str | list[ContentPart]) -> str | list[ContentPart]:
    """A system message's content less Claude Code's attribution line (a text part that
    held nothing else is dropped)."""
    if isinstance(content, str):
        return content.partition("\n")[2] if content.startswith(BILLING_HEADER) else content
    kept = []
    for part in content:
        if part.type == "text" and part.text is not None and part.text.startswith(BILLING_HEADER):
            rest = part.text.partition("\n")[2]
            if not rest:
                continue
            part = msgspec.structs.replace(part, text=rest)
        kept.append(part)
    return kept


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as template input: plain-string content, ``developer`` folded into
    ``system``, tool calls and tool results in the shape chat templates expect."""
    if not req.messages:
        raise bad_request("'messages' must contain at least one message.", "messages", "invalid_value")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise bad_request(
                f"Invalid value for 'messages[{i}].role': {clip(m.role)!r} is not supported; use system,"
                " developer, user, assistant or tool.",
                f"messages[{i}].role",
                "unsupported_value",
            )
        content = m.content
        if m.role == "system" and content is not None:
            content = _without_billing_header(content)
        if content is None:
            if m.role != "assistant":
                raise bad_request(
                    f"Missing required parameter: 'messages[{i}].content'.",
                    f"messages[{i}].content",
                    "missing_required_parameter",
                )
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise bad_request(
                        f"Content part type {clip(part.type)!r} is not supported: this model takes text only.",
                        f"messages[{i}].content[{j}].type",
                        "unsupported_value",
                    )
                if part.text is None:
                    raise bad_request(
                        f"Missing required parameter: 'messages[{i}].content[{j}].text'.",
                        f"messages[{i}].content[{j}].text",
                        "missing_required_parameter",
                    )
                texts.append(part.text)
            # vLLM joins text parts with newlines; matching it keeps prompts identical.
            text = "\n".join(texts)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        if m.role == "assistant" and m.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = m.reasoning
        message.update(history_fields(m, i))
        out.append(message)
    return out


def _check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if req.functions:
        unsupported("functions", "The deprecated 'functions' parameter is not supported: use 'tools'.")
    if req.function_call is not None and req.function_call != "none":
        unsupported("function_call", "The deprecated 'function_call' parameter is not supported: use 'tool_choice'.")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        unsupported("modalities", "Only the text modality is supported.")
    if req.audio is not None:
        unsupported("audio", "Audio output is not supported.")
    if req.prediction is not None:
        unsupported("prediction", "Predicted outputs are not supported.")
    if req.web_search_options is not None:
        unsupported("web_search_options", "Web search is not supported.")
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        invalid("reasoning_effort", f"must be one of {', '.join(map(repr, REASONING_EFFORTS))}.")
    if req.verbosity not in (None, "medium"):
        unsupported("verbosity", "Only verbosity 'medium' (the model's own) is supported.")


def _chat_output(req: ChatCompletionRequest, spec: ModelSpec, plan: ToolPlan, common: dict[str, Any]) -> OutputOptions:
    """Logprobs and tool settings of a chat request → what the worker samples and how the
    gateway builds the answer."""
    top = 0
    if req.top_logprobs is not None:
        # 0 asks for nothing more, so vLLM takes it without logprobs (as clients send it).
        if not req.logprobs and req.top_logprobs != 0:
            invalid("top_logprobs", "requires 'logprobs' to be true.")
        top = check_count("top_logprobs", req.top_logprobs, spec.limits.max_logprobs)
    if req.logprobs:
        common["logprobs"] = top
    if plan.choice == "auto" and spec.tool_parser == "mistral":
        # Its [TOOL_CALLS] marker is a special token: the parser must see it (vLLM does the same).
        common["skip_special_tokens"] = False
    if plan.structured is not None:
        if "structured" in common:
            invalid("tool_choice", "a forced tool call cannot be combined with response_format or guided decoding.")
        common["structured"] = plan.structured
    end_token_id = None
    thinking = True
    if spec.reasoning_parser:
        ids = encode_text(spec, "</think>")
        end_token_id = ids[0] if len(ids) == 1 else None
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking") is not False
    return OutputOptions(
        n=common.get("n", 1), logprobs=bool(req.logprobs), top_logprobs=top,
        prompt_logprobs="prompt_logprobs" in common,
        tool_choice="function" if plan.choice == "named" else plan.choice, tool_name=plan.function_name or "",
        tool_parser=spec.tool_parser if plan.choice == "auto" else "", reasoning_parser=spec.reasoning_parser,
        thinking=thinking, reasoning_end_token_id=end_token_id, parallel_tool_calls=plan.parallel_tool_calls,
        mistral_call_ids=spec.tool_parser == "mistral",
    )


_RESERVED_TEMPLATE_KEYS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}


def template_kwargs(chat_template_kwargs: dict[str, Any] | None, reasoning_effort: str | None = None) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM): extra template variables, e.g. ``enable_thinking``;
    ``reasoning_effort`` goes in as a variable too, as vLLM passes it (templates that
    know it, such as gpt-oss's, set the effort in the prompt)."""
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KEYS:
            invalid(f"chat_template_kwargs.{key}", "is set by the request itself, not a template variable.")
    if reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning_effort)
    return kwargs


def render_prompt(spec: ModelSpec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            add_generation_prompt: bool = True, continue_final_message: bool = False,
            extra_context: dict[str, Any] | None = None, client_variables: bool = False) -> str:
    try:
        return spec.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    continue_final_message=continue_final_message, extra_context=extra_context)
    except ChatTemplateError as exc:
        if exc.reason == "broken" and client_variables:
            # The client's own variables were in the context: a template that failed on
            # them (a number where it adds strings) is the request's fault, as vLLM says.
            raise bad_request(f"The chat template failed with these chat_template_kwargs: {exc.message}",
                              "chat_template_kwargs", "invalid_value") from None
        raise from_template_error(exc) from None


def parse_chat_request(
    body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None,
    always_streams: bool = False,
) -> NormalizedRequest:
    """Validate a ``/v1/chat/completions`` body; render, tokenize, resolve max_tokens.

    ``models`` maps every servable name (aliases included) to its spec;
    ``allowed_models`` is the key's ``ApiKeyRecord.models`` (None or empty: all).
    Raises ``ApiError`` (4xx; 500 only for a broken template or tokenizer).
    ``always_streams``: the transport streams whatever the body says (WebSocket), so the
    body is checked as a streamed request's.
    """
    req: ChatCompletionRequest = decode_body(chat_request_decoder, body)
    if always_streams:
        req.stream = True
    spec = resolve_model(req.model, models, allowed_models)
    _check_chat_unsupported(req)
    check_vllm_unserved(req, add_special_tokens=False)
    common = check_common(req, spec.limits, spec.tokenizer.vocab_size)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = check_max_tokens(
        max_param, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens, spec.limits
    )
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser=spec.tool_parser)
    output = _chat_output(req, spec, plan, common)
    messages = chat_messages(req)
    if req.continue_final_message and req.add_generation_prompt:
        invalid("continue_final_message", "cannot be combined with add_generation_prompt: true.")
    if req.continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        invalid("continue_final_message", "the last message must be the assistant's message to continue.")
    add_generation_prompt = req.add_generation_prompt is not False and not req.continue_final_message
    prompt = encode_text(spec, render_prompt(spec, messages, plan.tools, add_generation_prompt,
                                         bool(req.continue_final_message),
                                         template_kwargs(req.chat_template_kwargs, req.reasoning_effort),
                                         client_variables=bool(req.chat_template_kwargs)))
    if req.echo and messages and messages[-1]["role"] == "assistant" and messages[-1].get("content"):
        output.echo = messages[-1]["content"]
    normalized = finish_request("chat", req, spec, prompt, common, max_param, requested, output)
    normalized.tools = plan.tools
    return normalized
