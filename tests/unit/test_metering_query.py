"""Metering's query contract (proto.metering, services.common.usage) and the pure parts of the ledger module."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from proto import DecodeError, UsageEvent, decode, encode
from proto.metering import (
    UsageQuery,
    UsageReport,
    UsageRow,
    check_query,
)
from services.common.usage import org_usage_query, parse_time, usage_report_json
from services.metering.ledger import (
    MAX_TOKENS,
    InvalidEvent,
    PostgresLedger,
    SqliteLedger,
    entry_from_event,
    fold_totals,
    ledger_from_url,
    redact_url,
    totals_sql,
)
from services.metering.prices import ModelPrice, PriceTable

NOW = 1_750_000_000.0


# ---- times ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("-1h", NOW - 3600),
        ("-30m", NOW - 1800),
        ("-7d", NOW - 7 * 86400),
        ("-2w", NOW - 14 * 86400),
        ("-90s", NOW - 90),
        ("-1.5h", NOW - 5400),
        ("now", NOW),
        ("1700000000", 1_700_000_000.0),
        ("2025-01-01", 1_735_689_600.0),  # naive = UTC
        ("2025-01-01T01:00:00Z", 1_735_693_200.0),
        ("2025-01-01T02:00:00+01:00", 1_735_693_200.0),
    ],
)
def test_parse_time(text: str, expected: float) -> None:
    assert parse_time(text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "yesterday", "-1y", "1h", "nan", "inf", "2025-13-01",
                                  # no date names these: every report prints its window as dates
                                  "1700000000000", "1e20", "-1000000d"])
def test_parse_time_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError):
        parse_time(text, NOW)


# ---- queries --------------------------------------------------------------------------
def test_query_round_trip_and_defaults() -> None:
    query = UsageQuery(org="acme", since=1.0, until=2.0)
    again = decode(encode(query), UsageQuery)
    assert again == query
    assert again.group_by == ["org", "key", "model"] and again.limit == 1000
    # an empty query (all defaults) is valid: every org, all time
    assert decode(encode(UsageQuery()), UsageQuery) == UsageQuery()


def test_report_round_trip_and_total() -> None:
    rows = [
        UsageRow(org="a", requests=2, prompt_tokens=10, cached_tokens=4, completion_tokens=5, spend_nano=7,
                 by_status={"finished": 1, "cancelled": 1}, first_at=5.0, last_at=9.0),
        UsageRow(org="b", requests=1, prompt_tokens=1, completion_tokens=1, spend_nano=3,
                 by_status={"finished": 1}, first_at=2.0, last_at=3.0),
    ]
    report = decode(encode(UsageReport(rows=rows, group_by=["org"], currency="EUR")), UsageReport)
    assert report.rows == rows and report.currency == "EUR"
    total = report.total()
    assert (total.requests, total.prompt_tokens, total.cached_tokens, total.completion_tokens, total.spend_nano) == (
        3, 11, 4, 6, 10)
    assert total.by_status == {"finished": 2, "cancelled": 1}
    assert (total.first_at, total.last_at) == (2.0, 9.0)
    assert UsageRow(spend_nano=1_500_000_000).spend == 1.5


@pytest.mark.parametrize(
    "query",
    [
        UsageQuery(group_by=["org", "org"]),
        UsageQuery(group_by=["hour", "day"]),
        UsageQuery(since=10.0, until=5.0),
        UsageQuery(since=math.nan),
        UsageQuery(limit=0),
        UsageQuery(limit=10_001),
    ],
)
def test_check_query_refuses(query: UsageQuery) -> None:
    with pytest.raises(ValueError):
        check_query(query)


def test_unknown_group_by_does_not_decode() -> None:
    raw = msgspec.msgpack.encode({"v": 1, "group_by": ["org; DROP TABLE usage_events"]})
    with pytest.raises(DecodeError):
        decode(raw, UsageQuery)


def test_gateway_query_pins_the_callers_org() -> None:
    query = org_usage_query("acme", {"since": "-1d", "model": "m", "group_by": "org,model,day", "limit": "5"}, NOW)
    assert query.org == "acme" and query.model == "m" and query.limit == 5
    assert query.since == NOW - 86400 and query.until is None
    assert query.group_by == ["model", "day"]  # one org: grouping by it adds nothing
    assert org_usage_query("acme", {}, NOW).group_by == ["model"]
    # the key restriction from the gateway wins over the parameter
    assert org_usage_query("acme", {"key_id": "other"}, NOW, key_id="mine").key_id == "mine"
    for bad in ({"org": "evil"}, {"since": "soon"}, {"group_by": "colour"}, {"limit": "many"}, {"limit": "0"}):
        with pytest.raises(ValueError):
            org_usage_query("acme", bad, NOW)


def test_usage_report_json_shape() -> None:
    report = UsageReport(rows=[UsageRow(model="m", requests=1, spend_nano=1_234_567_891, by_status={"finished": 1})],
                         group_by=["model"], since=1.0)
    body = usage_report_json(report)
    assert body["object"] == "usage.report" and body["currency"] == "USD" and body["since"] == 1.0
    (row,) = body["data"]
    assert row["model"] == "m" and "org" not in row
    assert row["spend"] == 1.234567891 and row["spend_nano"] == 1_234_567_891
    msgspec.json.encode(body)  # serialisable as is
    by_region = usage_report_json(UsageReport(rows=[UsageRow(region="eu", requests=2)], group_by=["region"]))
    assert by_region["data"][0]["region"] == "eu"  # every dimension grouped by names its group


# ---- ledger entries -------------------------------------------------------------------
PRICES = PriceTable(models={"m": ModelPrice.of(input=1, cached_input="0.5", output=2)})


def event(**overrides: object) -> UsageEvent:
    fields: dict[str, object] = dict(request_id="r1", org="acme", key_id="k1", model="m", prompt_tokens=100,
                                     cached_tokens=40, completion_tokens=10, arrival_time=100.0, finish_time=110.0)
    fields.update(overrides)
    return UsageEvent(**fields)  # type: ignore[arg-type]


def test_entry_carries_every_event_field_and_the_charge() -> None:
    e = event(worker_id="w", tier="premium", status="cancelled", first_token_time=101.0, reserved_tokens=500,
              migrations=2, error="boom", user="end-user-7", metadata={"project": "x", "trace": "t-1"})
    entry = entry_from_event(e, PRICES, recorded_at=200.0, stream_seq=17)
    assert entry.usage_id == "r1#m2"  # proto.usage_dedup_id
    for name in msgspec.structs.fields(UsageEvent):
        if name.name != "v":
            assert getattr(entry, name.name) == getattr(e, name.name), name.name
    assert entry.schema_v == 1 and entry.ts == 110.0 and entry.recorded_at == 200.0 and entry.stream_seq == 17
    assert entry.spend_nano == 60 * 1000 + 40 * 500 + 10 * 2000
    assert (entry.price_input_nano, entry.price_cached_nano, entry.price_output_nano) == (10**9, 5 * 10**8, 2 * 10**9)


def test_entry_time_falls_back_to_arrival_then_recording() -> None:
    assert entry_from_event(event(finish_time=0.0), PRICES, recorded_at=300.0).ts == 100.0
    assert entry_from_event(event(finish_time=0.0, arrival_time=0.0), PRICES, recorded_at=300.0).ts == 300.0
    nan = entry_from_event(event(finish_time=math.nan, arrival_time=math.inf), PRICES, recorded_at=300.0)
    assert nan.ts == 300.0 and nan.finish_time == 0.0 and nan.arrival_time == 0.0


def test_entry_strips_nul_characters() -> None:
    entry = entry_from_event(event(org="ac\x00me", error="a\x00b", user="u\x001", metadata={"k\x00": "v\x00"}),
                             PRICES, recorded_at=1.0)
    assert entry.org == "acme" and entry.error == "ab" and entry.user == "u1" and entry.metadata == {"k": "v"}


def test_entry_takes_metadata_at_openais_limits() -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert entry_from_event(event(metadata=metadata), PRICES, recorded_at=1.0).metadata == metadata


@pytest.mark.parametrize(
    "bad",
    [
        {"request_id": ""},
        {"prompt_tokens": -1},
        {"cached_tokens": -5},
        {"completion_tokens": MAX_TOKENS + 1},
        {"reserved_tokens": -1},
        {"migrations": -1},
        {"org": "o" * 5000},
        {"user": "u" * 5000},
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"k": "v" * 513}},
        {"metadata": {"k": "1", "k\x00": "2"}},  # the same key once NUL is stripped
    ],
)
def test_invalid_events_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidEvent):
        entry_from_event(event(**bad), PRICES, recorded_at=1.0)


# ---- SQL building and folding ---------------------------------------------------------
def test_totals_sql_binds_values_and_whitelists_dimensions() -> None:
    q = totals_sql(org="o'; --", key_id=None, model="m", since=1.0, until=None, group_by=["key", "day"],
                   placeholder=lambda i: f"${i}", bucket_expr=lambda s: f"B{s}")
    assert q.params == ["o'; --", "m", 1.0]
    assert "o'; --" not in q.sql
    assert "org = $1 AND model = $2 AND ts >= $3" in q.sql
    assert q.sql.endswith("GROUP BY key_id, B86400, status")
    with pytest.raises(ValueError):
        totals_sql(org=None, key_id=None, model=None, since=None, until=None, group_by=["ts; DROP"],
                   placeholder=lambda i: "?", bucket_expr=lambda s: "")


def test_fold_totals_merges_statuses_into_one_row_per_group() -> None:
    records = [  # dims, status, rows, requests (first segments), sums, first and last time
        ("b", "finished", 2, 2, 20, 5, 8, 100, 10.0, 20.0),
        ("a", "finished", 1, 1, 10, 0, 4, 50, 5.0, 5.0),
        ("b", "cancelled", 1, 1, 7, 0, 1, 9, 30.0, 30.0),
        ("b", "migrated", 1, 0, 0, 0, 2, 3, 15.0, 15.0),  # a later segment of one of b's requests
    ]
    rows = fold_totals(records, ["org"])
    assert [r.org for r in rows] == ["a", "b"]
    b = rows[1]
    assert (b.requests, b.prompt_tokens, b.cached_tokens, b.completion_tokens, b.spend_nano) == (3, 27, 5, 11, 112)
    assert b.by_status == {"finished": 2, "cancelled": 1, "migrated": 1} and (b.first_at, b.last_at) == (10.0, 30.0)
    assert b.key_id is None and b.model is None


# ---- ledger URLs ----------------------------------------------------------------------
def test_ledger_from_url() -> None:
    default = ledger_from_url(None)
    assert isinstance(default, SqliteLedger) and default.path == Path(".meshserve/ledger.sqlite3")
    rel = ledger_from_url("sqlite:///data/l.db")
    assert isinstance(rel, SqliteLedger) and rel.path == Path("data/l.db")
    absolute = ledger_from_url("sqlite:////var/lib/meshserve/l.db")
    assert isinstance(absolute, SqliteLedger) and absolute.path == Path("/var/lib/meshserve/l.db")
    plain = ledger_from_url("/tmp/x.sqlite3")
    assert isinstance(plain, SqliteLedger) and plain.path == Path("/tmp/x.sqlite3")
    pg = ledger_from_url("postgresql://u:secret@db:5432/billing")
    assert isinstance(pg, PostgresLedger) and "secret" not in pg.url
    assert isinstance(ledger_from_url("postgres://db/billing"), PostgresLedger)
    for bad in ("mysql://db/x", "sqlite://relative", "sqlite:///"):
        with pytest.raises(ValueError):
            ledger_from_url(bad)


def test_redact_url() -> None:
    assert redact_url("postgresql://u:pw@h:5/d") == "postgresql://u:***@h:5/d"
    assert redact_url("postgresql://h/d") == "postgresql://h/d"


# ---- the service's command line -------------------------------------------------------
def parse_serve_args(*argv: str) -> Any:
    import argparse

    from services.metering import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_arguments_build_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.metering.main import build_config

    prices = tmp_path / "prices.json"
    prices.write_text('{"currency": "EUR", "models": {"m": {"input": 1}}}')
    monkeypatch.setenv("MESHSERVE_LEDGER_URL", "postgresql://db/billing")
    monkeypatch.setenv("MESHSERVE_PRICES", str(prices))
    config = build_config(parse_serve_args("--batch-size", "128", "--ack-wait", "12"))
    assert config.ledger_url == "postgresql://db/billing" and config.prices.currency == "EUR"
    assert (config.batch_size, config.ack_wait_s, config.durable) == (128, 12.0, "metering")
    # the command line wins over the environment
    assert build_config(parse_serve_args("--ledger-url", "/x.db")).ledger_url == "/x.db"
    monkeypatch.delenv("MESHSERVE_LEDGER_URL")
    monkeypatch.delenv("MESHSERVE_PRICES")
    defaults = build_config(parse_serve_args())
    assert defaults.ledger_url is None and defaults.prices.currency == "USD"


@pytest.mark.parametrize(
    "argv",
    # (--batch-size 0 and --ack-wait 0 are the parser's: tests/unit/test_cli_arguments.py)
    [("--ledger-url", "mysql://db/x"), ("--max-ack-pending", "10"), ("--prices", "/nonexistent/prices.toml")],
)
def test_serve_refuses_bad_arguments_before_connecting(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    from services.metering.main import run

    assert run(parse_serve_args(*argv)) == 2
    assert "meshserve serve metering:" in capsys.readouterr().err


def test_meshserve_usage_arguments() -> None:
    from ops.cli import build_parser
    from ops.usage import build_query, render

    # "-1h" must reach parse_time, not be taken for an option
    args = build_parser().parse_args(["usage", "--since", "-1h", "--until", "-30m", "--group-by", "org,day"])
    query = build_query(args, NOW)
    assert (query.since, query.until, query.group_by) == (NOW - 3600, NOW - 1800, ["org", "day"])
    whole = build_query(build_parser().parse_args(["usage", "--group-by", ""]), NOW)
    assert whole.group_by == [] and whole.since is None
    with pytest.raises(ValueError):
        build_query(build_parser().parse_args(["usage", "--group-by", "org,colour"]), NOW)
    report = UsageReport(rows=[UsageRow(org="a", bucket=NOW, requests=3, spend_nano=2_500_000,
                                        by_status={"finished": 2, "failed": 1})], group_by=["org", "day"])
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render(report))
    text = console.export_text()
    assert "2025-06-15" in text and "0.002500" in text and "failed=1 finished=2" in text
