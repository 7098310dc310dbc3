"""A tokenizer's files as one content-named bundle (bus.tokenizers), and what reads them."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from bus.tokenizers import TOKENIZER_FILES, bundle, directory_of, unpack
from ops.tiny_model import build_tokenizer_json, tokenizer_config
from services.common.tokenizer import HFTokenizer


def tiny_tokenizer(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(build_tokenizer_json(512, 0))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)))
    (directory / "model.safetensors").write_bytes(b"weights stay on the GPU host")
    return directory


def test_the_bundle_is_named_by_its_content_and_carries_only_tokenizer_files(tmp_path: Path) -> None:
    a = tiny_tokenizer(tmp_path / "a")
    b = tiny_tokenizer(tmp_path / "b")  # the same files elsewhere, written later
    packed_a, packed_b = bundle(a), bundle(b)
    assert packed_a is not None and packed_b is not None
    assert packed_a == packed_b  # same files, same digest and bytes (no paths, no mtimes)
    digest, data = packed_a
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["tokenizer.json", "tokenizer_config.json"]
    (b / "chat_template.jinja").write_text("{{ messages }}")
    other = bundle(b)
    assert other is not None and other[0] != digest
    assert bundle(tmp_path / "empty") is None  # no tokenizer.json: nothing to carry


def test_unpacking_checks_the_digest_and_the_entries(tmp_path: Path) -> None:
    packed = bundle(tiny_tokenizer(tmp_path / "src"))
    assert packed is not None
    digest, data = packed
    target = unpack(digest, data, tmp_path / "cache")
    assert target == tmp_path / "cache" / digest
    assert HFTokenizer(target).encode("hello world") == HFTokenizer(tmp_path / "src").encode("hello world")
    assert unpack(digest, data, tmp_path / "cache") == target  # already there
    with pytest.raises(ValueError, match="does not match its digest"):
        unpack(digest, data + b"x", tmp_path / "other")
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        entry = tarfile.TarInfo("../escape")
        entry.size = 1
        tar.addfile(entry, io.BytesIO(b"x"))
    import hashlib

    evil_digest = hashlib.sha256(evil.getvalue()).hexdigest()
    with pytest.raises(ValueError, match="unexpected entry"):
        unpack(evil_digest, evil.getvalue(), tmp_path / "cache")
    assert not (tmp_path / "escape").exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [digest]  # no staging left behind


def test_a_separate_chat_template_file_wins_as_in_transformers(tmp_path: Path) -> None:
    directory = tiny_tokenizer(tmp_path / "m")
    assert HFTokenizer(directory).chat_template == tokenizer_config(4096)["chat_template"]
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert HFTokenizer(directory).chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert "chat_template.jinja" in TOKENIZER_FILES


def test_the_directory_a_worker_reads_its_tokenizer_from() -> None:
    assert directory_of("/models/llama", "/models/llama") == "/models/llama"
    assert directory_of("", "/tok") == "/tok"  # an echo engine given a tokenizer
    assert directory_of("", "byte") == "" and directory_of("", "") == ""


async def test_a_digest_that_is_not_one_never_names_a_directory(tmp_path: Path) -> None:
    """A registry entry is input: ``../`` in its digest must not pick a local directory."""
    from bus.tokenizers import TokenizerFiles, fetch
    from proto import WorkerInfo
    from proto.subjects import Subjects

    evil = "../../" + "a" * 58
    with pytest.raises(ValueError, match="not a tokenizer digest"):
        await fetch(None, Subjects(), evil, tmp_path)  # type: ignore[arg-type]
    files = TokenizerFiles(None, Subjects(), into=tmp_path)  # type: ignore[arg-type]
    info = WorkerInfo(worker_id="w", model="m", engine="vllm", model_dir="/elsewhere/m", tokenizer_digest=evil)
    assert files.source(info) == "/elsewhere/m"  # as without a digest: nothing fetched, nothing loaded from the cache
    files.want(info)
    assert not files._tasks
