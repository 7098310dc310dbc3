"""The bus against a real nats-server: typed messaging, errors, provisioning, traces, restarts, drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js import api
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus import Bus, BusSettings, provision
from bus.provision import StreamLimits
from ops.natsserver import NatsServer
from proto import (
    ControlCommand,
    ControlReply,
    ErrorCode,
    GenerateRequest,
    KvEventBatch,
    NoResponders,
    PayloadTooLarge,
    RemoteError,
    RequestTimeout,
    TokenChunk,
    pack_tokens,
    unpack_tokens,
)

ROOT = Path(__file__).resolve().parents[2]

_exporter = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(_exporter))
trace.set_tracer_provider(_provider)


async def test_typed_request_reply_and_pubsub(bus: Bus) -> None:
    async def answer(command: ControlCommand, msg: Msg) -> None:
        await bus.respond(msg, ControlReply(worker_id="w", state="ready", message=command.reason))

    await bus.subscribe("t.echo", ControlCommand, answer)
    reply = await bus.request("t.echo", ControlCommand(command="status", reason="hi"), ControlReply)
    assert reply.message == "hi" and reply.state == "ready"

    received: list[TokenChunk] = []
    done = asyncio.Event()

    async def collect(chunk: TokenChunk, msg: Msg) -> None:
        received.append(chunk)
        if len(received) == 100:
            done.set()

    await bus.subscribe("t.chunks", TokenChunk, collect)
    for i in range(100):
        await bus.publish("t.chunks", TokenChunk(request_id="r", seq=i, token_ids=[i]), trace=False)
    await asyncio.wait_for(done.wait(), 5)
    assert [c.seq for c in received] == list(range(100))


async def test_timeout_and_no_responders_are_typed(bus: Bus) -> None:
    with pytest.raises(NoResponders):
        await bus.request("t.nobody", ControlCommand(command="status"), ControlReply, timeout=1)

    async def never(command: ControlCommand, msg: Msg) -> None:
        return None

    await bus.subscribe("t.silent", ControlCommand, never)
    with pytest.raises(RequestTimeout):
        await bus.request("t.silent", ControlCommand(command="status"), ControlReply, timeout=0.3)


async def test_handler_errors_and_bad_bytes_come_back_as_typed_errors(bus: Bus) -> None:
    async def refuse(command: ControlCommand, msg: Msg) -> None:
        from proto import MeshError

        raise MeshError("draining, try another worker", code=ErrorCode.DRAINING)

    await bus.subscribe("t.refuse", ControlCommand, refuse)
    with pytest.raises(RemoteError) as info:
        await bus.request("t.refuse", ControlCommand(command="status"), ControlReply)
    assert info.value.code is ErrorCode.DRAINING and info.value.retryable

    # random bytes: the subscriber answers with a decode error and keeps serving
    raw = await bus.nc.request("t.refuse", b"\xc1\xff garbage", timeout=2)
    assert raw.headers and raw.headers["Nats-Service-Error-Code"] == "400"
    assert bus.decode_errors == 1
    with pytest.raises(RemoteError):
        await bus.request("t.refuse", ControlCommand(command="status"), ControlReply)


async def test_payload_limits(bus: Bus) -> None:
    assert bus.max_payload == 8 * 1024 * 1024  # meshserve's nats-server config
    # a 100k-token prompt fits, packed
    prompt = list(range(100_000))

    async def echo_len(request: GenerateRequest, msg: Msg) -> None:
        await bus.respond(msg, ControlReply(worker_id="w", state="ready", message=str(len(unpack_tokens(request.prompt)))))

    await bus.subscribe("t.big", GenerateRequest, echo_len)
    request = GenerateRequest(request_id="r", model="m", prompt=pack_tokens(prompt), token_subject="x")
    reply = await bus.request("t.big", request, ControlReply, timeout=5)
    assert reply.message == "100000"

    # over the limit: refused before sending, naming size and limit
    huge = GenerateRequest(request_id="r", model="m", prompt=b"\0" * (9 * 1024 * 1024), token_subject="x")
    with pytest.raises(PayloadTooLarge) as info:
        await bus.request("t.big", huge, ControlReply, timeout=5)
    assert info.value.limit == 8388608 and info.value.size > 9 * 1024 * 1024
    assert f"{info.value.size} bytes exceeds the server limit of 8388608 bytes" in str(info.value)
    with pytest.raises(PayloadTooLarge):
        await bus.publish("t.big", huge)
    assert bus.nc.is_connected


async def test_provisioning_is_idempotent(bus: Bus) -> None:
    s = bus.subjects
    await provision(bus.js, s)
    await provision(bus.js, s)
    names = {info.config.name for info in await bus.js.streams_info()}
    assert {"TOKENS", "USAGE", "CAPACITY", "KV_mesh_workers", "KV_mesh_keys"} <= names
    capacity = await bus.js.stream_info("CAPACITY")
    assert capacity.config.retention == api.RetentionPolicy.LIMITS and capacity.config.subjects == ["mesh.capacity.*"]
    assert capacity.config.discard == api.DiscardPolicy.OLD
    # a stream made with another retention is left as it is (the server refuses to change it), not a failed start
    await bus.js.delete_stream("CAPACITY")
    await bus.js.add_stream(api.StreamConfig(name="CAPACITY", subjects=["mesh.capacity.*"],
                                             retention=api.RetentionPolicy.WORK_QUEUE, max_age=60.0))
    await provision(bus.js, s)
    kept = await bus.js.stream_info("CAPACITY")
    assert kept.config.retention == api.RetentionPolicy.WORK_QUEUE and kept.config.max_age == 60.0
    usage = await bus.js.stream_info("USAGE")
    assert usage.config.duplicate_window == StreamLimits().usage_duplicate_window_s
    # changed limits are applied to the existing stream, data kept
    await bus.js_publish(s.usage("org1"), TokenChunk(request_id="r", seq=0), msg_id="r")
    await bus.js_publish(s.usage("org1"), TokenChunk(request_id="r", seq=0), msg_id="r")  # dedup
    await provision(bus.js, s, limits=StreamLimits(usage_max_age_s=3600))
    usage = await bus.js.stream_info("USAGE")
    assert usage.config.max_age == 3600 and usage.state.messages == 1
    # a second mesh root on the same server gets its own streams
    await provision(bus.js, BusSettings(root="blue").subjects)
    assert (await bus.js.stream_info("TOKENS_BLUE")).config.subjects == ["blue.tokens.>"]


async def test_trace_context_crosses_a_nats_hop(bus: Bus) -> None:
    _exporter.clear()
    tracer = trace.get_tracer("test")

    async def handle(command: ControlCommand, msg: Msg) -> None:
        with tracer.start_as_current_span("far-side", context=bus.remote_context(msg)):
            await bus.respond(msg, ControlReply(worker_id="w", state="ready"))

    await bus.subscribe("t.traced", ControlCommand, handle)
    with tracer.start_as_current_span("caller") as caller:
        await bus.request("t.traced", ControlCommand(command="status"), ControlReply)
    spans = {s.name: s for s in _exporter.get_finished_spans()}
    far = spans["far-side"]
    assert far.context.trace_id == caller.get_span_context().trace_id
    assert far.parent is not None and far.parent.span_id == caller.get_span_context().span_id


async def test_subscriber_survives_server_restart(tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "n").start()
    settings = BusSettings(servers=(server.url,), reconnect_wait_s=0.1)
    listener = await Bus.open(settings, "listener", initial_attempts=10)
    got: list[int] = []

    async def collect(chunk: TokenChunk, msg: Msg) -> None:
        got.append(chunk.seq)

    await listener.subscribe("t.after", TokenChunk, collect)
    await listener.confirm_subscriptions()
    try:
        server.stop()
        await asyncio.sleep(0.3)
        server = NatsServer(store_dir=tmp_path / "n", port=server.port).start()
        for _ in range(100):  # the listener reconnects and re-subscribes by itself
            if listener.nc.is_connected:
                break
            await asyncio.sleep(0.1)
        await listener.confirm_subscriptions()
        sender = await Bus.open(settings, "sender", initial_attempts=10)
        await sender.publish("t.after", TokenChunk(request_id="r", seq=7))
        await sender.close()
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.1)
        assert got == [7]
    finally:
        await listener.close()
        server.stop()


async def test_service_subprocess_drains_on_sigterm(bus: Bus, nats_url: str) -> None:
    env = {**os.environ, "MESHSERVE_NATS_URL": nats_url, "MESHSERVE_SLOW_S": "1.5"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/integration/slow_service.py")], env=env, cwd=ROOT)
    try:
        # wait until it registered with NATS micro, and check discovery answers
        info = None
        for _ in range(100):
            try:
                raw = await bus.nc.request("$SRV.INFO.meshserve-slow", b"", timeout=0.5)
                info = json.loads(raw.data)
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert info is not None, "service never registered"
        assert [e["subject"] for e in info["endpoints"]] == ["test.slow.work"]
        ping = json.loads((await bus.nc.request("$SRV.PING.meshserve-slow", b"", timeout=1)).data)
        assert ping["name"] == "meshserve-slow"

        requests = [
            asyncio.create_task(bus.request("test.slow.work", ControlCommand(command="status", reason=str(i)), ControlReply, timeout=10))
            for i in range(5)
        ]
        await asyncio.sleep(0.5)  # all five are in flight
        stats = json.loads((await bus.nc.request("$SRV.STATS.meshserve-slow", b"", timeout=1)).data)
        assert stats["endpoints"][0]["data"]["in_flight"] == 5
        proc.send_signal(signal.SIGTERM)
        replies = await asyncio.gather(*requests)
        assert sorted(r.message for r in replies) == [str(i) for i in range(5)]
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10) == 0
        # after the drain nobody answers
        with pytest.raises(NoResponders):
            await bus.request("test.slow.work", ControlCommand(command="status"), ControlReply, timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()


class NoJetStreamServer(NatsServer):
    """A nats-server without JetStream: its API has no responders, as in an election."""

    def config_text(self) -> str:
        text = super().config_text()
        start = text.index("jetstream {")
        return text[:start] + text[text.index("}\n", start) + 2:]


async def test_a_service_that_cannot_start_for_want_of_jetstream_comes_up_once_it_can(tmp_path: Path) -> None:
    # Under `meshserve up` nothing restarts a service that exits: one started while
    # JetStream is unavailable (a NATS node killed, a leader being elected) must keep
    # trying, and come up once JetStream answers (here: the server restarted with it).
    server: NatsServer = NoJetStreamServer(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    env = {**os.environ, "MESHSERVE_NATS_URL": server.url, "PYTHONPATH": str(ROOT)}
    log_path = tmp_path / "service.log"
    with open(log_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests/integration/slow_service.py")], env=env, cwd=ROOT, stderr=err)
    bus: Bus | None = None
    try:
        from tests.conftest import eventually

        retried = lambda: "for want of JetStream" in log_path.read_text()  # noqa: E731
        await eventually(lambda: retried() or proc.poll() is not None, timeout=60, what="the service to fail to start")
        assert proc.poll() is None, f"the service exited ({proc.returncode}):\n{log_path.read_text()}"
        retry_lines = [line for line in log_path.read_text().splitlines() if "for want of JetStream" in line]
        assert "starting it again in" in retry_lines[0]
        server.stop()
        server = NatsServer(store_dir=tmp_path / "nats", port=server.port, log_file=tmp_path / "nats.log").start()
        bus = await Bus.open(BusSettings(servers=(server.url,)), "test-client", initial_attempts=20)
        reply = None
        for _ in range(300):
            assert proc.poll() is None, f"the service exited ({proc.returncode}):\n{log_path.read_text()}"
            try:
                reply = await bus.request("test.slow.work", ControlCommand(command="status", reason="up"), ControlReply, timeout=5)
                break
            except NoResponders:
                await asyncio.sleep(0.2)
        assert reply is not None and reply.message == "up", log_path.read_text()
        assert (await bus.js.stream_info(bus.subjects.tokens_stream)).config.name  # it provisioned its streams
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30) == 0
    finally:
        if bus is not None:
            await bus.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


async def test_kv_event_batches_decode_on_the_far_side(bus: Bus) -> None:
    from proto import AllCleared, BlockRemoved, BlockStored

    got: list[KvEventBatch] = []
    done = asyncio.Event()

    async def collect(batch: KvEventBatch, msg: Msg) -> None:
        got.append(batch)
        done.set()

    await bus.subscribe(bus.subjects.kv_events_all, KvEventBatch, collect)
    batch = KvEventBatch(
        worker_id="w1", model="m", seq=3, ts=1.0,
        events=[BlockStored(block_hashes=[1, 2**64 - 1], parent_hash=None), BlockRemoved(block_hashes=[1]), AllCleared()],
    )
    await bus.publish(bus.subjects.kv_events("m", "w1"), batch)
    await asyncio.wait_for(done.wait(), 5)
    assert got == [batch]


async def test_three_node_cluster_serves_jetstream(nats_cluster: list[NatsServer]) -> None:
    settings = BusSettings(servers=tuple(n.url for n in nats_cluster), js_replicas=3)
    client = await Bus.open(settings, "cluster-client", initial_attempts=20)
    try:
        await provision(client.js, client.subjects, replicas=3)
        info = await client.js.stream_info("USAGE")
        assert info.config.num_replicas == 3 and info.cluster is not None
        await client.js_publish(client.subjects.usage("o"), TokenChunk(request_id="a", seq=0), msg_id="a")
    finally:
        await client.close()


async def test_remove_endpoint_stops_one_endpoint_and_keeps_the_service_listed(bus: Bus, bus_settings: BusSettings) -> None:
    from bus import Service

    class TwoEndpoints(Service):
        name = "twoendpoints"

        async def on_start(self) -> None:
            for name in ("a", "b"):
                await self.add_endpoint(name, f"t.two.{name}", ControlCommand, self.answer(name))

        def answer(self, name: str) -> Callable[[ControlCommand, Msg], Awaitable[None]]:
            async def handle(command: ControlCommand, msg: Msg) -> None:
                await self.bus.respond(msg, ControlReply(worker_id=name, state="ready"))

            return handle

    service = TwoEndpoints(bus_settings, provision_streams=False)
    await service.start()
    try:
        for name in ("a", "b"):
            assert (await bus.request(f"t.two.{name}", ControlCommand(command="status"), ControlReply)).worker_id == name
        assert await service.remove_endpoint("a")
        assert not await service.remove_endpoint("a")  # gone already
        with pytest.raises(NoResponders):
            # no-responders comes back at once; a long timeout only keeps a loaded machine
            # from turning a slow answer into a failure (a live subscription would time out)
            await bus.request("t.two.a", ControlCommand(command="status"), ControlReply, timeout=10)
        assert (await bus.request("t.two.b", ControlCommand(command="status"), ControlReply)).worker_id == "b"
        info = json.loads((await bus.nc.request("$SRV.INFO.meshserve-twoendpoints", b"", timeout=2)).data)
        assert [e["name"] for e in info["endpoints"]] == ["b"]
    finally:
        await service.drain_and_close()


async def test_a_worker_whose_connection_closes_leaves_the_registry_at_once(bus: Bus, bus_settings: BusSettings) -> None:
    # The server's disconnect advisory, not the 10 s heartbeat TTL, drops the worker; the
    # entry it left behind does not bring it back; a newer heartbeat (a restart) does.
    import time

    from bus.provision import workers_bucket
    from bus.registry import WorkerRegistry
    from proto import WorkerInfo, encode
    from tests.conftest import eventually

    registry = WorkerRegistry(bus, disconnect_grace_s=0.3)
    await registry.start()
    worker = await Bus.open(bus_settings, "w-gone")
    try:
        kv = await workers_bucket(worker.js, worker.subjects)
        left_behind = time.time()
        await kv.put("w-gone", encode(WorkerInfo(worker_id="w-gone", model="m", engine="sim", state="ready", heartbeat_at=left_behind)))
        await eventually(lambda: "w-gone" in registry.workers, what="the worker listed")
        await worker.close()  # its connection closes (kill -9 closes it the same way)
        await eventually(lambda: "w-gone" not in registry.workers, what="the worker dropped")
        assert registry.disconnect_deaths == 1  # by the advisory: its heartbeat is still fresh
        assert time.time() - left_behind < registry.ttl_s
        registry.restart_watch()  # replays the bucket, the dead worker's entry included
        await asyncio.sleep(0.5)
        assert "w-gone" not in registry.workers
        # it comes back (a restarted process under the same id): a newer heartbeat lists it again
        back = await Bus.open(bus_settings, "w-gone")
        try:
            kv = await workers_bucket(back.js, back.subjects)
            await kv.put("w-gone", encode(WorkerInfo(worker_id="w-gone", model="m", engine="sim", state="ready",
                                                      heartbeat_at=left_behind + 5)))
            await eventually(lambda: "w-gone" in registry.workers, what="the worker listed again")
        finally:
            await back.close()
    finally:
        await registry.stop()


async def test_a_restarted_registry_watch_leaves_no_subscription_and_reaps_only_after_its_replay(bus: Bus) -> None:
    """A watch restarted for silence (a busy machine) stayed subscribed, one more each
    time: at shutdown the connection's drain waited its 30 s timeout and ``up``'s Ctrl-C
    killed the service. And the reaper judged the heartbeats the stuck watch had left
    before the new one replayed the bucket: every worker dropped, the autoscaler scaled
    up from "0" beside the running ones."""
    import time

    from bus.provision import workers_bucket
    from bus.registry import WorkerRegistry
    from proto import WorkerInfo, encode
    from tests.conftest import eventually

    now = [time.time()]
    registry = WorkerRegistry(bus, clock=lambda: now[0])
    kv = await workers_bucket(bus.js, bus.subjects)
    await kv.put("w-busy", encode(WorkerInfo(worker_id="w-busy", model="m", engine="sim", state="ready",
                                             heartbeat_at=now[0])))
    await registry.start()
    try:
        await eventually(lambda: "w-busy" in registry.workers, what="the worker listed")
        subscriptions = len(bus.nc._subs)
        for _ in range(3):
            registry.restart_watch()
            await eventually(lambda: registry._replayed, what="the new watch replayed the bucket")
        assert len(bus.nc._subs) == subscriptions
        # The watch was stuck for two TTLs: what it holds is that old, the bucket is not.
        now[0] += 2 * registry.ttl_s
        await kv.put("w-busy", encode(WorkerInfo(worker_id="w-busy", model="m", engine="sim", state="ready",
                                                 heartbeat_at=now[0])))
        registry.restart_watch()
        assert registry.reap() == []  # not before the replay
        await eventually(lambda: registry.workers["w-busy"].heartbeat_at == now[0], what="the replay applied")
        assert registry.reap() == [] and "w-busy" in registry.workers
    finally:
        await registry.stop()


async def test_two_publishers_of_one_message_id_both_succeed(nats_cluster: list[NatsServer]) -> None:
    """Two publishers of one message (a worker and its gateway, the same usage event) race on
    an R3 stream: the one whose copy arrives while the other's is being stored gets a 409
    "duplicate message id is in process"; it asks again and gets the stored one's ack."""
    setup = await Bus.open(BusSettings(servers=tuple(n.url for n in nats_cluster)), "setup", initial_attempts=20)
    publishers: list[Bus] = []
    try:
        await provision(setup.js, setup.subjects, replicas=3)
        info = await setup.js.stream_info(setup.subjects.usage_stream)
        assert info.cluster is not None
        # One publisher on each follower of the stream's leader: their copies reach the
        # leader one hop away each, so one often arrives while the other is being replicated.
        followers = [n for n in nats_cluster if n.server_name != info.cluster.leader]
        publishers = [await Bus.open(BusSettings(servers=(node.url,)), f"publisher-{i}", initial_attempts=20)
                      for i, node in enumerate(followers)]
        ids = [f"race-{i}" for i in range(1500)]

        async def publish(bus: Bus, msg_id: str, until_stored: bool) -> None:
            event = TokenChunk(request_id=msg_id, seq=0)
            if until_stored:
                assert await bus.js_publish_until_stored(setup.subjects.usage("o"), event, msg_id=msg_id)
            else:
                await bus.js_publish(setup.subjects.usage("o"), event, msg_id=msg_id, attempts=1)

        # Each publisher uses each method for half the messages; neither raises nor gives up.
        # In rounds: the race is won by chance, and each round gives it many chances.
        for start in range(0, len(ids), 300):
            await asyncio.gather(*(publish(bus, msg_id, (i + j) % 2 == 0)
                                   for i, msg_id in enumerate(ids[start:start + 300]) for j, bus in enumerate(publishers)))
        info = await setup.js.stream_info(setup.subjects.usage_stream)
        assert info.state.messages == len(ids)  # each stored once
    finally:
        for client in (*publishers, setup):
            await client.close()


async def test_a_bucket_read_once_holds_every_live_entry_and_no_deleted_one(bus: Bus) -> None:
    from bus.keys import KeyStore
    from bus.mirror import live_entries
    from ops.keys import read_keys
    from services.gateway.apikeys import generate_key

    store = await KeyStore(bus).open()
    assert await live_entries(bus, store.kv) == [] and await store.list() == []
    records = [generate_key(org=f"org{i}")[1] for i in range(12)]
    for record in records:
        await store.put(record)
    await store.kv.delete(records[3].key_id)
    await store.kv.purge(records[5].key_id)
    await store.kv.put("00000000000f", b"\x00not a record")
    live = sorted(r.key_id for i, r in enumerate(records) if i not in (3, 5))
    # Read again and again, it never comes back short of a key.
    for _ in range(20):
        entries = await live_entries(bus, store.kv)
        assert [e.key for e in entries] == sorted([*live, "00000000000f"])
    assert sorted(r.key_id for r in await store.list()) == live
    listed, unreadable = await read_keys(store)
    assert sorted(r.key_id for r in listed) == live and unreadable == ["00000000000f"]


async def test_a_mirror_is_synced_only_once_it_holds_the_bucket(bus: Bus) -> None:
    from bus.keys import KeyStore
    from services.gateway.apikeys import generate_key

    empty = await KeyStore(bus).open()
    await empty.watch()  # an empty bucket is synced at once
    assert empty._synced.is_set() and empty.records == {}
    await empty.stop()
    records = [generate_key(org=f"org{i}")[1] for i in range(40)]
    for record in records:
        await empty.put(record)
    await empty.kv.delete(records[0].key_id)
    for _ in range(5):
        mirror = await KeyStore(bus).open()
        await mirror.watch()
        try:
            assert mirror._synced.is_set()
            assert sorted(mirror.records) == sorted(r.key_id for r in records[1:])
        finally:
            await mirror.stop()


def _emptied_after_its_sync_point(bus: Bus, kv: Any) -> None:
    """The bucket's every entry gone (expired, purged) just after a watcher read its sync
    point and before its watch began: the race made to happen on the real server."""
    real_status = kv.status
    calls = 0

    async def status() -> Any:
        nonlocal calls
        state = await real_status()
        calls += 1
        if calls == 1:
            await bus.js.purge_stream(state.stream_info.config.name)
        return state

    kv.status = status


async def test_a_mirror_whose_bucket_empties_as_it_starts_is_synced(bus: Bus) -> None:
    from bus.keys import KeyStore
    from services.gateway.apikeys import generate_key

    await (await KeyStore(bus).open()).put(generate_key(org="gone")[1])
    store = await KeyStore(bus).open()
    _emptied_after_its_sync_point(bus, store.kv)
    await store.watch()  # returns at its sync, or gives up waiting after 5 s
    try:
        assert store._synced.is_set() and store.records == {}
    finally:
        await store.stop()


async def test_a_registry_whose_bucket_empties_as_it_starts_is_synced(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from bus import registry as registry_module
    from bus.provision import workers_bucket
    from proto import WorkerInfo, encode

    kv = await workers_bucket(bus.js, bus.subjects)
    info = WorkerInfo(worker_id="w0", model="m", engine="sim", state="ready", heartbeat_at=time.time())
    await kv.put("w0", encode(info))
    _emptied_after_its_sync_point(bus, kv)

    async def the_same_bucket(*args: Any, **kwargs: Any) -> Any:
        return kv

    monkeypatch.setattr(registry_module, "workers_bucket", the_same_bucket)
    registry = registry_module.WorkerRegistry(bus)
    await registry.start()  # returns at its sync, or gives up waiting after 5 s
    try:
        assert registry.synced and registry.workers == {}
    finally:
        await registry.stop()


async def test_a_registry_is_synced_only_once_it_lists_the_bucket(bus: Bus) -> None:
    """A service's registry counts as synced when every worker entry has come through, not
    at nats-py's 'no more' marker (admission refuses 'no replica' until it is synced)."""
    import time

    from bus.provision import workers_bucket
    from bus.registry import WorkerRegistry
    from proto import WorkerInfo, encode

    kv = await workers_bucket(bus.js, bus.subjects)
    names = [f"w{i}" for i in range(30)]
    for name in names:
        await kv.put(name, encode(WorkerInfo(worker_id=name, model="m", engine="sim", state="ready",
                                             heartbeat_at=time.time())))
    await kv.delete(names[0])
    for _ in range(5):
        registry = WorkerRegistry(bus)
        await registry.start()
        try:
            assert registry.synced
            assert sorted(registry.workers) == sorted(names[1:])
        finally:
            await registry.stop()
