"""``meshserve serve SERVICE``: bad input is one line on stderr and exit 2, a runtime failure
(a port in use) one line and exit 1; never a traceback. Each check runs before the service
connects to NATS, so no mesh is needed (``--nats-url nats://127.0.0.1:1`` would only make
a service that got past them retry for ever; the timeouts end such a run)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.runner import listen_problem, log_level_problem
from ops.cli import build_parser
from ops.console import CliError
from ops.serve import check_log_level_env
from services.admission.config import parse_config

NO_NATS = ["--nats-url", "nats://127.0.0.1:1"]


def meshserve(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "MESHSERVE_LOG_LEVEL"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "ops.cli", *argv], capture_output=True, text=True, timeout=30,
                          env=full_env, cwd=cwd or Path(__file__).resolve().parents[2])


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def parse(*argv: str) -> object:
    return build_parser("serve").parse_args(["serve", *argv])


def refused(capsys: pytest.CaptureFixture[str], call: object, *args: object) -> tuple[int, str]:
    """(exit code, the one stderr line) of ``call(*args)``, which must refuse."""
    with pytest.raises(SystemExit) as info:
        call(*args)  # type: ignore[operator]
    code = info.value.code
    assert isinstance(code, int)
    return code, one_line(capsys.readouterr().err)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


# ============================================================================ 1: log level

SERVICES = ["worker", "gateway", "router", "metering", "admission", "autoscaler"]


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_log_level_option_is_refused_by_the_parser(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(service, "--log-level", "FOO")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "--log-level: FOO: not a level (debug, info, warning, error, critical)" in err.splitlines()[-1]


def test_log_levels_in_any_case_are_accepted() -> None:
    assert all(log_level_problem(level) is None for level in ("debug", "INFO", "Warning", "error", "CRITICAL"))
    assert log_level_problem("FOO") == "not a level (debug, info, warning, error, critical)"


def test_a_bad_log_level_variable_is_one_line_naming_it() -> None:
    check_log_level_env({"MESHSERVE_LOG_LEVEL": "info"})
    check_log_level_env({})
    with pytest.raises(CliError) as info:
        check_log_level_env({"MESHSERVE_LOG_LEVEL": "FOO"})
    assert info.value.exit_code == 2
    assert info.value.message == "MESHSERVE_LOG_LEVEL=FOO: not a level (debug, info, warning, error, critical)"


def test_a_bad_log_level_variable_ends_the_service_with_exit_2() -> None:
    result = meshserve("serve", "router", *NO_NATS, env={"MESHSERVE_LOG_LEVEL": "FOO"})
    assert result.returncode == 2
    assert one_line(result.stderr) == ("meshserve serve router: MESHSERVE_LOG_LEVEL=FOO: not a level "
                                       "(debug, info, warning, error, critical)")


# ============================================================================ 2: ports in use


@pytest.mark.parametrize(("service", "option"), [
    ("gateway", "--port"), ("router", "--metrics-port"), ("metering", "--metrics-port"),
    ("worker", "--metrics-port"), ("admission", "--metrics-port"), ("autoscaler", "--metrics-port"),
])
def test_a_port_in_use_is_one_line_naming_it_and_exit_1(service: str, option: str, taken_port: int,
                                                        tmp_path: Path) -> None:
    extra = ["--pool", "m"] if service == "autoscaler" else []
    extra += ["--ledger-url", str(tmp_path / "ledger.db")] if service == "metering" else []
    result = meshserve("serve", service, *NO_NATS, option, str(taken_port), *extra)
    assert result.returncode == 1, result.stderr
    assert one_line(result.stderr) == f"meshserve serve {service}: cannot listen on 127.0.0.1:{taken_port}: address already in use"


def test_listen_problem_says_nothing_of_a_free_port_and_names_a_taken_one(taken_port: int) -> None:
    assert listen_problem("127.0.0.1", 0) is None
    assert listen_problem("127.0.0.1", taken_port) == (f"cannot listen on 127.0.0.1:{taken_port}: address already in use", 1)


# ============================================================================ 3: TLS files


def tls_args(*argv: str) -> object:
    return parse("gateway", *NO_NATS, *argv)


def check_tls_of(*argv: str) -> None:
    from services.gateway.main import build_config, check_tls

    check_tls(build_config(tls_args(*argv)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cert_and_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A self-signed certificate, its key, and the key of another."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    where = tmp_path_factory.mktemp("tls")
    for name in ("a", "b"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(where / f"{name}.key"),
                        "-out", str(where / f"{name}.pem"), "-days", "1", "-subj", f"/CN={name}"],
                       check=True, capture_output=True, timeout=60)
    return where / "a.pem", where / "a.key", where / "b.key"


def test_missing_tls_files_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = tmp_path / "nope.pem", tmp_path / "nope.key"
    code, line = refused(capsys, check_tls_of, "--tls-cert", str(cert), "--tls-key", str(key))
    assert (code, line) == (2, f"meshserve serve gateway: --tls-cert {cert}: No such file or directory")


def test_a_tls_file_that_is_not_pem_is_named(tmp_path: Path, cert_and_key: tuple[Path, Path, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cert, key, other_key = cert_and_key
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    assert refused(capsys, check_tls_of, "--tls-cert", str(junk), "--tls-key", str(key)) == (
        2, f"meshserve serve gateway: --tls-cert {junk}: not a PEM certificate")
    assert refused(capsys, check_tls_of, "--tls-cert", str(cert), "--tls-key", str(junk)) == (
        2, f"meshserve serve gateway: --tls-key {junk}: not a PEM private key")
    code, line = refused(capsys, check_tls_of, "--tls-cert", str(cert), "--tls-key", str(other_key))
    assert code == 2 and line.startswith(f"meshserve serve gateway: --tls-cert {cert} and --tls-key {other_key}: ")
    assert refused(capsys, check_tls_of, "--tls-key", str(key)) == (
        2, "meshserve serve gateway: --tls-key needs --tls-cert (the certificate the key is for)")
    check_tls_of("--tls-cert", str(cert), "--tls-key", str(key))  # a good pair passes


def test_bad_tls_files_end_the_gateway_before_it_connects(tmp_path: Path) -> None:
    result = meshserve("serve", "gateway", *NO_NATS, "--tls-cert", str(tmp_path / "nope.pem"),
                       "--tls-key", str(tmp_path / "nope.key"))
    assert result.returncode == 2
    assert one_line(result.stderr) == f"meshserve serve gateway: --tls-cert {tmp_path / 'nope.pem'}: No such file or directory"


# ============================================================================ 4: addresses


@pytest.mark.parametrize("value", ["999.1.1.1/99", "10.0.0.0/33", "proxy"])
def test_a_bad_trusted_proxy_is_refused_by_the_parser(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("gateway", "--trusted-proxy", value)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --trusted-proxy: not an IP address or network" in err


def test_good_trusted_proxies_pass() -> None:
    assert parse("gateway", "--trusted-proxy", "10.0.0.0/8", "--trusted-proxy", "::1").trusted_proxy == [  # type: ignore[attr-defined]
        "10.0.0.0/8", "::1"]


def test_an_unresolvable_host_is_one_line_and_exit_2() -> None:
    problem = listen_problem("999.1.1.1", 0)
    assert problem is not None and problem[1] == 2 and problem[0].startswith("cannot listen on 999.1.1.1:0: 999.1.1.1 does not resolve")
    result = meshserve("serve", "gateway", *NO_NATS, "--host", "999.1.1.1")
    assert result.returncode == 2
    assert one_line(result.stderr).startswith("meshserve serve gateway: cannot listen on 999.1.1.1:8080: ")


# ============================================================================ 5: admission config types


@pytest.mark.parametrize(("raw", "message"), [
    ({"tiers": ["gold"]}, "tiers[0]: expected a table of settings (ttft_slo_s, priority), not str"),
    ({"tiers": {"gold": 5}}, "tiers.gold: expected a table of settings (ttft_slo_s, priority), not int"),
    ({"tiers": "gold"}, "tiers: expected a table of tiers by name, not str"),
    ({"slo": {"tiers": "x"}}, "slo.tiers is not a setting: use the tiers section"),
    ({"default_tier": "gold", "tiers": {"gold": {"ttft_slo_s": "abc", "priority": 1}}},
     'tiers.gold: ttft_slo_s must be a number, not "abc"'),
    ({"tiers": {"gold": {"ttft_slo_s": 1, "priority": 1.5}}}, "tiers.gold: priority must be a whole number, not 1.5"),
    ({"slo": {"headroom": "high"}}, 'slo: headroom must be a number, not "high"'),
    ({"slo": {"calibration_bounds": [1, "a"]}}, 'slo: calibration_bounds must be a list of 2 numbers, not [1, "a"]'),
    ({"limits": {"burst_s": True}}, "limits: burst_s must be a number, not true"),
    ({"default_tier": 5}, "slo: default_tier must be a string, not 5"),
    ({"service": {"metrics_port": "80"}}, 'service: metrics_port must be a whole number or null, not "80"'),
])
def test_admission_config_of_the_wrong_type_names_the_field(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_config(raw)
    assert str(info.value) == message


def test_admission_config_of_the_right_types_still_loads() -> None:
    config = parse_config({"default_tier": "gold", "tiers": {"gold": {"ttft_slo_s": 1, "priority": 1}},
                           "slo": {"calibration_bounds": [0.5, 8]}, "service": {"metrics_port": None}})
    assert [(t.name, t.ttft_slo_s, t.priority) for t in config.slo.tiers] == [("gold", 1, 1)]
    listed = parse_config({"default_tier": "a", "tiers": [{"name": "a", "ttft_slo_s": 2.0, "priority": 0}]})
    assert listed.slo.tiers[0].name == "a"


def test_a_bad_admission_config_is_refused_by_serve_and_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ops.keys import admission_tiers
    from services.admission.main import build_config

    path = tmp_path / "admission.json"
    path.write_text(json.dumps({"default_tier": "gold", "tiers": {"gold": {"ttft_slo_s": "abc", "priority": 1}}}))
    assert refused(capsys, build_config, parse("admission", "--config", str(path))) == (
        2, f'meshserve serve admission: --config {path}: tiers.gold: ttft_slo_s must be a number, not "abc"')
    with pytest.raises(CliError) as info:
        admission_tiers(str(path))
    assert info.value.exit_code == 2 and "tiers.gold: ttft_slo_s must be a number" in info.value.message


# ============================================================================ 6: the metering ledger


def test_a_sqlite_ledger_that_cannot_be_made_ends_metering_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.metering.ledger import sqlite_ledger_problem
    from services.metering.main import run

    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "sub" / "ledger.db"
    problem = sqlite_ledger_problem(path)
    assert problem is not None and problem.startswith(f"{path}: cannot make its directory {blocker / 'sub'}: ")
    code, line = refused(capsys, run, parse("metering", *NO_NATS, "--ledger-url", f"sqlite:///{path}"))
    assert code == 1 and line == f"meshserve serve metering: cannot open the ledger: {problem}"
    assert sqlite_ledger_problem(tmp_path) == f"{tmp_path}: Is a directory"
    assert sqlite_ledger_problem(tmp_path / "new" / "ledger.db") is None  # made, as opening it would


# ============================================================================ 7: config files not found


@pytest.mark.parametrize(("service", "option", "module"), [
    ("router", "--config", "services.router.main"),
    ("admission", "--config", "services.admission.main"),
    ("autoscaler", "--config", "services.autoscaler.main"),
    ("gateway", "--models-config", "services.gateway.main"),
    ("gateway", "--oidc-config", "services.gateway.main"),
    ("metering", "--prices", "services.metering.main"),
])
def test_a_config_file_not_found_is_one_line_and_exit_2(service: str, option: str, module: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    missing = tmp_path / "missing.json"
    args = parse(service, *NO_NATS, option, str(missing), *(["--pool", "m"] if service == "autoscaler" else []))
    run = importlib.import_module(module).run
    if service == "metering":  # its run returns the code of a refusal
        code, line = run(args), one_line(capsys.readouterr().err)
    else:
        code, line = refused(capsys, run, args)
    assert (code, line) == (2, f"meshserve serve {service}: {option} {missing}: No such file or directory")


@pytest.mark.parametrize("service", ["router", "admission", "autoscaler"])
def test_a_config_file_that_is_not_json_is_one_line_and_exit_2(service: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    result = meshserve("serve", service, *NO_NATS, "--config", str(path), *(["--pool", "m"] if service == "autoscaler" else []))
    assert result.returncode == 2
    assert one_line(result.stderr).startswith(f"meshserve serve {service}: --config {path}: ")


def test_listen_problem_skips_a_family_this_host_lacks_as_asyncio_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--host localhost`` on a host without IPv6: asyncio's create_server skips the ::1
    address it cannot make a socket for and listens on 127.0.0.1; so does the check."""
    real_socket = socket.socket
    both = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]

    def no_ipv6(family: int = socket.AF_INET, *args: Any, **kwargs: Any) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: both)
    monkeypatch.setattr(socket, "socket", no_ipv6)
    assert listen_problem("localhost", 0) is None


def test_whole_numbers_written_as_floats_are_whole_numbers() -> None:
    import dataclasses

    from bus.config import build

    @dataclasses.dataclass
    class Settings:
        window: int = 1
        limit: int | None = None

    assert build(Settings, {"window": 32.0, "limit": 2.0}, "x") == Settings(window=32, limit=2)
    with pytest.raises(ValueError, match="window must be a whole number"):
        build(Settings, {"window": 32.5}, "x")


def test_an_in_memory_ledger_needs_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.metering.ledger import sqlite_ledger_problem

    monkeypatch.chdir(tmp_path)
    assert sqlite_ledger_problem(":memory:") is None
    assert not (tmp_path / ":memory:").exists()


# ============================================================================ services' own refusals


@pytest.mark.parametrize(("argv", "config", "message"), [
    (["autoscaler"], None, "the autoscaler needs at least one pool: --pool MODEL or pools in --config"),
    (["autoscaler", "--config", "{config}"], ["not", "an", "object"], "bad autoscaler configuration: --config "),
    (["autoscaler", "--config", "{config}"], {"pools": {"m": {"timezone": "Mars/Olympus"}}}, "unknown timezone: "),
    (["worker", "--engine", "echo", "--host-models", "a"], None, "--engine echo takes no LoRA adapters and hosts no"),
    (["worker", "--host-models", "a,a"], None, "--host-models: 'a' is empty or named twice"),
    # Options another engine reads changed nothing: vLLM's for a sim, the sim's for echo.
    (["worker", "--engine-arg", "nokey"], None, "--engine-arg is for --engine vllm: --engine sim does not read it"),
    (["worker", "--gpu-memory-utilization", "0.5"], None, "--gpu-memory-utilization is for --engine vllm: --engine sim"),
    (["worker", "--engine", "echo", "--speed", "2"], None, "--speed is for --engine sim: --engine echo does not read it"),
    (["worker", "--engine", "echo", "--lora-adapters", "a"], None, "--lora-adapters is for --engine sim or --engine vllm"),
    (["worker", "--echo-tokens-per-s", "5"], None, "--echo-tokens-per-s is for --engine echo: --engine sim"),
    (["worker", "--generation-config", "vllm"], None, "--generation-config is for --engine vllm or --engine echo"),
    # The hot-swap host's options without --host-models; one model's names with it.
    (["worker", "--kv-gib", "2"], None, "--kv-gib is for a hot-swap host: give the models with --host-models"),
    (["worker", "--idle-unload-s", "0"], None, "--idle-unload-s is for a hot-swap host"),
    (["worker", "--preload", "a"], None, "--preload is for a hot-swap host"),
    (["worker", "--engine", "vllm", "--host-models", "a=/m/a", "--served-model-name", "x"], None,
     "--served-model-name names one model: with --host-models, NAME=DIR names each"),
])
def test_a_services_own_refusal_is_one_line_naming_the_command_and_exit_2(
        argv: list[str], config: Any, message: str, tmp_path: Path) -> None:
    """Configurations only the service itself can judge (a config file's contents, options
    that contradict each other) ended with the bare message and exit 1, where every other
    bad input is ``meshserve serve SERVICE: ...`` and exit 2."""
    path = tmp_path / "config.json"
    if config is not None:
        path.write_text(json.dumps(config))
    result = meshserve("serve", *[a.format(config=path) for a in argv], *NO_NATS)
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)
    assert line.startswith(f"meshserve serve {argv[0]}: {message}"), line
