"""``meshserve sim-server`` as a real process, driven by the stock openai client, plain HTTP
and ZMQ: vLLM's OpenAI surface, /tokenize, /metrics, /get_load, failure injection, and its
KV events (decoded with vLLM's own structs where vLLM is importable, else our schema of them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import zmq

try:  # vLLM's own structs where its build is importable (tests/vllm's interpreter)
    from vllm.distributed.kv_events import KVEventBatch
except ImportError:
    from ops.simserver.kv_events import KVEventBatch

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-test"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    kv: str = ""
    replay: str = ""

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def stderr_so_far(self) -> str:
        """What the server has written to stderr and nobody read yet (without waiting)."""
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        out = b""
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            out += data
        return out.decode(errors="replace")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


def _start(*argv: str) -> Generator[Server, None, None]:
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "sim-server", "--port", "0", "--model", MODEL, *argv],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(60)
    if not line or "serving" not in line[0]:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"sim-server did not start: {line} {err[-2000:]}")
    url = re.search(r"http://\S+?(?=,|$)", line[0].strip())
    kv = re.search(r"KV events on (\S+?)(?=,|$)", line[0].strip())
    replay = re.search(r"replay on (\S+)$", line[0].strip())
    assert url is not None
    try:
        yield Server(proc, url.group(0), kv.group(1) if kv else "", replay.group(1) if replay else "")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from _start("--speed", "10", "--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*")


@pytest.fixture(scope="module")
def failing_server() -> Iterator[Server]:
    yield from _start("--speed", "50", "--error-rate", "1", "--load-format", "sglang")


def eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_chat_with_the_stock_client_streamed_and_not(server: Server) -> None:
    client = server.client()
    messages: Any = [{"role": "user", "content": "Say something about the sea."}]
    _, tokenized = server.post("/tokenize", {"model": MODEL, "messages": messages})
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (tokenized["count"], 12)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == tokenized["count"]
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_the_stock_client_streamed_and_not(server: Server) -> None:
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                      extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.usage.prompt_tokens == len(b"Once upon a time")  # the sim's byte tokenizer
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_the_request_log_names_each_request_by_its_response_id(tmp_path: Path) -> None:
    """``--request-log``: a line per finished request, under the ``id`` its response carries,
    with the engine's own stamps (what a benchmark subtracts to see what a proxy added)."""
    log_path = tmp_path / "requests.jsonl"
    for server in _start("--speed", "10", "--request-log", str(log_path)):
        client = server.client()
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
        reply = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, extra_body={"ignore_eos": True})
        eventually(lambda: log_path.exists() and len(log_path.read_bytes().splitlines()) == 2, "two log lines")
    lines = {line["id"]: line for line in map(json.loads, log_path.read_bytes().splitlines())}
    assert set(lines) == {chunks[0].id, reply.id}
    assert chunks[0].id.startswith("chatcmpl-") and reply.id.startswith("cmpl-")
    chat, completion = lines[chunks[0].id], lines[reply.id]
    assert (chat["completion_tokens"], completion["completion_tokens"]) == (5, 3)
    assert completion["prompt_tokens"] == len(b"Once") and chat["finish_reason"] == "length"
    for line in (chat, completion):
        assert 0 < line["arrival"] <= line["first_token"] <= line["finished"] <= time.time()


def test_a_request_log_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "sim-server", "--port", "0", "--request-log",
                           str(tmp_path / "missing" / "log.jsonl")], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--request-log: No such file or directory" in proc.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a file whose writes fail)")
def test_a_request_log_that_cannot_be_written_costs_the_log_not_the_answers() -> None:
    """A full disk made every non-streamed request a 500 and cut every stream short."""
    for server in _start("--speed", "10", "--request-log", "/dev/full"):
        client = server.client()
        reply = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, extra_body={"ignore_eos": True})
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_models_health_tokenize_detokenize(server: Server) -> None:
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert server.get("/health") == (200, b"")
    status, body = server.post("/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}  # vLLM's shape
    status, back = server.post("/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": "héllo"})
    status, err = server.post("/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and err["error"]["code"] == 404 and err["error"]["type"] == "NotFoundError"  # vLLM's shape
    status, err = server.post("/v1/responses", {"model": MODEL, "input": "x"})
    # it names what it serves, and /v1/responses (the gateway's) is not among them
    assert status == 404 and "/v1/completions" in err["error"]["message"]
    assert "/v1/responses" not in err["error"]["message"].split("serves", 1)[1]


def test_render_gives_the_token_ids_generation_would_use(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    _, tokenized = server.post("/tokenize", {"model": MODEL, "messages": messages})
    status, rendered = server.post("/v1/chat/completions/render", {"model": MODEL, "messages": messages,
                                                                   "max_tokens": 5})
    assert status == 200 and rendered["token_ids"] == tokenized["tokens"]
    assert rendered["sampling_params"]["max_tokens"] == 5
    status, rendered_list = server.post("/v1/completions/render", {"model": MODEL, "prompt": "ab"})
    _, tokenized = server.post("/tokenize", {"model": MODEL, "prompt": "ab"})
    assert status == 200 and rendered_list[0]["token_ids"] == tokenized["tokens"] and len(tokenized["tokens"]) == 2


def test_metrics_carry_vllm_names(server: Server) -> None:
    server.client().completions.create(model=MODEL, prompt="count me", max_tokens=3)
    status, body = server.get("/metrics")
    text = body.decode()
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:prefix_cache_queries_total"):
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="{MODEL}"', text, re.M), name
    prompt_total = re.search(r'^vllm:prompt_tokens_total\{[^}]*\} (\S+)$', text, re.M)
    assert prompt_total is not None and float(prompt_total.group(1)) >= len(b"count me")


def test_get_load_counts_requests_in_flight_and_an_abandoned_stream_is_aborted(server: Server) -> None:
    def load() -> int:
        status, body = server.get("/get_load")
        assert status == 200
        value = json.loads(body)
        assert set(value) == {"load"}
        return int(value["load"])

    eventually(lambda: load() == 0, "an idle server")
    stream = server.client().completions.create(model=MODEL, prompt="a long one", max_tokens=4000, stream=True,
                                                extra_body={"ignore_eos": True})
    next(iter(stream))
    eventually(lambda: load() == 1, "the streaming request to count")
    # a harness asks for the other router's shape, with the tokens in flight
    status, body = server.get("/get_load?format=sglang")
    [rank] = json.loads(body)
    assert status == 200 and rank["num_reqs"] == 1 and rank["num_tokens"] > 0
    status, body = server.get("/get_load?format=xml")
    assert status == 400 and "format must be vllm or sglang" in json.dumps(json.loads(body))
    stream.close()  # the client leaves: the engine drops the request
    eventually(lambda: load() == 0, "the abandoned request to be aborted")
    # quietly: a client leaving is no error (a traceback each filled a pipe-fed log and hung the server);
    # the server logs after the abort, so give it a moment
    time.sleep(0.5)
    assert "Traceback" not in server.stderr_so_far()


def test_sglang_load_shape_and_the_error_rate(failing_server: Server) -> None:
    status, body = failing_server.get("/get_load")
    assert status == 200
    [rank] = json.loads(body)
    assert rank["num_tokens"] == 0 and rank["num_reqs"] == 0
    with pytest.raises(openai.InternalServerError) as info:
        failing_server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 500
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "InternalServerError"
    assert info.value.body["code"] == 500 and "Injected" in info.value.body["message"]
    assert failing_server.get("/health")[0] == 200  # only generation fails


@pytest.mark.parametrize(("status", "error"), [(429, openai.RateLimitError), (400, openai.BadRequestError),
                                               (503, openai.InternalServerError)])
def test_x_return_error(server: Server, status: int, error: type[openai.APIStatusError]) -> None:
    with pytest.raises(error) as info:
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           extra_headers={"X-Return-Error": str(status)})
    assert info.value.status_code == status
    assert isinstance(info.value.body, dict) and info.value.body["code"] == status
    assert "Injected" in info.value.body["message"]
    code, body = server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, {"X-Return-Error": "nope"})
    assert code == 400 and body["error"]["param"] == "X-Return-Error"


def test_priority_is_refused_under_fcfs(server: Server) -> None:
    code, body = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": 1})
    assert code == 400 and body["error"]["param"] == "priority"
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=2,
                                              extra_body={"priority": 0}).choices


@pytest.fixture()
def priority_server() -> Iterator[Server]:
    yield from _start("--speed", "10", "--max-num-seqs", "1", "--scheduling-policy", "priority")


def test_priority_scheduling_runs_lower_priority_values_first(priority_server: Server) -> None:
    """vLLM's --scheduling-policy priority: with one sequence at a time, a request queued
    later with a lower ``priority`` value runs before one queued earlier."""
    srv = priority_server

    def load() -> int:
        return int(json.loads(srv.get("/get_load")[1])["load"])

    done: list[str] = []

    def ask(name: str, priority: int) -> None:
        srv.client().completions.create(model=MODEL, prompt=name, max_tokens=4, extra_body={"priority": priority})
        done.append(name)

    blocker = srv.client().completions.create(model=MODEL, prompt="first", max_tokens=4000, stream=True,
                                              extra_body={"ignore_eos": True})
    next(iter(blocker))
    threads = []
    for queued, (name, priority) in enumerate((("later", 5), ("sooner", -1)), start=2):
        threads.append(threading.Thread(target=ask, args=(name, priority)))
        threads[-1].start()
        eventually(lambda queued=queued: load() == queued, f"{name} to queue")  # type: ignore[misc]
    blocker.close()  # the running sequence leaves; the queue runs in priority order
    for t in threads:
        t.join(60)
    assert done == ["sooner", "later"]


def _decode(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def _tag(event: Any) -> str:
    return str(type(event).__struct_config__.tag)


def test_kv_events_carry_token_ids_and_replay(server: Server) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(server.kv)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    client = server.client()
    try:
        received: dict[int, bytes] = {}
        stored: list[Any] = []
        prompt_ids: list[int] = []
        # A SUB socket misses what is sent before its subscription lands: new prompts until one shows.
        for attempt in range(20):
            # A raw prompt whose first block is new (a chat template's system prompt is cached).
            prompt = f"attempt {attempt}: " + "tell me about the tides " * 4
            _, tokenized = server.post("/tokenize", {"model": MODEL, "prompt": prompt})
            prompt_ids = tokenized["tokens"]
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and not stored:
                if not sub.poll(100):
                    continue
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"" and len(seq) == 8
                received[int.from_bytes(seq, "big")] = payload
                for event in _decode(payload).events:
                    if _tag(event) == "BlockStored" and event.token_ids[:16] == prompt_ids[:16]:
                        stored.append(event)
            if stored:
                break
        assert stored, "no BlockStored for the prompt"
        event = stored[0]
        assert event.block_size == 16 and event.parent_block_hash is None and event.medium == "GPU"
        assert len(event.token_ids) == 16 * len(event.block_hashes)
        full = len(prompt_ids) // 16 * 16
        assert event.token_ids[:full] == prompt_ids[:full]

        replay = ctx.socket(zmq.DEALER)
        replay.connect(server.replay)
        first = min(received)
        replay.send_multipart([b"", first.to_bytes(8, "big")])
        replayed: dict[int, bytes] = {}
        while True:
            assert replay.poll(10_000), "no replay answer"
            empty, topic, seq, payload = replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                break
            replayed[int.from_bytes(seq, "big")] = payload
        replay.close(linger=0)
        assert min(replayed) == first
        assert all(replayed[s] == p for s, p in received.items())  # the same batches, byte for byte
    finally:
        sub.close(linger=0)
        ctx.term()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _requests_served(server: Server) -> float:
    text = server.get("/metrics")[1].decode()
    return sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} (\S+)$', text, re.M))


# On PATH, or where `make peers` (part of `make bench-tools`, as .ci/run runs it) installs it.
VLLM_ROUTER = shutil.which("vllm-router") or shutil.which("vllm-router", path=str(ROOT / ".venv-tools/peers/bin"))


@pytest.mark.skipif(VLLM_ROUTER is None, reason="vllm-router is not installed (make peers)")
def test_vllm_router_kv_aware_follows_our_kv_events() -> None:
    """vllm-router's kv_aware policy subscribes to two sim-servers' KV events and sends a
    prompt whose prefix one of them cached to that one, every time."""
    starts = [_start("--speed", "10", "--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*")
              for _ in range(2)]
    workers = [next(g) for g in starts]
    port = _free_port()
    assert VLLM_ROUTER is not None
    argv = [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[w.url for w in workers],
            "--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", MODEL,
            "--worker-startup-check-interval", "1", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(_free_port()), "--disable-retries", "--log-level", "warning"]
    for w in workers:
        argv += ["--kv-event-source", f"{w.url}={w.kv}", "--kv-event-replay-source", f"{w.url}={w.replay}"]
    router = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)

        def ready() -> bool:
            try:
                return [m.id for m in client.models.list().data] == [MODEL]
            except openai.APIError:
                return False

        eventually(ready, "vllm-router to find its workers", timeout=60)
        # Each worker caches a prefix of its own, sent to it directly (the router never sees
        # those requests): only the KV events tell the router where each prefix lives.
        for i, w in enumerate(workers):
            w.client().completions.create(model=MODEL, prompt=f"prefix {i}: " + "the quick brown fox jumps " * 12,
                                          max_tokens=4)
        time.sleep(1.0)  # the router applies the events it received (no way to ask it)
        for i in (1, 0):
            for k in range(3):
                client.completions.create(model=MODEL, prompt=f"prefix {i}: " + "the quick brown fox jumps " * 12
                                          + f"then {k}", max_tokens=4)
        assert [_requests_served(w) for w in workers] == [4.0, 4.0]
    finally:
        router.terminate()
        router.wait(timeout=20)
        for g in starts:
            g.close()


def test_calibrate_engine_url_recovers_the_step_costs_of_a_known_engine(tmp_path: Path) -> None:
    """``meshserve calibrate --engine-url`` against an engine whose step costs are known:
    the sim-server with the default profile at speed 2. Timed by the engine's own phase
    metrics (wall seconds, so half the profile's), the fit must give the profile back, and
    a sim-server started on the fitted profile has the engine's KV cache."""
    from services.worker.engines.sim_profile import DEFAULT_PROFILE, load_profile

    speed = 2.0
    truth = load_profile(DEFAULT_PROFILE).costs
    gen = _start("--speed", str(speed), "--max-num-seqs", "16", "--max-num-batched-tokens", "2048",
                 "--max-model-len", "4096", "--num-kv-blocks", "3000")
    engine = next(gen)
    try:
        out = tmp_path / "fitted.json"
        run = subprocess.run([sys.executable, "-m", "ops.cli", "calibrate", "--engine-url", engine.url,
                              "--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--out", str(out)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "3000 KV blocks of 16 tokens" in run.stdout and "fit error median" in run.stdout
    finally:
        gen.close()
    fitted = load_profile(out)
    assert fitted.memory.num_blocks(16) == 3000
    for prefill, decode, kv in ((0, 1, 600), (0, 8, 4000), (128, 0, 128), (1024, 0, 2048), (512, 4, 3000)):
        want = truth.step_time(prefill, decode, kv, int(prefill > 0)) / speed
        got = fitted.costs.step_time(prefill, decode, kv, int(prefill > 0))
        assert got == pytest.approx(want, rel=0.1), (prefill, decode, kv)
    # the fitted profile serves
    started = _start("--profile", str(out))
    served = next(started)
    try:
        status, body = served.get("/metrics")
        assert status == 200 and b'num_gpu_blocks="3000"' in body
    finally:
        started.close()


def test_calibrate_engine_url_that_does_not_answer_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "ops.cli", "calibrate", "--engine-url", f"http://127.0.0.1:{port}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "Traceback" not in run.stdout + run.stderr
    # one line, on stderr as every command's error (it was on stdout)
    assert run.stdout == "" and run.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in run.stderr
