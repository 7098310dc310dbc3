"""Every CLI table keeps every number, whatever the width: to a file (not a terminal) and on
a terminal narrower than the table. Rich used to squeeze columns to ``…``, so
``meshserve bench > file`` lost every latency and ``status``/``usage`` were cut at 80."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ops.bench.report import (
    compare_table,
    latency_table,
    queueing_picture,
    render,
    render_compare,
    throughput_table,
)
from ops.bench.results import BenchResult, ClientHealth, Dist, RunResult, SLOSpec, Summary
from ops.console import print_table
from ops.keys import keys_table
from ops.plan.model import make_plan
from ops.status import print_status
from ops.usage import render as usage_table
from proto import ApiKeyRecord
from proto.autoscaler import (
    AutoscalerStatus,
    DecisionRecord,
    DriverInfo,
    PoolSignals,
    PoolStatus,
    WorkerView,
)
from proto.metering import UsageReport, UsageRow

WIDTHS = (60, 120)
CONSOLES = [(w, tty) for w in WIDTHS for tty in (False, True)]


def console(width: int, tty: bool) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=tty, color_system=None, highlight=False)


def output(c: Console) -> str:
    return c.file.getvalue()  # type: ignore[attr-defined]


def numbers(table: Table) -> list[str]:
    """Every cell (and footer) of ``table`` that holds a digit, as it reads on screen."""
    cells: list[Any] = [cell for column in table.columns for cell in column.cells]
    if table.show_footer:
        cells += [column.footer for column in table.columns]
    plain = [Text.from_markup(c).plain if isinstance(c, str) else c.plain for c in cells if isinstance(c, str | Text)]
    return [p for p in plain if re.search(r"\d", p)]


def assert_whole(text: str, expected: list[str]) -> None:
    assert "…" not in text
    flat = re.sub(r"\s+", " ", text)
    missing = [e for e in expected if e not in text and e not in flat]
    assert not missing, f"cut from the output: {missing}\n{text}"


# ---- bench ---------------------------------------------------------------------------


def _dist(base: float) -> Dist:
    return Dist(n=100, mean=base * 1.1, p50=base, p90=base * 1.5, p95=base * 1.7, p99=base * 2.1, min=1.0, max=base * 3)


def bench_result(label: str = "a", scale: float = 1.0) -> BenchResult:
    runs = []
    for rate in (2.0, 4.0, 8.0):
        summary = Summary(
            requests=100, ok=99, errors={"429": 1}, duration_s=50, offered_rate=rate, request_throughput=rate * 0.99,
            input_token_throughput=1234.5, output_token_throughput=456.7, goodput=rate * 0.9, slo_met=90,
            slo_attainment=0.9, slo_holds=True, ttft_ms=_dist(55.123 * rate * scale), tpot_ms=_dist(12.345 * scale),
            itl_ms=_dist(11.1), e2e_ms=_dist(1234.5 * rate))
        runs.append(RunResult(endpoint="mesh-gateway", target="nats://x", api="chat", mode="open-loop",
                              arrival="poisson", rate=rate, load=f"poisson {rate:g} req/s", summary=summary,
                              client=ClientHealth(lag_ms=_dist(0.5))))
    return BenchResult(label=label, runs=runs, slo=SLOSpec(ttft_s=1.0), knees={"mesh-gateway": 8.0})


@pytest.mark.parametrize(("width", "tty"), CONSOLES)
def test_bench_tables_keep_every_number(width: int, tty: bool) -> None:
    result = bench_result()
    c = console(width, tty)
    render(result, c)
    picture = queueing_picture(result)
    assert picture is not None
    expected = numbers(latency_table(result)) + numbers(throughput_table(result)) + numbers(picture)
    assert "10370" in expected and "55.1" not in expected  # the figures the issue saw cut (E2E p99, TTFT)
    assert_whole(output(c), expected)


@pytest.mark.parametrize(("width", "tty"), CONSOLES)
def test_bench_compare_keeps_every_number(width: int, tty: bool) -> None:
    results = [bench_result("before"), bench_result("after", scale=0.8)]
    c = console(width, tty)
    render_compare(results, c)
    assert_whole(output(c), numbers(compare_table(results)))


# ---- status, usage, keys, plan ------------------------------------------------------


def autoscaler_status() -> AutoscalerStatus:
    signals = PoolSignals(waiting_tokens=123_456, running_tokens=654_321, replica_token_capacity=98_765.0,
                          capacity_source="measured", needed=7, warm_buffer=1, floor=2, window_max=9,
                          cooldown_remaining_s=42.0, idle_s=17.0, prefill_tokens_per_s=8_123.0,
                          decode_tokens_per_s=2_345.0, queue_drain_s=13.5)
    workers = [WorkerView(worker_id=f"worker-{i}-long-identifier", state="ready", running=11 + i, waiting=3,
                          running_tokens=45_678 + i, queued_prefill_tokens=7_654, kv_usage=0.83, gauge_age_s=0.4,
                          managed=True) for i in range(2)]
    decisions = [DecisionRecord(at=1_700_000_000.0, action="scale_up", current=3, ready=3, desired=5, target=5,
                                reason="waiting tokens 123,456 exceed 3 replicas × 98,765 capacity at 80 % utilisation",
                                outcome="started 2")]
    pool = PoolStatus(pool="org/model-with-a-long-name", min_replicas=1, max_replicas=12, current=3, desired=5, ready=3,
                      starting=1, draining=0, pending_requests=27, signals=signals, last_reason="scale up",
                      workers=workers, decisions=decisions)
    return AutoscalerStatus(instance_id="autoscaler-1", at=1_700_000_000.0, tick_s=1.0,
                            driver=DriverInfo(name="local", ok=True, message="ok"), pools=[pool])


@pytest.mark.parametrize(("width", "tty"), [(80, False), (80, True), (60, True)])
def test_status_keeps_every_number(width: int, tty: bool) -> None:
    c = console(width, tty)
    print_status(autoscaler_status(), c)
    assert_whole(output(c), ["777,777", "98,765 (measured)", "1–12", "27", "8,123", "2,345", "13.5 s", "42 s",
                             "45,678", "45,679", "7,654", "83%", "0.4 s", "3 → 5", "started 2", "123,456"])


@pytest.mark.parametrize(("width", "tty"), CONSOLES)
def test_usage_keeps_every_number(width: int, tty: bool) -> None:
    rows = [UsageRow(org=f"org-{i}", key_id=f"k{i:011d}", model="meta-llama/Llama-3.1-8B-Instruct", requests=12_345 + i,
                     prompt_tokens=9_876_543 + i, cached_tokens=1_234_567, completion_tokens=3_456_789,
                     spend_nano=123_456_789_000 + i, by_status={"finished": 12_000, "failed": 345 + i}) for i in range(3)]
    table = usage_table(UsageReport(rows=rows, group_by=["org", "key", "model"]))
    c = console(width, tty)
    print_table(c, table)
    assert_whole(output(c), numbers(table))


@pytest.mark.parametrize(("width", "tty"), CONSOLES)
def test_keys_list_keeps_every_number(width: int, tty: bool) -> None:
    records = [ApiKeyRecord(key_id=f"{i:012x}", key_hash="h", org="acme-corporation", tier="standard",
                            name="a long descriptive key name", rpm=600 + i, tpm=200_000 + i, max_concurrent=40 + i,
                            models=["m1", "m2"])
               for i in range(3)]
    records.append(ApiKeyRecord(key_id="00000000000b", key_hash="h", org="acme", rpm=-5))
    table = keys_table(records, ["00000000000c"])
    c = console(width, tty)
    print_table(c, table)
    text = output(c)
    assert_whole(text, numbers(table))
    assert "invalid limit rpm -5" in re.sub(r"\s+", " ", text) and "unreadable record" in text


@pytest.mark.parametrize(("width", "tty"), CONSOLES)
def test_plan_keeps_every_number(width: int, tty: bool) -> None:
    from ops.plan.model import PlanInputs, load_model
    from ops.plan.presets import lookup_gpu
    from ops.plan.report import curve_table, sizing_table
    from ops.plan.report import render as render_plan

    plan = make_plan(PlanInputs(model=load_model("qwen2.5-14b"), gpu=lookup_gpu("H100"), rate=40.0, context_tokens=4096))
    c = console(width, tty)
    render_plan(plan, c)
    assert_whole(output(c), numbers(sizing_table(plan)) + numbers(curve_table(plan)))


# ---- --help names --json --------------------------------------------------------------


@pytest.mark.parametrize("argv", [["bench"], ["status"], ["usage"], ["keys", "list"]])
def test_help_names_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main

    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    assert "--json" in capsys.readouterr().out
