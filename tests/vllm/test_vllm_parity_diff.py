"""Differential test of the vLLM 0.32 audit's defects: meshserve with a vLLM worker against
vLLM's own OpenAI server, on a tiny model whose ``generation_config.json`` sets sampling
defaults (top_k 1, temperature 0.7, max_new_tokens 3).

- the model's generation-config defaults fill the fields a request omits (chat: its
  max_new_tokens is the default max_tokens; completions keep 16), explicit values win;
- ``stop_reason``: the stop string, the stop token id, or null;
- completions ``echo`` with ``max_tokens: 0``: the prompt, its logprobs, no output;
- ``echo`` of a text prompt with special tokens and of token ids keeps the special tokens;
- a structured-output schema vLLM's engine cannot compile is a 400 on both.

The same comparison helpers as ``test_vllm_openai_diff`` (field by field, logprobs within
1e-3); both servers start once for the module (most of a minute each on CPU).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.vllm.meshes import MODEL, cpu_unsupported, vllm_mesh, vllm_openai_server

# Its module skips where vLLM is not installed: this one with it.
from tests.vllm.test_vllm_openai_diff import (
    Servers,
    Urls,
    _split,
    assert_same,
    chat_view,
    completion_view,
)

pytestmark = pytest.mark.timeout(900)
GENERATION = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 3}
QUESTION = [{"role": "user", "content": "Tell me about the city and the river"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with sampling defaults in its generation config (weights linked)."""
    path = tmp_path_factory.mktemp("tiny-defaults")
    for item in tiny_model.iterdir():
        if item.name != "generation_config.json":
            (path / item.name).symlink_to(item)
    config = json.loads((tiny_model / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **GENERATION}))
    return path


@pytest.fixture(scope="module")
def urls(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Urls]:
    reason = cpu_unsupported()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("parity")
    try:
        with vllm_openai_server(model_dir, tmp) as server, vllm_mesh(model_dir, tmp / "mesh") as mesh:
            server.wait_ready()
            yield Urls(vllm=server.url, mesh=mesh.gateway_url, key=mesh.dev_key)
    finally:
        shutil.rmtree(tmp / "mesh", ignore_errors=True)


@pytest.fixture
async def servers(urls: Urls) -> AsyncIterator[Servers]:
    both = Servers(
        vllm=openai.AsyncOpenAI(base_url=urls.vllm + "/v1", api_key="unused", max_retries=0, timeout=120),
        mesh=openai.AsyncOpenAI(base_url=urls.mesh + "/v1", api_key=urls.key, max_retries=0, timeout=120),
        ws_url=urls.mesh + "/v1/ws", key=urls.key, urls=urls)
    yield both
    await both.vllm.close()
    await both.mesh.close()


def stop_reasons(r: Any) -> list[Any]:
    """Every choice's ``stop_reason``, "<missing>" where the key is absent."""
    return [(c.model_extra or {}).get("stop_reason", "<missing>") for c in sorted(r.choices, key=lambda c: c.index)]


async def both_chat(servers: Servers, body: dict[str, Any]) -> tuple[Any, Any]:
    ref = await servers.vllm.chat.completions.create(model=MODEL, **_split(servers.vllm.chat.completions.create, body))
    got = await servers.mesh.chat.completions.create(model=MODEL, **_split(servers.mesh.chat.completions.create, body))
    assert_same(chat_view(ref), chat_view(got), "chat completion")
    assert_same(stop_reasons(ref), stop_reasons(got), "stop_reason")
    return ref, got


async def both_completion(servers: Servers, body: dict[str, Any]) -> tuple[Any, Any]:
    ref = await servers.vllm.completions.create(model=MODEL, **_split(servers.vllm.completions.create, body))
    got = await servers.mesh.completions.create(model=MODEL, **_split(servers.mesh.completions.create, body))
    assert_same(completion_view(ref), completion_view(got), "completion")
    assert_same(stop_reasons(ref), stop_reasons(got), "stop_reason")
    return ref, got


async def test_generation_config_defaults_fill_omitted_fields(servers: Servers) -> None:
    ref, _ = await both_chat(servers, {"messages": QUESTION})  # max_new_tokens 3, top_k 1
    assert ref.usage.completion_tokens == 3 and ref.choices[0].finish_reason == "length"
    await both_chat(servers, {"messages": QUESTION, "max_tokens": 6, "seed": 4})
    # Explicit sampling fields win: top_k off and temperature 1 sample differently from greedy.
    await both_chat(servers, {"messages": QUESTION, "max_tokens": 6, "seed": 4, "top_k": 0, "temperature": 1.0})
    ref, _ = await both_completion(servers, {"prompt": "The river runs past"})  # completions: 16, not 3
    assert ref.usage.completion_tokens > 3 or ref.choices[0].finish_reason == "stop"


async def test_stop_reason(servers: Servers) -> None:
    body = {"messages": QUESTION, "max_tokens": 24, "temperature": 1.0, "top_k": 0, "seed": 23}
    free, _ = await both_chat(servers, body)
    assert stop_reasons(free) == [None]  # length: null, present
    text = free.choices[0].message.content or ""
    stop = text[len(text) // 2: len(text) // 2 + 3]
    ref, _ = await both_chat(servers, {**body, "stop": [stop, "\u2603never"]})
    assert stop_reasons(ref) == [stop]
    plain = await servers.vllm.completions.create(
        model=MODEL, prompt="The river runs past", max_tokens=12, temperature=1.0, seed=5,
        extra_body={"top_k": 0, "return_token_ids": True})
    extra = plain.choices[0].model_extra
    assert extra is not None
    token = extra["token_ids"][4]
    ref, _ = await both_completion(servers, {"prompt": "The river runs past", "max_tokens": 12, "temperature": 1.0,
                                             "seed": 5, "top_k": 0, "stop_token_ids": [token]})
    assert stop_reasons(ref) == [token]


async def test_echo_with_max_tokens_0(servers: Servers) -> None:
    ref, _ = await both_completion(servers, {"prompt": "hello world", "max_tokens": 0, "echo": True, "logprobs": 0})
    assert ref.choices[0].text == "hello world"
    await both_completion(servers, {"prompt": "hello world", "max_tokens": 0, "echo": True})


async def test_echo_keeps_special_tokens(servers: Servers) -> None:
    ref, _ = await both_completion(servers, {"prompt": "<|begin_of_text|>abc", "max_tokens": 2, "echo": True,
                                             "logprobs": 1, "seed": 1})
    assert ref.choices[0].text.startswith("<|begin_of_text|>abc")
    ids = (await servers.vllm.completions.create(model=MODEL, prompt="<|begin_of_text|>abc", max_tokens=1,
                                                 extra_body={"return_token_ids": True})).choices[0]
    assert ids.model_extra is not None
    prompt_ids = ids.model_extra["prompt_token_ids"]
    await both_completion(servers, {"prompt": prompt_ids, "max_tokens": 2, "echo": True, "logprobs": 1, "seed": 1})


async def test_a_schema_the_engine_rejects_is_a_400(servers: Servers) -> None:
    body = {"messages": QUESTION, "max_tokens": 5,
            "structured_outputs": {"json": {"type": "integer", "minimum": 10, "maximum": 1}}}
    errors = []
    for client in (servers.vllm, servers.mesh):
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model=MODEL, **_split(client.chat.completions.create, body))
        errors.append(info.value)
    assert [e.status_code for e in errors] == [400, 400], [str(e) for e in errors]
