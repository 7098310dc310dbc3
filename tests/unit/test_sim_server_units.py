"""The sim-server's pure parts: vLLM's KV event schema and the block ledger that gives the
engine's stored blocks their token ids; /get_load shapes; failure injection; CLI checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from ops.cli import main
from ops.simserver.app import injected_error, load_body, parse_return_error, vllm_error_body
from ops.simserver.kv_events import (
    BlockLedger,
    KVEventBatch,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    batch_decoder,
    encode_batch,
)
from proto.hashing import block_hashes
from proto.messages import SamplingParams
from proto.workers import AllCleared, BlockRemoved, BlockStored, KvEvent
from services.gateway.errors import ApiError
from services.worker.engines.base import EngineRequest
from services.worker.engines.sim_core import SimCore
from services.worker.engines.sim_profile import SimConfig

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _drive(core: SimCore, ledger: BlockLedger, requests: list[EngineRequest]) -> list[KvEvent]:
    """Run ``requests`` to the end, feeding the ledger as the server does; the KV events."""
    now = 0.0
    for r in requests:
        ledger.start(r.request_id, r.prompt_token_ids, r.lora, r.cache_salt)
        assert core.add_request(r, now) is None
    events: list[KvEvent] = []
    while core.has_work():
        res = core.step(now)
        if res is None:
            continue
        now = res.end
        events.extend(res.kv_events)
        for out in res.outputs:
            ledger.extend(out.request_id, out.new_token_ids)
    return events


def test_the_ledger_knows_every_block_the_engine_stores_prompt_and_output() -> None:
    bs = 4
    core = SimCore(SimConfig.build("tiny-test", block_size=bs, num_kv_blocks=64))
    ledger = BlockLedger(bs, 1024)
    prompt = [40 + i % 50 for i in range(22)]
    req = EngineRequest(request_id="a", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=13, ignore_eos=True))
    events = _drive(core, ledger, [req])
    translated, dropped = ledger.translate(events)
    assert dropped == 0
    stored = [e for e in translated if isinstance(e, VllmBlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    tokens = [t for e in stored for t in e.token_ids]
    # prompt (22) + output (13) = 35 tokens: 8 full blocks, the last ones filled while decoding
    assert len(hashes) == 8 and len(tokens) == 32
    assert tokens[:20] == prompt[:20]
    assert hashes == block_hashes(tokens, bs)  # the engine's own keys for exactly these tokens
    assert all(e.block_size == bs and e.medium == "GPU" for e in stored)


def test_a_lora_sequence_hashes_with_its_adapter_as_salt() -> None:
    ledger = BlockLedger(2, 64)
    ledger.start("x", [1, 2, 3, 4], lora="ad")
    assert ledger.tokens(block_hashes([1, 2, 3, 4], 2, salt="ad")[1]) == [3, 4]
    assert ledger.tokens(block_hashes([1, 2, 3, 4], 2)[0]) is None


def test_a_salted_sequence_hashes_as_the_engine_stores_it() -> None:
    """A request with vLLM's cache_salt: the engine salts its blocks with it, and the ledger
    did not, so none of its blocks was known (its events dropped after a 5 s wait each)."""
    bs = 4
    core = SimCore(SimConfig.build("tiny-test", block_size=bs, num_kv_blocks=64))
    ledger = BlockLedger(bs, 1024)
    req = EngineRequest(request_id="s", prompt_token_ids=[40 + i for i in range(12)], cache_salt="user-1",
                        sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    events = _drive(core, ledger, [req])
    assert ledger.missing(events) == 0
    translated, dropped = ledger.translate(events)
    assert dropped == 0 and any(isinstance(e, VllmBlockStored) for e in translated)


def test_unknown_blocks_are_left_out_with_the_rest_of_their_run() -> None:
    ledger = BlockLedger(2, 64)
    ledger.start("x", [1, 2, 3, 4])
    known = block_hashes([1, 2, 3, 4], 2)
    batch: list[KvEvent] = [
        BlockStored(block_hashes=[*known, 999, known[0]], block_size=2),
        BlockRemoved(block_hashes=[7]),
        AllCleared(),
    ]
    assert ledger.missing(batch) == 1
    events, dropped = ledger.translate(batch)
    assert dropped == 2
    assert isinstance(events[0], VllmBlockStored) and events[0].block_hashes == known
    assert events[0].token_ids == [1, 2, 3, 4] and events[0].parent_block_hash is None
    assert isinstance(events[1], VllmBlockRemoved) and events[1].block_hashes == [7]
    assert isinstance(events[2], VllmAllBlocksCleared)


def test_the_ledger_stays_within_its_capacity() -> None:
    ledger = BlockLedger(1, 3)
    ledger.start("x", [1, 2, 3, 4, 5])
    assert len(ledger) == 3
    assert ledger.tokens(block_hashes([1, 2, 3, 4, 5], 1)[0]) is None


def test_a_batch_is_encoded_as_vllm_encodes_it() -> None:
    """Array-like batch, events as maps tagged with vLLM's class names, rank 0."""
    event = VllmBlockStored(block_hashes=[2**64 - 1], parent_block_hash=5, token_ids=[1, 2], block_size=2,
                            lora_id=None, medium="GPU", lora_name=None)
    raw = encode_batch(1.5, [event, VllmBlockRemoved(block_hashes=[3], medium="GPU"), VllmAllBlocksCleared()])
    assert msgspec.msgpack.decode(raw) == [1.5, [
        {"type": "BlockStored", "block_hashes": [2**64 - 1], "parent_block_hash": 5, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ], 0]
    assert batch_decoder.decode(raw) == KVEventBatch(ts=1.5, events=[
        event, VllmBlockRemoved(block_hashes=[3], medium="GPU"), VllmAllBlocksCleared()], data_parallel_rank=0)


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (.venv-vllm) on this machine")
def test_vllm_decodes_our_batches_with_its_own_structs() -> None:
    event = VllmBlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                            lora_id=None, medium="GPU", lora_name="ad")
    raw = encode_batch(2.0, [event, VllmBlockRemoved(block_hashes=[11], medium="GPU"), VllmAllBlocksCleared()])
    script = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared\n"
        "raw = sys.stdin.buffer.read()\n"
        "b = msgspec.msgpack.decode(raw, type=KVEventBatch)\n"
        "s, r, c = b.events\n"
        "assert isinstance(s, BlockStored) and s.token_ids == list(range(32)) and s.block_hashes == [11, 12]\n"
        "assert s.block_size == 16 and s.lora_name == 'ad' and s.parent_block_hash is None\n"
        "assert isinstance(r, BlockRemoved) and r.block_hashes == [11] and isinstance(c, AllBlocksCleared)\n"
        "assert b.ts == 2.0 and b.data_parallel_rank == 0\n"
        "assert msgspec.msgpack.encode(b) == raw\n"  # byte for byte what vLLM itself would send
        "print('ok')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(VLLM_PYTHON), "-c", script], input=raw, capture_output=True, timeout=240, env=env)
    if b"No module named 'vllm'" in proc.stderr:
        pytest.skip("the vLLM venv has no vllm")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.strip().endswith(b"ok")


def test_get_load_shapes() -> None:
    assert load_body("vllm", 3, 2, 900) == {"load": 5}
    assert load_body("sglang", 3, 2, 900) == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 900}]


@pytest.mark.parametrize(("status", "type_"), [(400, "BadRequestError"), (404, "NotFoundError"),
                                               (429, "Too Many Requests"), (500, "InternalServerError"),
                                               (503, "Service Unavailable")])
def test_errors_have_vllms_shape(status: int, type_: str) -> None:
    """vLLM's body: OpenAI's fields, vLLM's type names (else the status phrase), the status as code."""
    body = vllm_error_body(injected_error(parse_return_error(f" {status} "), "test"))
    assert body == {"error": {"message": "Injected error (test).", "type": type_, "param": None, "code": status}}


@pytest.mark.parametrize("value", ["", "abc", "200", "302", "600", "4000"])
def test_a_bad_return_error_header_is_a_400(value: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_return_error(value)
    assert info.value.status == 400 and info.value.param == "X-Return-Error"


@pytest.mark.parametrize("argv", [
    ["--error-rate", "1.5"], ["--kv-events-replay", "tcp://127.0.0.1:5999"], ["--profile", "no-such-profile"],
])  # (--speed 0, --block-size 0, --port: the parser's, test_cli_arguments.py)
def test_bad_options_are_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim-server", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshserve sim-server: ") and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--speed", "0"], ["--block-size", "0"]])
def test_bad_numbers_are_the_parsers_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sim-server", *argv])
    assert info.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


def test_the_subcommand_is_wired() -> None:
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "sim-server", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "--kv-events" in proc.stdout and "--load-format" in proc.stdout
