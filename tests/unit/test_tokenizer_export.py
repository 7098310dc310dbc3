"""``meshserve tokenizer export``: the directory a benchmark client loads encodes like the gateway.

Checked with the ``tokenizers`` package and the transformers-style Jinja render here;
where transformers is installed, ``AutoTokenizer.from_pretrained`` is checked too.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ops.cli import main
from ops.tiny_model import build_tokenizer_json, tokenizer_config
from ops.tokenizer_cli import export_tokenizer
from services.common.tokenizer import ByteTokenizer, load_tokenizer
from services.gateway.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate

SAMPLES = ["Hello", "héllo wörld 🙂\n\t日本語 — ünïcødé", "  two leading spaces", "<|im_start|>user\nhi<|im_end|>",
           "\x00\x7f control", "a" * 300]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🙂"}]


def _hf_render(template: str, messages: list[dict[str, str]], bos: str = "", eos: str = "") -> str:
    """Render a chat template the way transformers' apply_chat_template does."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def test_byte_export_encodes_and_decodes_like_the_gateway(tmp_path: Path) -> None:
    out = export_tokenizer(tmp_path / "tok", "byte", model="sim-llama-8b", max_model_len=2048)
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    exported = Tokenizer.from_file(str(out / "tokenizer.json"))
    gateway = ByteTokenizer()
    assert exported.get_vocab_size() == gateway.vocab_size
    for text in SAMPLES:
        ids = gateway.encode(text)
        # add_special_tokens=True is what AutoTokenizer.encode does by default: no BOS either way.
        assert exported.encode(text).ids == ids, text
        assert exported.encode(text, add_special_tokens=False).ids == ids
        assert exported.decode(ids) == gateway.decode(ids) == text
    assert exported.decode([ByteTokenizer.BOS, *gateway.encode("x"), ByteTokenizer.EOS]) == "x"  # specials skipped
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == DEFAULT_CHAT_TEMPLATE
    assert config["model_max_length"] == 2048 and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert exported.token_to_id(config["eos_token"]) == ByteTokenizer.EOS
    assert exported.token_to_id(config["bos_token"]) == ByteTokenizer.BOS
    specials = json.loads((out / "special_tokens_map.json").read_text())
    assert specials["eos_token"] == config["eos_token"]
    rendered = _hf_render(config["chat_template"], CONVERSATION)
    assert rendered == ChatTemplate().render(CONVERSATION)
    assert exported.encode(rendered).ids == gateway.encode(ChatTemplate().render(CONVERSATION))


def test_model_directory_export_keeps_its_tokenizer_and_template(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(build_tokenizer_json(512, 0))
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)))
    out = export_tokenizer(tmp_path / "tok", str(model))
    gateway = load_tokenizer(str(model))
    exported = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in SAMPLES:
        assert exported.encode(text, add_special_tokens=False).ids == gateway.encode(text)
    config = json.loads((out / "tokenizer_config.json").read_text())
    template = ChatTemplate.for_tokenizer(gateway)
    assert config["chat_template"] == template.source != DEFAULT_CHAT_TEMPLATE
    assert _hf_render(config["chat_template"], CONVERSATION, config["bos_token"], config["eos_token"]) == \
        template.render(CONVERSATION)


def test_model_directory_without_a_template_gets_the_one_the_gateway_renders(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(build_tokenizer_json(512, 0))
    config = tokenizer_config(4096)
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = export_tokenizer(tmp_path / "tok", str(model))
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == DEFAULT_CHAT_TEMPLATE


def test_transformers_autotokenizer_loads_the_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here (benchmark clients bring it)")
    out = export_tokenizer(tmp_path / "tok", "byte")
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    gateway = ByteTokenizer()
    for text in SAMPLES:
        assert auto.encode(text) == gateway.encode(text)
    prompt = auto.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt == ChatTemplate().render(CONVERSATION)


def test_cli_writes_offline_and_reports_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenizer", "export", str(tmp_path / "tok"), "--model", "sim-llama-8b", "--tokenizer", "byte"]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    capsys.readouterr()
    assert main(["tokenizer", "export", str(tmp_path / "x"), "--model", "m", "--tokenizer", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshserve tokenizer export: cannot load tokenizer") and err.count("\n") == 1
    (tmp_path / "file").write_text("")
    assert main(["tokenizer", "export", str(tmp_path / "file"), "--model", "m", "--tokenizer", "byte"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_cli_without_a_mesh_says_how_to_work_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from ops.natsserver import free_port

    monkeypatch.setenv("MESHSERVE_NATS_URL", f"nats://127.0.0.1:{free_port()}")  # nobody listens there
    # At once and as every command says it (exit 1; it took 5.6 s to say "TimeoutError", exit 2).
    assert main(["tokenizer", "export", str(tmp_path / "tok"), "--model", "sim-llama-8b", "--timeout", "30"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("meshserve tokenizer export: cannot reach NATS at") and "connection refused" in err, err
    assert "--tokenizer byte" in err and err.count("\n") == 1
