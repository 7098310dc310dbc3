"""Bad input to the tool commands (calibrate, sim profiles, up, make-tiny-model, plan): one
line on stderr in the CLI's style, exit 2 (bad input) or 1 (a failure at run time), no
traceback, and no work lost to an output path that cannot be written."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ops.cli import main

TINY = Path(__file__).parents[2] / "services/worker/engines/profiles/tiny-test.json"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``meshserve ARGV`` run here; an argparse error is exit 2."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture
def afile(tmp_path: Path) -> Path:
    path = tmp_path / "afile"
    path.write_text("not a folder\n")
    return path


# ---------------------------------------------------------------------------- calibrate


def _profile_of(costs: dict[str, float]) -> dict[str, Any]:
    from ops.calibrate_engine import engine_profile
    from ops.calibrate_fit import Point

    coef = {"base_s": 0.0, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0, "per_kv_token_s": 0.0,
            "per_prefill_seq_s": 0.0, "per_prefill_step_s": 0.0, **costs}
    # the points a grid of --prefill-chunks 32 --decode-batches 1 measures: one chunk size, one batch size
    points = [Point("prefill", 32, 1, 96, 0.004, prefill_seqs=1), Point("prefill", 32, 1, 1120, 0.005, prefill_seqs=1),
              Point("decode", 0, 1, 80, 0.002), Point("decode", 0, 1, 528, 0.0021)]
    return engine_profile(name="t", model="m", url="http://engine", coef=coef, points=points, block_size=16,
                          num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                          input_len=64, output_len=32, seconds=1.0)


def _fake_engine(monkeypatch: pytest.MonkeyPatch, profile: dict[str, Any] | None) -> list[str]:
    calls: list[str] = []

    async def calibrate_engine(url: str, **_: Any) -> dict[str, Any]:
        calls.append(url)
        assert profile is not None, "measured although the command should have stopped before"
        return profile

    monkeypatch.setattr("ops.calibrate_engine.calibrate_engine", calibrate_engine)
    return calls


def test_calibrate_refuses_an_out_it_cannot_write_before_measuring(
        afile: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It measured for minutes, then failed on mkdir with a FileExistsError traceback."""
    calls = _fake_engine(monkeypatch, None)
    code, _, err = run_cli(["calibrate", "--engine-url", "http://127.0.0.1:9", "--out", str(afile / "x.json")], capsys)
    assert code == 2 and calls == []
    assert err.strip() == f"meshserve calibrate: --out {afile / 'x.json'}: {afile} exists and is not a directory"
    code, _, err = run_cli(["calibrate", "--out", str(afile.parent)], capsys)  # a folder, in the PyTorch mode too
    assert code == 2 and "is a directory" in err


def test_calibrate_prints_the_profile_when_writing_it_fails_at_the_end(
        afile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ops.calibrate import save_profile
    from ops.console import CliError

    profile = _profile_of({"base_s": 0.002, "per_prefill_token_s": 1e-5})
    with pytest.raises(CliError, match="printed above on stdout"):
        save_profile(profile, afile / "x.json", [])
    assert json.loads(capsys.readouterr().out) == profile


def test_calibrate_engine_url_must_be_http(capsys: pytest.CaptureFixture[str]) -> None:
    """``--engine-url foo`` printed only "foo: foo/v1/models"."""
    code, _, err = run_cli(["calibrate", "--engine-url", "foo"], capsys)
    assert code == 2 and "argument --engine-url: not an http(s) URL: 'foo'" in err
    code, _, err = run_cli(["calibrate", "--engine-url", "ftp://host"], capsys)
    assert code == 2 and "not an http(s) URL" in err


def test_calibrate_engine_errors_go_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["calibrate", "--engine-url", "http://127.0.0.1:9", "--out", str(tmp_path / "p.json")],
                             capsys)
    assert code == 1 and out == ""
    assert err.startswith("meshserve calibrate: http://127.0.0.1:9: ") and len(err.strip().splitlines()) == 1


def test_calibrate_does_not_recommend_a_profile_the_sim_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A small grid fitted every coefficient to 0 but per_kv_token_s, and calibrate said to
    use the file: the sim divided by a zero step time."""
    out_file = tmp_path / "p.json"
    _fake_engine(monkeypatch, _profile_of({"per_kv_token_s": 3e-7}))
    code, out, err = run_cli(["calibrate", "--engine-url", "http://e:1", "--out", str(out_file)], capsys)
    assert code == 1 and "use it with" not in out
    assert "no usable sim profile" in err and "a prefill step takes no time" in err
    assert "--prefill-chunks" in err and "--decode-batches" in err
    assert json.loads(out_file.read_text())["calibration"]["points"]  # the measurements are kept
    _fake_engine(monkeypatch, _profile_of({"base_s": 0.002, "per_prefill_token_s": 1e-5}))
    code, out, err = run_cli(["calibrate", "--engine-url", "http://e:1", "--out", str(out_file)], capsys)
    assert code == 0 and "use it with: meshserve sim-server --profile" in out


# ------------------------------------------------------------------------- sim profiles


def _bad_profile(tmp_path: Path, change: Any) -> Path:
    data = json.loads(TINY.read_text())
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


BAD_PROFILES = [
    (lambda d: d["engine_defaults"].update(block_size=0), "engine_defaults.block_size must be a whole number"),
    (lambda d: d.update(step={"base_s": 0, "per_prefill_token_s": 0, "per_decode_seq_s": 0, "per_kv_token_s": 1e-7}),
     "a prefill step takes no time"),
    (lambda d: d["step"].update(base_s="abc"), "step.base_s must be a number, not 'abc'"),
    (lambda d: d["step"].update(per_decode_seq_s=-1), "cannot be negative"),
    (lambda d: d["memory"].update(hbm_bytes=None), "memory.hbm_bytes must be a number"),
]


@pytest.mark.parametrize(("change", "message"), BAD_PROFILES)
def test_a_bad_profile_is_refused_on_loading_naming_file_and_field(tmp_path: Path, change: Any, message: str) -> None:
    from services.worker.engines.sim_profile import load_profile

    path = _bad_profile(tmp_path, change)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_profile(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("change", "message"), BAD_PROFILES[:3])
def test_sim_server_says_what_is_wrong_with_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        change: Any, message: str) -> None:
    """block_size 0 and a step of no time were ZeroDivisionError tracebacks."""
    path = _bad_profile(tmp_path, change)
    code, _, err = run_cli(["sim-server", "--port", "0", "--profile", str(path)], capsys)
    assert code == 2 and err.startswith(f"meshserve sim-server: profile {path}: ") and message in err


def test_a_profile_given_as_is_is_checked_too() -> None:
    import dataclasses

    from services.worker.engines.sim_profile import SimConfig, StepCosts, load_profile

    zero = dataclasses.replace(load_profile("tiny-test"), costs=StepCosts(0.0, 0.0, 0.0, 1e-7))
    with pytest.raises(ValueError, match="takes no time"):
        SimConfig.build(zero)
    with pytest.raises(ValueError, match="block_size must be positive"):
        SimConfig.build(dataclasses.replace(load_profile("tiny-test"), block_size=0))


def test_a_profile_that_is_not_json_names_the_file(tmp_path: Path) -> None:
    from services.worker.engines.sim_profile import load_profile

    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=f"profile {re.escape(str(path))} is not JSON"):
        load_profile(str(path))


# -------------------------------------------------------------------------------- up


def _up_args(argv: list[str]) -> Any:
    import argparse

    from ops.up_cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


@pytest.mark.parametrize(("argv", "message"), [
    (["--profile", "nope"], "unknown sim profile 'nope'; known: "),
    (["--worker-arg=--bogus"], "a worker would refuse its arguments (--bogus): unrecognized arguments: --bogus"),
    (["--worker-arg=--max-model-len=abc"], "argument --max-model-len: not a whole number"),
    (["--worker-arg=--max-model-len=100000000"], "exceeds the KV cache"),
    (["--no-autoscaler", "--profile", "nope"], "unknown sim profile 'nope'"),
    # Without a sim they changed nothing (echo streams at its own rate; vLLM is real).
    (["--engine", "echo", "--profile", "nope"], "--profile is for the sim engine; --engine echo has no simulated"),
    (["--engine", "echo", "--speed", "5", "--profile", "tiny-test"], "--speed and --profile are for the sim engine"),
    (["--engine", "vllm", "--model", "m", "--speed", "2"], "--speed is for the sim engine; --engine vllm"),
    (["--worker-arg=--gpu-memory-utilization=0.5"], "(--gpu-memory-utilization=0.5): --gpu-memory-utilization is for"
                                                    " --engine vllm: --engine sim does not read it"),
])
def test_up_checks_the_workers_options_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """``--profile nope``: the autoscaler restarted the failing worker ~60 times, then
    ``up`` said "no worker ready after 60s"."""
    from ops.up_cli import run_up

    state = tmp_path / "state"
    code = run_up(_up_args(["--state-dir", str(state), "--nats-port", "1", "--http-port", "1", *argv]))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("meshserve up: ") and message in err
    assert not state.exists()  # nothing started, nothing written


def test_up_accepts_good_worker_options(tmp_path: Path) -> None:
    from ops.up_cli import config_from_args

    config = config_from_args(_up_args(["--state-dir", str(tmp_path), "--profile", "tiny-test",
                                        "--worker-arg=--max-model-len=512"]))
    assert config.profile == "tiny-test"
    assert config.speed == 1.0
    assert config_from_args(_up_args(["--state-dir", str(tmp_path), "--speed", "4"])).speed == 4.0
    assert config_from_args(_up_args(["--state-dir", str(tmp_path), "--engine", "echo"])).engine == "echo"


@pytest.mark.parametrize(("argv", "message"), [
    (["--http-port", "0"], "argument --http-port: 0 (any free port) is not supported here"),
    (["--state-dir", ""], "argument --state-dir: an empty path"),
    (["--state-dir", "{afile}"], "exists and is not a directory"),
])
def test_up_refuses_ports_and_state_dirs_it_cannot_use(
        afile: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """``--http-port 0``: up polled port 0 for 60 s; ``--state-dir ''``: the current directory."""
    argv = [a.format(afile=afile) for a in argv]
    with pytest.raises(SystemExit) as info:
        _up_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


# --------------------------------------------------------------------- make-tiny-model


@pytest.mark.parametrize("where", ["{afile}", "{afile}/sub", "/proc/x/y"])
def test_make_tiny_model_checks_the_directory_first(
        afile: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    """FileExistsError / FileNotFoundError tracebacks from mkdir (once torch was there);
    checked before torch is looked for, so the same here without it."""
    directory = where.format(afile=afile)
    code, out, err = run_cli(["make-tiny-model", directory], capsys)
    assert code == 2 and out == ""
    assert err.startswith("meshserve make-tiny-model: ") and directory in err and "torch" not in err


# ------------------------------------------------------------------------------ plan


@pytest.mark.parametrize(("plot", "message"), [
    ("/nonexistent/dir/x.png", "--plot /nonexistent/dir/x.png: /nonexistent/dir: no such directory"),
    ("x.txt", "--plot x.txt: .txt is not an image format it writes"),
    ("{afile}/x.png", "is not a directory"),
])
def test_plan_checks_the_plot_path_before_planning(
        afile: Path, capsys: pytest.CaptureFixture[str], plot: str, message: str) -> None:
    """The plan was printed, then matplotlib failed with a traceback, exit 1."""
    code, out, err = run_cli(["plan", "--plot", plot.format(afile=afile)], capsys)
    assert code == 2 and out == "" and message in err
    assert not Path("/nonexistent").exists()


def test_plan_says_where_the_plot_went(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, out, _ = run_cli(["plan", "--plot", str(tmp_path / "adir")], capsys)
    assert code == 0 and f"queueing curve written to {tmp_path / 'adir.png'}\n" in out  # on one line when piped
    assert (tmp_path / "adir.png").is_file()
    # Every format matplotlib writes, not only the common ones.
    code, _, _ = run_cli(["plan", "--plot", str(tmp_path / "curve.eps")], capsys)
    assert code == 0 and (tmp_path / "curve.eps").is_file()


@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "1e308"], "argument --rate/-r: must be at most"),
    (["--models", "m.yaml", "--static-load", "-1"], "argument --static-load: must be a finite number above 0"),
])
def test_plan_refuses_bad_numbers_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                  message: str) -> None:
    code, out, err = run_cli(["plan", *argv], capsys)
    assert code == 2 and out == "" and message in err


def test_plan_fits_a_narrow_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It printed 105-column tables on a 40-column terminal (a console forced to 120)."""
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal, to rich
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, _ = run_cli(["plan"], capsys)
    assert code == 0
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert plain.strip() and max(len(line) for line in plain.splitlines()) <= 40
