"""The migration planner: stay on a live worker, give up at the limit, or move with the right
cut-off, the right next segment and the lost segment billed once."""

from __future__ import annotations

import asyncio

import msgspec

from proto import GenerateRequest, RequestProbeReply, SamplingParams, TokenChunk, pack_tokens, unpack_tokens
from services.gateway.migration import (
    REPLICA_POLL_S,
    GiveUp,
    Migrate,
    MigrationLimits,
    Segment,
    Stay,
    plan_migration,
    replica_wait,
)
from services.gateway.streams import RequestStream

LIMITS = MigrationLimits(stall_timeout_s=30.0, max_migrations=2)


def _generate(migrations: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id="r1", model="m", prompt=pack_tokens([1, 2, 3]), sampling=SamplingParams(max_tokens=50),
                           token_subject="t", gateway_id="g", org="o", key_id="k", tier="premium",
                           reserved_tokens=53, migrations=migrations, arrival_time=100.0)


def _segment(migrations: int = 0, next_seq: int = 5, received: tuple[int, ...] = (7, 8, 9, 10, 11),
             segment_tokens: int = 5, retired: dict[str, int] | None = None) -> Segment:
    return Segment(generate=_generate(migrations), worker_id="w-old", next_seq=next_seq, received_tokens=list(received),
                   segment_tokens=segment_tokens, prompt_tokens=3, retired=retired or {})


def _probe(state: str, engine_idle_s: float = 0.1) -> RequestProbeReply:
    return RequestProbeReply(worker_id="w-old", request_id="r1", state=state, since_output_s=40.0,  # type: ignore[arg-type]
                             engine_idle_s=engine_idle_s)


def _plan(segment: Segment, *, registered: bool = True, probe: RequestProbeReply | None = None) -> Stay | GiveUp | Migrate:
    return plan_migration(segment, LIMITS, worker_registered=registered, silent_s=31.0, probe=probe, now=200.0)


def test_a_request_queued_on_a_live_worker_stays() -> None:
    assert _plan(_segment(), probe=_probe("waiting")) == Stay(waited_s=40.0)


def test_no_answer_an_unknown_request_or_an_idle_engine_means_migrate() -> None:
    for probe in (None, _probe("unknown"), _probe("running"), _probe("waiting", engine_idle_s=31.0)):
        plan = _plan(_segment(), probe=probe)
        assert isinstance(plan, Migrate) and "stalled: no tokens for 31s" in plan.why


def test_a_gone_worker_migrates_whatever_the_probe() -> None:
    plan = _plan(_segment(), registered=False, probe=_probe("waiting"))
    assert isinstance(plan, Migrate) and "is gone" in plan.why


def test_the_limit_gives_up() -> None:
    plan = _plan(_segment(migrations=2), registered=False)
    assert isinstance(plan, GiveUp) and "limit 2" in plan.message
    # the lost worker never reports its segment: the gateway bills what the client got
    assert plan.retire == "w-old" and plan.lost_usage_id == "r1#m2"
    assert plan.lost_usage.status == "failed" and plan.lost_usage.completion_tokens == 5
    assert plan.lost_usage.prompt_tokens == 0 and plan.lost_usage.reserved_tokens == 0  # billed with the first segment
    assert isinstance(_plan(_segment(migrations=1), registered=False), Migrate)


def test_the_cutoff_is_the_first_sequence_number_the_client_lacks() -> None:
    """The client got seq 0..4: the old worker's seq 5 on is void and the new worker starts at 5
    with the five tokens as prior output. One off either way loses or repeats a chunk."""
    plan = _plan(_segment(next_seq=5), registered=False)
    assert isinstance(plan, Migrate)
    assert plan.cutoff == 5 and plan.generate.first_seq == 5
    assert unpack_tokens(plan.generate.prior_output) == [7, 8, 9, 10, 11]
    assert plan.generate.migrations == 1 and plan.retire == "w-old"

    async def relay() -> list[tuple[str, int]]:
        stream = RequestStream("r1", "t", next_seq=0)
        for seq in range(5):
            stream.deliver(TokenChunk(request_id="r1", seq=seq, token_ids=[seq], worker_id="w-old"))
        stream.retire(plan.retire, plan.cutoff)
        stream.deliver(TokenChunk(request_id="r1", seq=5, token_ids=[99], worker_id="w-old"))  # void: too late
        stream.deliver(TokenChunk(request_id="r1", seq=plan.generate.first_seq, token_ids=[5], worker_id="w-new"))
        got = []
        while (chunk := stream.get_nowait()) is not None:
            got.append((chunk.worker_id, chunk.seq))
        return got

    assert asyncio.run(relay()) == [("w-old", s) for s in range(5)] + [("w-new", 5)]


def test_the_first_lost_segment_bills_prompt_and_reservation_later_ones_only_output() -> None:
    first = _plan(_segment(migrations=0), registered=False)
    assert isinstance(first, Migrate)
    event = first.lost_usage
    assert (event.prompt_tokens, event.completion_tokens, event.reserved_tokens) == (3, 5, 53)
    assert (event.status, event.worker_id, event.migrations, event.finish_time) == ("migrated", "w-old", 0, 200.0)
    assert first.lost_usage_id == "r1"
    later = _plan(_segment(migrations=1, segment_tokens=2, retired={"w-first": 3}), registered=False)
    assert isinstance(later, Migrate)
    assert (later.lost_usage.prompt_tokens, later.lost_usage.completion_tokens, later.lost_usage.reserved_tokens) == (0, 2, 0)
    assert later.lost_usage_id == "r1#m1"
    assert later.exclude_workers == ["w-first", "w-old"]


def test_n_choices_continue_each_from_its_own_tokens() -> None:
    generate = msgspec.structs.replace(_generate(), sampling=SamplingParams(max_tokens=50, n=3, seed=4))
    segment = Segment(generate=generate, worker_id="w-old", next_seq=9, received_tokens=[1, 2, 3, 4, 5],
                      segment_tokens=5, prompt_tokens=3, retired={}, choice_tokens={0: [1, 2], 2: [3, 4, 5]},
                      finished_choices=[2])
    plan = _plan(segment, registered=False)
    assert isinstance(plan, Migrate)
    nxt = plan.generate
    assert [unpack_tokens(p) for p in nxt.prior_outputs] == [[1, 2], [], [3, 4, 5]]
    assert nxt.finished_choices == [2] and nxt.prior_output == b"" and nxt.first_seq == 9
    assert plan.lost_usage.completion_tokens == 5  # every choice's streamed tokens, billed once


def test_a_migration_that_finds_no_replica_waits_for_one_up_to_the_limit() -> None:
    # No replica ready (a 1-worker pool whose worker restarts): ask again, at most every
    # REPLICA_POLL_S, until the wait limit; other placement errors fail at once.
    assert replica_wait("no_capacity", 0.0, 15.0) == REPLICA_POLL_S
    assert replica_wait("unknown_model", 3.0, 15.0) == REPLICA_POLL_S
    assert replica_wait("no_capacity", 14.5, 15.0) == 0.5
    assert replica_wait("no_capacity", 15.0, 15.0) is None
    assert replica_wait("no_capacity", 0.0, 0.0) is None  # --migration-wait 0: the old behaviour
    assert replica_wait("bad_request", 0.0, 15.0) is None
    assert replica_wait("timeout", 0.0, 15.0) is None
