"""A sweep through the CLI writes JSON with raw timings, prints the tables, draws the
plots; ``--compare`` puts result files side by side."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from ops.bench.cli import add_parser
from ops.bench.results import load_result


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return int(args.func(args))


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # rich tables unwrapped in captured output


def test_sweep_json_table_plots_and_compare(http_server: Any, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--target", f"fake={http_server.base_url}", "--model", "sim", "-n", "8",
              "--input-tokens", "uniform:20:60", "--output-tokens", "5", "--slo-ttft", "0.5",
              "--slo-tpot", "0.05", "--request-timeout", "10"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert bench([*common, "--rates", "10,20", "--out", str(a), "--label", "A", "--api-key", "sk-secret"]) == 0
    out = capsys.readouterr().out
    for heading in ("Latency (ms)", "Throughput and goodput", "Queueing picture", "goodput knee"):
        assert heading in out
    assert "poisson 10 req/s" in out and "poisson 20 req/s" in out and "knee" in out

    result = load_result(a / "results.json")
    assert result.label == "A" and [r.rate for r in result.runs] == [10.0, 20.0]
    assert result.knees == {"fake": 20.0}  # 200 ms TTFT meets a 500 ms SLO at both rates
    assert result.config["endpoints"][0]["api_key"] == "***"
    assert b"sk-secret" not in (a / "results.json").read_bytes()  # secrets never reach files
    assert http_server.served[0].headers["Authorization"] == "Bearer sk-secret"
    for run in result.runs:
        assert run.summary.ok == 8 and len(run.requests) == 8
        assert all(len(r.chunk_s) == 5 and r.ttft_s is not None for r in run.requests)
        assert run.client.loop == "uvloop" and run.client.lag_ms.n > 0
    assert result.client_lagged == any(r.client.lagged for r in result.runs)
    for name in ("ttft_vs_load.png", "tpot_vs_load.png", "ttft_cdf.png", "goodput_vs_load.png"):
        png = a / name
        assert png.exists() and png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Same arrivals and prompts, tighter SLO: no knee; then compare the two files.
    assert bench([*common[:-6], "--slo-ttft", "0.1", "--request-timeout", "10", "--rates", "10",
                  "--out", str(b), "--label", "B", "--no-plots", "--no-progress"]) == 0
    assert "none — the SLO fails" in capsys.readouterr().out
    assert load_result(b / "results.json").knees == {"fake": None}

    cmp_dir = tmp_path / "cmp"
    assert bench(["--compare", str(a / "results.json"), str(b / "results.json"), "--out", str(cmp_dir)]) == 0
    out = capsys.readouterr().out
    assert "Comparison" in out and "A:fake" in out and "B:fake" in out and "ratio" in out
    assert "TTFT p99 ms" in out and "×" in out
    assert (cmp_dir / "compare_ttft_vs_load.png").stat().st_size > 1000
    assert bench(["--compare", str(a / "results.json")]) == 2


def test_cli_rejects_bad_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(["--rates", "1"]) == 2  # no target
    assert bench(["--target", "ftp://x", "--rates", "1"]) == 2
    assert bench(["--target", "http://x/v1", "--rates", "1", "--concurrency", "2"]) == 2
    assert bench(["--target", "http://x/v1", "--workload", "trace"]) == 2
    assert bench(["--target", "nats://127.0.0.1:1", "--model", "m", "-n", "1"]) == 1  # unreachable: a runtime failure
    assert "meshserve bench:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench(["--rates", "fast"])


def test_closed_loop_is_labelled(http_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(["--target", http_server.base_url, "--concurrency", "1,2", "-n", "4",
                  "--input-tokens", "10", "--output-tokens", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "CLOSED LOOP" in out and "closed-loop c=1" in out and "closed-loop c=2" in out


def test_json_prints_the_result_and_the_comparison_for_scripts(http_server: Any, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    argv = ["--target", f"fake={http_server.base_url}", "--model", "sim", "-n", "4", "--rates", "20",
            "--input-tokens", "20", "--output-tokens", "3", "--no-progress", "--no-plots", "--json"]
    assert bench([*argv, "--out", str(tmp_path / "a"), "--label", "A"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # stdout holds the JSON alone: no table, no "results:" line
    assert data["label"] == "A" and data["runs"][0]["summary"]["ok"] == 4
    assert load_result(tmp_path / "a" / "results.json").runs[0].summary.ok == 4
    assert bench([*argv, "--out", str(tmp_path / "b"), "--label", "B"]) == 0
    capsys.readouterr()
    assert bench(["--compare", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                  "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert compared["results"] == ["A", "B"]
    ttft = next(r for r in compared["rows"] if r["metric"] == "TTFT p99 ms")
    assert set(ttft["values"]) == {"A:fake", "B:fake"} and set(ttft["ratios"]) == {"B:fake"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--input-tokens", "zipf:1"], "bad distribution 'zipf:1': expected e.g. 512"),
    (["--input-tokens", "normal:inf:1"], "bad distribution 'normal:inf:1': its numbers must be finite"),
    (["--input-tokens", "1e12"], "more than 10,000,000 tokens"),
    (["--output-tokens", "exponential:-5"], "must not be negative"),
    (["--think-time", "nan"], "its numbers must be finite"),
    (["--turns", "1e6"], "more than 10,000 turns a session"),
    (["--prefix-groups", "0"], "--prefix-groups"),
    (["--cooldown", "nan"], "--cooldown"),
])
def test_bad_workload_arguments_fail_before_anything_connects(argv: list[str], message: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench(["--target", "http://127.0.0.1:9/v1", "-n", "1", *argv])  # port 9: nothing answers
    assert info.value.code == 2
    assert message in capsys.readouterr().err
