"""``meshserve tokenizer export DIR --model M``: the gateway's tokenizer as a Hugging Face directory.

Benchmark clients (guidellm, aiperf, vLLM's benchmark scripts) count and build prompts
with ``transformers.AutoTokenizer`` and, given only a model name, try to download a
tokenizer of that name from the hub. This writes the one the gateway really encodes
requests with, so their token counts are the mesh's: ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template the gateway renders) and
``special_tokens_map.json``. Nothing here needs torch or transformers.

Which tokenizer a model uses comes from the mesh's worker registry, by the gateway's own
rule (``services.gateway.models.tokenizer_source``); ``--tokenizer byte|DIR`` skips the
lookup and works offline (``byte``: the sim models' tokenizer).

The sim's byte tokenizer becomes a byte-level BPE without merges: one token per UTF-8
byte, ids 3..258 as in ``services.common.tokenizer.ByteTokenizer``, no BOS added on encode. Its
three specials (ids 0-2) need text in a Hugging Face tokenizer; they get
``<|pad|>``/``<|bos|>``/``<|eos|>``, and only a prompt containing those exact strings
encodes differently from the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bus import Bus

from services.common.cli_types import add_nats_url_argument, positive_int, positive_seconds, subject_root
from services.common.tokenizer import (
    BYTE_SPECIALS,
    ByteTokenizer,
    HFTokenizer,
    bytes_to_unicode,
    load_tokenizer,
)

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class ExportError(Exception):
    """A reason the export cannot be done, worded for the command line."""


def _model_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a model name cannot be empty")
    return text


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("tokenizer", help="hand clients the tokenizer the gateway uses for a model")
    commands = parser.add_subparsers(dest="tokenizer_command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export", help="write a Hugging Face tokenizer directory (AutoTokenizer loads it) for a model",
        description="Write DIR/tokenizer.json, tokenizer_config.json (with the chat template) and "
                    "special_tokens_map.json: the tokenizer the gateway encodes MODEL's requests with.",
    )
    export.add_argument("directory", metavar="DIR", help="where to write (created if missing)")
    export.add_argument("--model", required=True, type=_model_name, help="the model name clients send")
    export.add_argument("--tokenizer", default=None, metavar="byte|DIR",
                        help="skip the mesh lookup: byte (the sim models') or a directory with tokenizer.json")
    export.add_argument("--max-model-len", type=positive_int, default=None,
                        help="model_max_length to record (default: what the model's workers register)")
    add_nats_url_argument(export)
    export.add_argument("--root", type=subject_root, default=None, help="subject root (env MESHSERVE_ROOT)")
    export.add_argument("--timeout", type=positive_seconds, default=5.0, help="seconds to wait for the mesh")
    export.set_defaults(func=run_export, cli_prog="meshserve tokenizer export")


def run_export(args: argparse.Namespace) -> int:
    from .serve import apply_common_arguments

    apply_common_arguments(args)
    try:
        if args.max_model_len is not None and args.max_model_len <= 0:
            raise ExportError("--max-model-len must be positive")
        source, max_len = args.tokenizer, args.max_model_len
        if source is None:
            source, registered_len = asyncio.run(lookup(args.model, args.timeout))
            max_len = max_len or registered_len or None
        written = export_tokenizer(args.directory, source, model=args.model, max_model_len=max_len)
    except ExportError as exc:
        print(f"meshserve tokenizer export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the {'byte' if source in ('', 'byte') else source} tokenizer of {args.model} to {written}")
    return 0


async def lookup(model: str, timeout: float) -> tuple[str, int]:
    """(tokenizer spec, max_model_len or 0) of ``model``, from the workers serving it."""
    from ops.console import CliError, mesh_bus

    async with contextlib.AsyncExitStack() as stack:
        try:
            async with asyncio.timeout(timeout):  # reaching the mesh; a download has its own limit
                bus = await stack.enter_async_context(mesh_bus("meshserve-tokenizer", initial_attempts=2))
        except CliError as exc:  # NATS unreachable: said as every command says it, and the way round it
            raise CliError(f"{exc.message}; or pass --tokenizer byte (the sim models) or --tokenizer DIR",
                           exc.exit_code) from None
        except TimeoutError:
            raise CliError(f"the mesh did not answer within {timeout:g} s (--timeout); or pass --tokenizer byte"
                           " (the sim models) or --tokenizer DIR") from None
        return await _lookup(bus, model)
    raise AssertionError("unreachable")  # an exit stack does not swallow: for mypy


async def _lookup(bus: Bus, model: str) -> tuple[str, int]:
    from bus import tokenizers
    from bus.keys import AdapterStore
    from bus.registry import WorkerRegistry
    from services.gateway.models import model_max_len, tokenizer_source

    registry = WorkerRegistry(bus)
    await registry.start()
    try:
        served = registry.models()
    finally:
        await registry.stop()
    workers = served.get(model)
    if not workers:  # a LoRA adapter: its base model's tokenizer
        adapter = next((a for a in await (await AdapterStore(bus).open()).list() if a.name == model), None)
        workers = served.get(adapter.base) if adapter is not None else None
    if not workers:
        names = ", ".join(sorted(served)) or "none"
        raise ExportError(f"no worker serves {model!r} (served: {names}); pass --tokenizer byte|DIR for a model "
                          "not running now")
    source = tokenizer_source(workers)
    first = workers[0]
    if first.tokenizer_digest and source and source != "byte" and not tokenizers.readable_dir(source):
        # The workers' directory is on their hosts: the copy they stored on the bus.
        try:
            source = str(await tokenizers.fetch(bus.js, bus.subjects, first.tokenizer_digest))
        except Exception as exc:
            raise ExportError(f"cannot fetch {model!r}'s tokenizer from {bus.subjects.tokenizers_bucket}: "
                              f"{str(exc) or type(exc).__name__}") from None
    assert source is not None
    return source, model_max_len(workers)


def export_tokenizer(directory: str | Path, source: str, *, model: str = "", max_model_len: int | None = None) -> Path:
    """Write the Hugging Face files for tokenizer ``source`` (``byte`` or a directory)."""
    from services.gateway.chat_template import ChatTemplate

    try:
        tokenizer = load_tokenizer(source)
    except Exception as exc:  # a missing or unreadable tokenizer.json, whatever the library raises
        raise ExportError(f"cannot load tokenizer {source!r}: {exc} (--tokenizer takes `byte` or a model directory "
                          "holding tokenizer.json)") from None
    template = ChatTemplate.for_tokenizer(tokenizer).source  # the one the gateway renders
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer_json = byte_tokenizer_json()
        config: dict[str, Any] = byte_tokenizer_config()
    elif isinstance(tokenizer, HFTokenizer):
        src = Path(source)
        tokenizer_json = (src / "tokenizer.json").read_text(encoding="utf-8")
        config_path = src / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    else:  # load_tokenizer returns one of the two
        raise ExportError(f"cannot export a {type(tokenizer).__name__}")
    config["chat_template"] = template
    if max_model_len:
        config["model_max_length"] = max_model_len
    if model:
        config["name_or_path"] = model
    specials = {name: config[name] for name in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(name)}
    out = Path(directory)
    try:
        if out.exists() and not out.is_dir():
            raise ExportError(f"{out} exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        special_map = Path(source) / "special_tokens_map.json" if isinstance(tokenizer, HFTokenizer) else None
        if special_map is not None and special_map.exists():
            shutil.copyfile(special_map, out / "special_tokens_map.json")
        else:
            (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
        # A stale template file from an earlier export would override the config's in transformers.
        (out / "chat_template.jinja").unlink(missing_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out


def byte_tokenizer_json() -> str:
    """``ByteTokenizer`` as tokenizer.json: id = byte + 3, ids 0-2 special, nothing merged."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    offset = ByteTokenizer.OFFSET
    vocab = {text: i for i, text in enumerate(BYTE_SPECIALS)}
    vocab.update({char: byte + offset for byte, char in bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: without merges it changes nothing but speed; no post-processor: the
    # gateway adds no BOS.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
    return str(tok.to_str(pretty=True))


def byte_tokenizer_config() -> dict[str, Any]:
    pad, bos, eos = BYTE_SPECIALS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for i, t in enumerate(BYTE_SPECIALS)
        },
    }
