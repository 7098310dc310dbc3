"""ReplicaBook: who counts for the SLO check, cached prefixes, optimistic queue growth."""

from __future__ import annotations

from proto.hashing import block_hashes
from proto.messages import AdmissionRequest, WorkerState
from proto.workers import BlockStored, KvEventBatch, WorkerGauge, WorkerInfo
from services.admission.replicas import BookConfig, ReplicaBook

MODEL = "m"
PROMPT = list(range(16 * 6))
HASHES = block_hashes(PROMPT, 16)


def info(wid: str, state: WorkerState = "ready", started_at: float = 1.0, model: str = MODEL, **kw: object) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, model=model, engine="sim", state=state, started_at=started_at, **kw)  # type: ignore[arg-type]


def gauge(wid: str, ts: float, **kw: object) -> WorkerGauge:
    return WorkerGauge(worker_id=wid, model=MODEL, ts=ts, **kw)  # type: ignore[arg-type]


def req(**kw: object) -> AdmissionRequest:
    base: dict[str, object] = {"request_id": "r", "org": "o", "key_id": "k", "model": MODEL, "prompt_tokens": len(PROMPT),
                               "max_tokens": 10, "block_hashes": HASHES, "block_size": 16}
    base.update(kw)
    return AdmissionRequest(**base)  # type: ignore[arg-type]


def test_membership_from_the_registry_and_fresh_gauges() -> None:
    book = ReplicaBook(BookConfig(gauge_stale_s=5.0))
    book.update_worker(info("a"), 0.0)
    book.update_worker(info("b", state="draining"), 0.0)
    book.update_worker(info("c", state="starting"), 0.0)
    book.update_worker(info("d"), 0.0)
    book.update_worker(info("other", model="x"), 0.0)
    book.apply_gauge(gauge("a", 1.0, queued_prefill_tokens=300, prefill_tokens_per_s=5000.0, step_time_s=0.02), 0.0)
    book.apply_gauge(gauge("d", 1.0), 0.0)
    assert not book.apply_gauge(gauge("ghost", 1.0), 0.0)  # unregistered: ignored
    loads = {r.worker_id: r for r in book.loads(req(), 1.0)}
    assert set(loads) == {"a", "b", "d"}
    assert loads["b"].draining and not loads["a"].draining
    assert (loads["a"].prefill_tokens_per_s, loads["a"].step_time_s) == (5000.0, 0.02)
    assert loads["a"].queued_prefill_tokens == 0  # a second at 5,000 tokens/s drained its 300
    assert next(r for r in book.loads(req(), 0.0) if r.worker_id == "a").queued_prefill_tokens == 300
    # d's gauges stop: after gauge_stale_s it no longer counts; a, still reporting, does
    book.apply_gauge(gauge("a", 2.0), 5.5)
    assert {r.worker_id for r in book.loads(req(), 6.0)} == {"a", "b"}
    book.remove_worker("a")
    assert {r.worker_id for r in book.loads(req(), 6.0)} == {"b"}


def test_cached_prefix_from_kv_events_and_the_requests_hashes() -> None:
    book = ReplicaBook()
    book.update_worker(info("a"), 0.0)
    book.update_worker(info("b"), 0.0)
    book.apply_kv_events(KvEventBatch(worker_id="a", model=MODEL, seq=0, ts=0.0, events=[BlockStored(block_hashes=HASHES[:4])]), 0.0)
    assert book.apply_kv_events(KvEventBatch(worker_id="z", model=MODEL, seq=0, ts=0.0, events=[]), 0.0) is None
    loads = {r.worker_id: r.cached_tokens for r in book.loads(req(), 0.0)}
    assert loads == {"a": 64, "b": 0}
    # no hashes (the gateway did not know the block size): nothing cached is assumed
    assert {r.cached_tokens for r in book.loads(req(block_hashes=[], block_size=0), 0.0)} == {0}


def test_admissions_count_until_a_gauge_taken_after_them() -> None:
    book = ReplicaBook(BookConfig(settle_s=0.05, pending_max_age_s=2.0))
    book.update_worker(info("a"), 0.0)
    book.apply_gauge(gauge("a", 1.0, queued_prefill_tokens=100), 0.0)
    book.note_admitted("q1", "a", 500, 1.0)
    book.note_admitted("q2", "a", 200, 1.02)
    assert book.loads(req(), 1.03)[0].queued_prefill_tokens == 800
    book.apply_gauge(gauge("a", 2.0, queued_prefill_tokens=600), 1.06)  # includes the first only
    assert book.loads(req(), 1.06)[0].queued_prefill_tokens == 800
    book.apply_gauge(gauge("a", 3.0, queued_prefill_tokens=650), 1.2)
    assert book.loads(req(), 1.2)[0].queued_prefill_tokens == 650
    book.note_admitted("q3", "a", 300, 2.0)  # no gauge since: aged out after 2 s
    assert book.loads(req(), 3.0)[0].queued_prefill_tokens == 950
    assert book.loads(req(), 4.5)[0].queued_prefill_tokens == 650


def test_the_queue_drains_at_the_measured_rate_between_gauges() -> None:
    # Light load: a 600-token prompt admitted on an idle replica prefills in 60 ms at
    # 10k tokens/s; a request 100 ms later meets an empty queue, not 600 tokens of a
    # request long past its first token, though no gauge has come since.
    book = ReplicaBook(BookConfig(settle_s=0.05, pending_max_age_s=10.0))
    book.update_worker(info("a"), 0.0)
    book.apply_gauge(gauge("a", 1.0, queued_prefill_tokens=0, prefill_tokens_per_s=10_000.0), 0.0)
    book.note_admitted("q4", "a", 600, 0.2)
    assert book.loads(req(), 0.2)[0].queued_prefill_tokens == 600
    assert book.loads(req(), 0.23)[0].queued_prefill_tokens == 300
    assert book.loads(req(), 0.3)[0].queued_prefill_tokens == 0
    # FIFO from the gauge on: its queue drains first, each admission joins at its time
    book.apply_gauge(gauge("a", 2.0, queued_prefill_tokens=2000, prefill_tokens_per_s=10_000.0), 1.0)
    book.note_admitted("q5", "a", 1000, 1.1)  # 1000 of the gauge's 2000 left, then + 1000
    book.note_admitted("q6", "a", 500, 1.3)  # 2000 - 2000 drained since, + 500
    assert book.loads(req(), 1.3)[0].queued_prefill_tokens == 500
    assert book.loads(req(), 1.32)[0].queued_prefill_tokens == 300
    # no measured rate: nothing is taken to drain until a gauge says so
    book.update_worker(info("b"), 0.0)
    book.apply_gauge(gauge("b", 2.0, queued_prefill_tokens=100), 1.0)
    book.note_admitted("q7", "b", 400, 1.1)
    assert next(r for r in book.loads(req(), 5.0) if r.worker_id == "b").queued_prefill_tokens == 500


def test_lora_prefers_replicas_with_the_adapter() -> None:
    book = ReplicaBook()
    book.update_worker(info("a", lora_adapters=["sql"]), 0.0)
    book.update_worker(info("b"), 0.0)
    assert [r.worker_id for r in book.loads(req(lora="sql"), 0.0)] == ["a"]
    assert {r.worker_id for r in book.loads(req(lora="new"), 0.0)} == {"a", "b"}  # loaded on demand


def test_a_restarted_worker_loses_its_cache_and_queue() -> None:
    book = ReplicaBook()
    book.update_worker(info("a", started_at=1.0), 0.0)
    book.apply_kv_events(KvEventBatch(worker_id="a", model=MODEL, seq=0, ts=0.0, events=[BlockStored(block_hashes=HASHES)]), 0.0)
    book.apply_gauge(gauge("a", 1.0, queued_prefill_tokens=900), 0.0)
    book.update_worker(info("a", started_at=50.0), 0.0)
    (load,) = book.loads(req(), 0.0)
    assert (load.cached_tokens, load.queued_prefill_tokens) == (0, 0)


def test_admissions_on_their_way_stay_counted_until_a_gauge_names_them() -> None:
    # A loaded gateway takes longer than settle_s to hand a request on: gauges arriving
    # meanwhile do not hold it, and the burst admitted before them must still count.
    book = ReplicaBook(BookConfig(settle_s=0.05, pending_max_age_s=10.0))
    book.update_worker(info("a"), 0.0)
    book.apply_gauge(gauge("a", 1.0, queued_prefill_tokens=0, prefill_tokens_per_s=1_000.0, arrived=[]), 0.0)
    for i in range(3):
        book.note_admitted(f"burst{i}", "a", 1500, 1.0)
    book.apply_gauge(gauge("a", 2.0, queued_prefill_tokens=0, prefill_tokens_per_s=1_000.0, arrived=[]), 1.2)
    assert book.loads(req(), 1.2)[0].queued_prefill_tokens == 4500
    assert book.loads(req(), 1.25)[0].queued_prefill_tokens == 4450  # drained from the gauge on
    book.apply_gauge(gauge("a", 3.0, queued_prefill_tokens=4200, prefill_tokens_per_s=1_000.0,
                           arrived=["burst0", "burst1", "burst2"]), 1.3)
    assert book.loads(req(), 1.3)[0].queued_prefill_tokens == 4200
