"""What vLLM's OpenAI server answers and the mesh now answers the same (the audit against
vLLM 0.32): ``stop_reason`` on every choice and finishing chunk, completions ``echo`` with
``max_tokens: 0`` (prompt scoring), and the model's generation-config sampling defaults
applied to the fields a request omits. A sim worker, an echo worker that advertises a
generation config, and the gateway run as tasks in this process, on a real nats-server;
``tests/vllm/test_vllm_parity_diff.py`` checks the same against vLLM's own server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from bus import Bus, BusSettings
from proto import GenerateRequest, WorkerInfo, decode
from proto.workers import SamplingDefaults
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.echo import EchoEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker

ECHO = "echo-with-defaults"
SPACE = ord(" ") + 3  # the sim's byte tokenizer


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings, speed=200.0) as service:
        yield service


@pytest.fixture
async def echo_worker(bus_settings: BusSettings, tmp_path: Path) -> AsyncIterator[WorkerService]:
    config_dir = tmp_path / "model"
    config_dir.mkdir()
    (config_dir / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.3,
         "max_new_tokens": 5, "do_sample": True}))
    engine = EchoEngine(model=ECHO, tokens_per_s=5000.0, generation_config=str(config_dir))
    service = WorkerService(engine, WorkerConfig(worker_id="echo1"), bus_settings)
    await service.start()
    try:
        yield service
    finally:
        await service.drain_and_close()


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService, echo_worker: WorkerService
                  ) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings, GatewayConfig(port=0)) as service:
        yield service


@pytest.fixture
async def key(bus: Bus, gateway: GatewayService) -> str:
    return await known_key(bus, gateway, "parity-org")


async def registered(bus: Bus, worker_id: str) -> WorkerInfo:
    """The worker's entry in the registry, as gateways read it."""
    entry = await (await bus.js.key_value(bus.subjects.workers_bucket)).get(worker_id)
    assert entry.value is not None
    return decode(entry.value, WorkerInfo)


async def _post(gateway: GatewayService, key: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            f"{gateway.http_url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def _watch(bus: Bus, worker_id: str, seen: list[GenerateRequest]) -> Any:
    """A copy of every GenerateRequest sent to ``worker_id`` (a plain subscriber beside its endpoint)."""
    async def on(msg: Any) -> None:
        seen.append(decode(msg.data, GenerateRequest))

    return await bus.nc.subscribe(bus.subjects.worker_generate(worker_id), cb=on)


async def _events(gateway: GatewayService, key: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(
            f"{gateway.http_url}/v1/{path}", json={**body, "stream": True},
            headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        text = (await r.read()).decode()
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line.strip() != "data: [DONE]"]


# ---------------------------------------------------------------------------- stop_reason


async def test_stop_reason_is_the_stop_string_the_token_id_or_null(gateway: GatewayService, key: str) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me something"}], "seed": 3}
    status, plain = await _post(gateway, key, "chat/completions", {**chat, "max_tokens": 40, "ignore_eos": True})
    assert status == 200, plain
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "stop_reason" in choice and choice["stop_reason"] is None  # null, not missing
    word = choice["message"]["content"].split()[2]

    status, body = await _post(gateway, key, "chat/completions",
                               {**chat, "max_tokens": 40, "ignore_eos": True, "stop": [word]})
    assert status == 200, body
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", word)

    # A stop token id (the space): its id, as vLLM's.
    status, body = await _post(gateway, key, "completions",
                               {"model": MODEL, "prompt": "hello", "max_tokens": 40, "seed": 3,
                                "stop_token_ids": [SPACE], "ignore_eos": True})
    assert status == 200, body
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", SPACE)

    # EOS: "stop" with a null stop_reason.
    status, body = await _post(gateway, key, "completions",
                               {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "seed": 3})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] is None


async def test_streams_carry_stop_reason_on_the_finishing_chunk(gateway: GatewayService, key: str) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "seed": 5,
            "stop_token_ids": [SPACE], "ignore_eos": True}  # no EOS before the first word's space
    events = await _events(gateway, key, "chat/completions", chat)
    finishing = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert len(finishing) == 1 and finishing[0]["stop_reason"] == SPACE
    # vLLM's chat stream names it only on the finishing chunk.
    assert all("stop_reason" not in c for e in events for c in e["choices"] if c["finish_reason"] is None)

    events = await _events(gateway, key, "completions",
                           {"model": MODEL, "prompt": "hello", "max_tokens": 40, "seed": 5, "n": 2,
                            "stop_token_ids": [SPACE], "ignore_eos": True})
    choices = [c for e in events for c in e["choices"]]
    assert all("stop_reason" in c for c in choices)  # completions: on every chunk, null until the end
    ends = {c["index"]: c["stop_reason"] for c in choices if c["finish_reason"] is not None}
    assert ends == {0: SPACE, 1: SPACE}

    # The stock client reads it (an extra field on the choice).
    client = openai.AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=0)
    reply = await client.completions.create(model=MODEL, prompt="hello", max_tokens=40, seed=5,
                                            extra_body={"stop_token_ids": [SPACE], "ignore_eos": True})
    assert reply.choices[0].model_extra is not None and reply.choices[0].model_extra["stop_reason"] == SPACE
    await client.close()


# ------------------------------------------------------------------ echo with max_tokens 0


async def test_echo_with_max_tokens_0_answers_the_prompt_and_its_logprobs(gateway: GatewayService, key: str) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 0, "echo": True, "logprobs": 0}
    status, reply = await _post(gateway, key, "completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["text"] == "hello world"
    assert choice["finish_reason"] in ("length", "stop")
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == "hello world" and lp["token_logprobs"][0] is None
    assert len(lp["tokens"]) == 11 and lp["text_offset"] == list(range(11))
    # As vLLM: the one token the engine ran counts, though its text is not answered.
    assert reply["usage"]["prompt_tokens"] == 11 and reply["usage"]["completion_tokens"] == 1

    events = await _events(gateway, key, "completions", {k: v for k, v in body.items() if k != "logprobs"})
    assert "".join(c["text"] for e in events for c in e["choices"]) == "hello world"

    status, error = await _post(gateway, key, "completions", {**body, "echo": False})
    assert status == 400 and error["error"]["param"] == "max_tokens"
    status, error = await _post(gateway, key, "chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    assert status == 400


# ------------------------------------------------------------- generation-config defaults


async def test_the_models_generation_config_fills_what_a_request_omits(
        bus: Bus, gateway: GatewayService, key: str, echo_worker: WorkerService) -> None:
    info = await registered(bus, "echo1")
    # A directory's generation config (the echo engine takes one only so): its max_new_tokens
    # is the default and also the cap, as vLLM's --generation-config DIR (override_max_tokens).
    assert info.sampling_defaults == SamplingDefaults(temperature=0.25, top_p=0.5, top_k=7, min_p=0.05,
                                                      repetition_penalty=1.3, max_tokens=5, max_tokens_override=5)
    seen: list[GenerateRequest] = []
    sub = await _watch(bus, "echo1", seen)
    try:
        status, reply = await _post(gateway, key, "chat/completions",
                                    {"model": ECHO, "messages": [{"role": "user", "content": "a long enough prompt"}],
                                     "top_k": 3, "temperature": 0.9})
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] == 5  # max_new_tokens: the chat default max_tokens
        status, reply = await _post(gateway, key, "completions", {"model": ECHO, "prompt": "a long enough prompt",
                                                                  "max_tokens": 12, "min_p": 0.0})
        assert status == 200 and reply["usage"]["completion_tokens"] == 5  # an explicit 12 lowered to the cap
        for _ in range(50):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await sub.unsubscribe()
    chat, completion = (r.sampling for r in seen)
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.9, 3, 5)  # given: the request's
    assert (chat.top_p, chat.min_p, chat.repetition_penalty) == (0.5, 0.05, 1.3)  # omitted: the model's
    assert (completion.temperature, completion.top_k, completion.min_p, completion.max_tokens) == (0.25, 7, 0.0, 5)


async def test_a_sim_worker_advertises_no_defaults(gateway: GatewayService, worker: WorkerService, key: str,
                                                   bus: Bus) -> None:
    info = await registered(bus, "w1")
    assert info.sampling_defaults is None
    seen: list[GenerateRequest] = []
    sub = await _watch(bus, "w1", seen)
    try:
        status, _ = await _post(gateway, key, "chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
        assert status == 200
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.05)
    finally:
        await sub.unsubscribe()
    s = seen[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)


async def test_the_websocket_carries_stop_reason_too(gateway: GatewayService, key: str) -> None:
    """``done`` names what stopped a single choice; with n > 1 each choice's last ``token`` does."""
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "seed": 3, "stop_token_ids": [SPACE],
               "ignore_eos": True}
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws?api_key={key}") as ws:
        await ws.send_json({"type": "completion", "id": "one", "body": request})
        await ws.send_json({"type": "completion", "id": "two", "body": {**request, "n": 2}})
        done: dict[str, dict[str, Any]] = {}
        ends: list[dict[str, Any]] = []
        while len(done) < 2:
            frame = await ws.receive_json(timeout=30)
            assert frame["type"] != "error", frame
            if frame["type"] == "done":
                done[frame["id"]] = frame
            elif frame.get("finish_reason"):
                ends.append(frame)
    assert (done["one"]["finish_reason"], done["one"]["stop_reason"]) == ("stop", SPACE)
    assert sorted(f.get("index", 0) for f in ends if f["id"] == "two") == [0, 1]  # 0 is left out
    assert all(f["stop_reason"] == SPACE for f in ends if f["finish_reason"] == "stop")


async def test_chat_echo_opens_the_answer_with_the_continued_message(gateway: GatewayService, key: str) -> None:
    """vLLM's chat ``echo``: with the final message the assistant's, the answer (whole and
    streamed, every choice) starts with it; otherwise nothing is added."""
    start = "Sure, the"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": start}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 6, "ignore_eos": True,
            "seed": 4, "n": 2}
    status, plain = await _post(gateway, key, "chat/completions", chat)
    assert status == 200, plain
    status, echoed = await _post(gateway, key, "chat/completions", {**chat, "echo": True})
    assert status == 200, echoed
    for without, with_echo in zip(plain["choices"], echoed["choices"], strict=True):
        assert with_echo["message"]["content"] == start + without["message"]["content"]
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [echoed["usage"][k] for k in tokens] == [plain["usage"][k] for k in tokens]  # nothing more generated
    events = await _events(gateway, key, "chat/completions", {**chat, "echo": True})
    streamed = {0: "", 1: ""}
    for event in events:
        for c in event["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert [streamed[0], streamed[1]] == [c["message"]["content"] for c in echoed["choices"]]
    # The last message is the user's: nothing to echo.
    status, user_last = await _post(gateway, key, "chat/completions",
                                    {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                     "ignore_eos": True, "seed": 4, "echo": True})
    assert status == 200 and not user_last["choices"][0]["message"]["content"].startswith("Hi")
