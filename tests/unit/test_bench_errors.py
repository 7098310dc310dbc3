"""``meshserve bench`` reports bad input and failures as one line, never a traceback:
user text is never read as rich markup, every file and option named in its message."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from ops.bench.cli import add_parser, config_from_args
from ops.bench.config import BenchConfig, EndpointConfig, WorkloadConfig
from ops.bench.report import compare_table, render
from ops.bench.results import BenchResult, RequestResult, RunResult, Summary
from ops.bench.runner import _warnings, run_bench, run_loop
from ops.bench.targets import PASS_KEY, NatsTarget
from ops.bench.workload import parse_trace
from ops.cli import main

DEAD_HTTP = "http://127.0.0.1:1/v1"  # nothing listens on port 1
REPO = Path(__file__).resolve().parents[2]


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``meshserve bench ARGV``; stderr must be one line."""
    code = main(["bench", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 1, err
    return code, err


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def trace_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ 1: markup in user text


def test_a_target_with_brackets_is_shown_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = bench(capsys, "--target", "x[/]", "-n", "1")
    assert code == 2
    assert err.startswith("meshserve bench: ") and "'x[/]'" in err


def test_a_compare_path_with_brackets_is_shown_as_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = bench(capsys, "--compare", str(tmp_path / "x[/].json"), str(tmp_path / "y.json"))
    assert code == 2 and f"{tmp_path / 'x[/].json'}" in err


def test_a_trace_path_with_brackets_keeps_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = bench(capsys, "--target", DEAD_HTTP, "--trace", "runs/[a]/x.jsonl")
    assert code == 2 and "--trace runs/[a]/x.jsonl: not a readable file" in err


def test_an_out_path_with_brackets_is_printed_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "[a]"
    code = main(["bench", "--target", DEAD_HTTP, "--model", "m", "-n", "1", "--no-progress", "--no-plots",
                 "--input-tokens", "4", "--output-tokens", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1 and "no request succeeded" in captured.err  # port 1 refuses the request
    assert f"results: {out / 'results.json'}" in captured.out


def test_labels_and_server_errors_are_not_markup() -> None:
    """A label, a load or a server's message with brackets reaches the progress bar, the
    tables and the warnings as text."""
    config = BenchConfig(endpoints=[EndpointConfig(DEAD_HTTP, label="a[/]", model="m[/b]")],
                         workload=WorkloadConfig(input_tokens="4", output_tokens="2"),
                         num_requests=1, request_timeout=5, progress=True)
    progress = io.StringIO()
    result = run_loop(run_bench(config, console=Console(file=progress, width=200)))
    assert "a[/]" in progress.getvalue()
    run = result.runs[0]
    run.requests[0].error = "model 'm[/b]' [bold]not found[/]"
    run.warnings = _warnings(run)
    out = io.StringIO()
    render(result, Console(file=out, width=300))
    text = out.getvalue()
    assert "a[/]" in text and "'m[/b]' [bold]not found[/]" in text
    other = BenchResult(label="y[/]", runs=result.runs)
    result.label = "x[/]"
    out = io.StringIO()
    Console(file=out, width=300).print(compare_table([result, other]))
    assert "x[/]:a[/]" in out.getvalue() and "y[/]:a[/]" in out.getvalue()


# ------------------------------------------------------------------ 2: --tokenizer


@pytest.mark.parametrize(("make", "why"), [
    (lambda d: d / "nonexistent", "no such directory"),
    (lambda d: d, "no tokenizer.json in this directory"),
    (lambda d: (d / "f").write_text("x") and d / "f", "not a directory"),
    (lambda d: (d / "tokenizer.json").write_text("{oops") and d, "cannot load it"),
])
def test_a_bad_tokenizer_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, why: str) -> None:
    path = make(tmp_path)
    code, err = bench(capsys, "--target", DEAD_HTTP, "--model", "m", "-n", "1", "--no-progress",
                      "--tokenizer", str(path))
    assert code == 2 and f"meshserve bench: --tokenizer {path}: {why}" in err


# ------------------------------------------------------------------ 3, 4: trace contents


def test_trace_token_counts_are_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace_file(tmp_path, '{"timestamp": 0, "input_tokens": 1, "output_tokens": 1}\n'
                                '{"timestamp": 1, "input_tokens": 1e12, "output_tokens": 8}\n')
    code, err = bench(capsys, "--target", DEAD_HTTP, "--model", "m", "--no-progress", "--trace", path)
    assert code == 2
    assert f"--trace {path}: trace line 2: 1,000,000,000,000 input tokens, more than 10,000,000" in err
    for bad in ('{"timestamp": 0, "input_tokens": 1, "output_tokens": 1e9}',
                '{"timestamp": 0, "input_tokens": Infinity, "output_tokens": 1}',
                '{"timestamp": NaN, "input_tokens": 1, "output_tokens": 1}'):
        with pytest.raises(ValueError, match="trace line 1: "):
            parse_trace([bad])


def test_an_empty_trace_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace_file(tmp_path, "# only a comment\n\n")
    code, err = bench(capsys, "--target", DEAD_HTTP, "--model", "m", "--no-progress", "--trace", path)
    assert code == 2 and f"meshserve bench: --trace {path}: no requests in it" in err


# ------------------------------------------------------------------ 5: --trace and --workload


def test_trace_implies_the_trace_workload(tmp_path: Path) -> None:
    path = trace_file(tmp_path, "")
    assert config_from_args(parse("--target", DEAD_HTTP, "--trace", path)).workload.kind == "trace"
    assert config_from_args(parse("--target", DEAD_HTTP)).workload.kind == "random"


def test_trace_with_another_workload_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace_file(tmp_path, '{"timestamp": 0, "input_tokens": 1, "output_tokens": 1}\n')
    code, err = bench(capsys, "--target", DEAD_HTTP, "--trace", path, "--workload", "random")
    assert code == 2 and "--trace" in err and "--workload random" in err


def test_trace_options_without_a_trace_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """They changed nothing without ``--trace``: a run that ignored them was another
    benchmark than the one asked for."""
    code, err = bench(capsys, "--target", DEAD_HTTP, "--model", "m", "--trace-block-size", "64")
    assert code == 2 and "--trace-block-size describes a trace: give the trace with --trace FILE" in err
    code, err = bench(capsys, "--target", DEAD_HTTP, "--model", "m", "--trace-time-unit", "ms",
                      "--trace-block-size", "64")
    assert code == 2 and "--trace-time-unit and --trace-block-size describe a trace" in err
    path = trace_file(tmp_path, '{"timestamp": 5, "input_tokens": 1, "output_tokens": 1}\n')
    workload = config_from_args(parse("--target", DEAD_HTTP, "--trace", path, "--trace-time-unit", "ms",
                                      "--trace-block-size", "64")).workload
    assert (workload.trace_time_unit, workload.trace_block_size) == ("ms", 64)
    workload = config_from_args(parse("--target", DEAD_HTTP, "--trace", path)).workload
    assert (workload.trace_time_unit, workload.trace_block_size) == ("s", 512)


def test_trace_hash_ids_are_bounded_and_only_the_prompts_blocks_are_built(tmp_path: Path) -> None:
    """A line naming more blocks than any prompt was refused for its input tokens only;
    its text was built for every block it named, whatever its length (a million ids of
    512 tokens: half a billion tokens of text for a 10-token prompt)."""
    with pytest.raises(ValueError, match="trace line 1: 10,000,001 hash_ids, more than 10,000,000"):
        parse_trace([json.dumps({"timestamp": 0, "input_tokens": 1, "output_tokens": 1, "hash_ids": [1] * 10_000_001})])
    path = trace_file(tmp_path, json.dumps({"timestamp": 0, "input_tokens": 10, "output_tokens": 1,
                                            "hash_ids": list(range(1_000_000))}))
    workload = WorkloadConfig(kind="trace", trace=path).build(seed=0)
    turn = workload.session(0).turns[0]
    assert turn.user_tokens == 10
    assert len(workload._blocks) == 1  # type: ignore[attr-defined]


# ------------------------------------------------------------------ 6: unreachable NATS


def test_unreachable_nats_is_one_line_naming_the_url_exit_1() -> None:
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "--target", "nats://127.0.0.1:1",
                           "--model", "m", "-n", "1", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("meshserve bench: cannot reach NATS at nats://127.0.0.1:1")


# ------------------------------------------------------------------ 7: --compare, --out


def test_compare_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad, empty = tmp_path / "bad.json", tmp_path / "empty.json"
    bad.write_text("[]")
    empty.write_text("{}")
    code, err = bench(capsys, "--compare", str(bad), str(empty))
    assert code == 2 and f"--compare {bad}: cannot read results: Expected `object`, got `array`" in err
    code, err = bench(capsys, "--compare", str(empty), str(empty))
    assert code == 2 and f"--compare {empty}: no runs in it" in err


def test_out_that_is_a_file_is_not_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "f"
    file.write_text("x")
    code, err = bench(capsys, "--target", DEAD_HTTP, "--out", str(file))
    assert code == 2 and f"meshserve bench: --out {file}: is not a directory" in err


# ------------------------------------------------------------------ 8: why requests failed


def _failed_run(*failures: tuple[str, str]) -> RunResult:
    requests = [RequestResult(index=i, session=i, turn=0, scheduled_s=0.0, status=status, error=error,
                              http_status=int(status)) for i, (status, error) in enumerate(failures)]
    errors: dict[str, int] = {}
    for status, _ in failures:
        errors[status] = errors.get(status, 0) + 1
    return RunResult(endpoint="e", target="nats://x", api="chat", mode="open-loop", arrival="poisson",
                     summary=Summary(requests=len(requests), errors=dict(sorted(errors.items()))),
                     requests=requests)


def test_failures_say_the_servers_first_reason_and_a_key_hint() -> None:
    run = _failed_run(("404", "model_not_found: no model 'x'"), ("404", "later"), ("401", "missing_api_key: no key"))
    warnings = _warnings(run)
    assert "3/3 requests failed (401×1, 404×2)" in warnings[0]
    assert "404: model_not_found: no model 'x'" in warnings[0] and "later" not in warnings[0]
    assert "401: missing_api_key: no key" in warnings[0]
    assert PASS_KEY in warnings


def test_nats_preflight_refuses_a_missing_key_before_the_run() -> None:
    class FakeNats:
        async def request(self, subject: str, data: bytes, timeout: float, headers: Any) -> Any:
            body = {"error": {"message": "You didn't provide an API key.", "code": "missing_api_key"}}
            return SimpleNamespace(headers={"Nats-Service-Error-Code": "401"}, data=json.dumps(body).encode())

    target = NatsTarget(EndpointConfig("nats://127.0.0.1:4222", model="m"))
    target._nc = FakeNats()
    with pytest.raises(ValueError, match=re.escape("answered 401: You didn't provide an API key.; pass the API key")):
        run_loop(target._check_key())


# ------------------------------------------------------------------ 9: help


def test_every_option_has_help_and_these_say_their_default() -> None:
    parser = argparse.ArgumentParser(prog="meshserve")
    bench_parser = add_parser(parser.add_subparsers(dest="command", required=True))
    helps = {a.option_strings[-1]: a.help or "" for a in bench_parser._actions}
    assert not [opt for opt, text in helps.items() if not text.strip()]
    for opt in ("--request-timeout", "--seed", "--api", "--workload"):
        assert "default" in helps[opt], opt
