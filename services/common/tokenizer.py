"""Tokenizers shared by the gateway (encode once) and workers (decode output).

Gateway and worker must agree on token ids exactly, like the block hash, so the
tokenizer lives in the contract. ``byte`` is the sim models' tokenizer: one token per
UTF-8 byte plus three specials, so text and token counts agree with no files at all.
A directory holding a Hugging Face ``tokenizer.json`` loads through the ``tokenizers``
package (installed with the vLLM extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    # Read-only properties: implementations may narrow the types (ByteTokenizer always has a BOS).
    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def bos_token(self) -> str: ...

    @property
    def eos_token(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


# Text for the byte tokenizer's ids 0, 1 and 2 in its Hugging Face form (it has none of its own).
BYTE_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map, which byte-level BPE vocabularies spell tokens in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-2 are specials, 3..258 are the bytes 0..255."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3

    def __init__(self) -> None:
        self.name = "byte"
        self.vocab_size = 256 + self.OFFSET
        self.eos_token_id = self.EOS
        self.bos_token_id = self.BOS
        # The sim models' chat template needs no special strings: ids 1 and 2 have no text.
        self.bos_token = ""
        self.eos_token = ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # No special token is ever added, whatever add_special_tokens says: the exported
        # tokenizer.json has no post-processor either (``meshserve tokenizer export``).
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return self.decode_bytes(token_ids).decode("utf-8", errors="replace")
        # Specials as their exported text, between the decoded byte runs (as HF decodes it).
        parts: list[str] = []
        run: list[int] = []
        for t in token_ids:
            if 0 <= t < self.OFFSET:
                parts.append(self.decode_bytes(run).decode("utf-8", errors="replace"))
                parts.append(BYTE_SPECIALS[t])
                run = []
            else:
                run.append(t)
        parts.append(self.decode_bytes(run).decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """Each id's string in the exported vocabulary (``<|bos|>``, ``Ġ`` for a space...)."""
        chars = _BYTE_CHARS
        return [BYTE_SPECIALS[t] if 0 <= t < self.OFFSET else chars[t - self.OFFSET] if t < self.vocab_size else ""
                for t in token_ids]

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        return bytes(t - self.OFFSET for t in token_ids if self.OFFSET <= t < self.vocab_size)


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local directory (no hub access)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _HF  # optional dependency

        path = Path(directory)
        self._tok = _HF.from_file(str(path / "tokenizer.json"))
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size()
        config: dict[str, object] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
        self.chat_template: str | None = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None  # type: ignore[assignment]
        template_path = path / "chat_template.jinja"
        if template_path.is_file():  # newer checkpoints keep it apart; transformers lets it win
            self.chat_template = template_path.read_text(encoding="utf-8")
        self.eos_token_id = self._special_id(config.get("eos_token"), default=0)
        bos = self._special_id(config.get("bos_token"), default=-1)
        self.bos_token_id = bos if bos >= 0 else None
        # Chat templates (Llama's among them) render these strings themselves.
        self.bos_token = self._special_text(config.get("bos_token"))
        self.eos_token = self._special_text(config.get("eos_token"))

    @staticmethod
    def _special_text(token: object) -> str:
        if isinstance(token, dict):
            token = token.get("content")
        return token if isinstance(token, str) else ""

    def _special_id(self, token: object, default: int) -> int:
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            found = self._tok.token_to_id(token)
            if found is not None:
                return int(found)
        return default

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor
        (e.g. a BOS), as transformers' ``encode`` does by default. Prompts are encoded
        without: chat templates print their special tokens themselves."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """Each id's string in the vocabulary (transformers' ``convert_ids_to_tokens``)."""
        return [self._tok.id_to_token(t) or "" for t in token_ids]


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas without splitting a character.

    Decodes the tail since the last complete character and holds back output that ends
    in U+FFFD (an incomplete multi-byte sequence) until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._tok.decode(self._ids[self._prefix_offset :])
        if full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


_BYTE_CHARS = [bytes_to_unicode()[b] for b in range(256)]
_BYTE = ByteTokenizer()


def load_tokenizer(spec: str) -> Tokenizer:
    """``byte`` (or empty) for the sim tokenizer, else a local directory with tokenizer.json."""
    if spec in ("", "byte"):
        return _BYTE
    return HFTokenizer(spec)
