"""The models this gateway serves: what validation needs of one (``ModelSpec``: its
tokenizer, chat template and ``ModelLimits``), and the catalog of them built from the
live worker registry, aliases included, each tokenizer loaded once.

A model whose last worker left (every replica restarting at once, a rolling restart of a
small pool) stays in the catalog for ``MODEL_GRACE_S`` with the spec it had, marked not
``serving``: it is still listed, and its requests get 503 ``no_capacity`` with a
Retry-After (``normalized.resolve_model``), not the 404 of a model that does not exist,
which clients (the OpenAI SDK) take as final. A model never seen is still a 404."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec
from msgspec import Struct

from bus.tokenizers import directory_of
from proto import AdapterRecord, WorkerInfo
from proto.workers import SamplingDefaults
from services.common.tokenizer import load_tokenizer

from .chat_template import ChatTemplate

if TYPE_CHECKING:
    from bus.registry import WorkerRegistry
    from bus.tokenizers import TokenizerFiles


log = logging.getLogger(__name__)

# How long a model whose last worker left stays listed and answers 503 + Retry-After
# (workers restarting, a pool scaled to zero and back) before it is a 404 again.
MODEL_GRACE_S = 600.0


class TokenizerLike(Protocol):
    """What validation needs of a tokenizer; ``services.common.tokenizer``'s tokenizers qualify.

    Read-only properties (not ``services.common.tokenizer.Tokenizer``'s plain attributes) so any
    tokenizer whose ``vocab_size`` is an int attribute type-checks.
    """

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ModelLimits(Struct, kw_only=True, frozen=True):
    """Per-model request limits and defaults (decodable from operator config).

    ``max_tokens_cap`` None: a request may ask for the whole rest of the context.
    ``default_max_tokens`` None: chat requests without max_tokens get the rest of the
    context (vLLM's behaviour), capped by ``max_tokens_cap``; legacy completions default
    to ``default_completion_max_tokens`` (OpenAI's 16). Defaults are clamped to what
    fits; only an explicit max_tokens that does not fit is an error.

    The sampling defaults (``default_temperature`` ... ``default_repetition_penalty``)
    are what a request that omits the field gets. None: the model's own default, from
    its generation config as its workers advertise it (``WorkerInfo.sampling_defaults``,
    which also fills ``default_max_tokens`` from ``max_new_tokens``), else vLLM's neutral
    one (temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty 1). An operator's
    value wins over the model's, as vLLM's ``--override-generation-config`` does.
    """

    max_model_len: int = 4096
    max_tokens_cap: int | None = None
    # vLLM's override_max_tokens (a worker's ``--generation-config DIR``): every request's
    # max_tokens, explicit or default, is lowered to it without an error.
    max_tokens_override: int | None = None
    default_max_tokens: int | None = None
    default_completion_max_tokens: int = 16
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    default_min_p: float | None = None
    default_repetition_penalty: float | None = None
    max_temperature: float = 2.0
    max_top_k: int | None = None
    max_stop_sequences: int = 4
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_n: int = 16  # choices per request
    max_logprobs: int = 20  # top_logprobs / logprobs / prompt_logprobs (vLLM's default)
    max_logit_bias: int = 300  # entries in logit_bias (OpenAI's limit)

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be at least 1")
        if self.max_tokens_override is not None and self.max_tokens_override < 1:
            raise ValueError("max_tokens_override must be at least 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if self.default_completion_max_tokens < 1:
            raise ValueError("default_completion_max_tokens must be at least 1")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything validation needs about one served model.

    ``name`` is the canonical model name (what workers register); a catalog may map
    aliases to the same spec. ``template`` None: the tokenizer's own chat template, or
    the default ChatML one (``ChatTemplate.for_tokenizer``).
    """

    name: str
    tokenizer: TokenizerLike
    limits: ModelLimits = field(default_factory=ModelLimits)
    template: ChatTemplate = field(default=None)  # type: ignore[assignment]
    # The output parsers its workers advertise (WorkerInfo): "" = none.
    tool_parser: str = ""
    reasoning_parser: str = ""
    # A LoRA adapter of the model ``name`` (``meshserve adapters``): its requests go to
    # that model's pool with the adapter, loaded from ``lora_path`` where it is not held.
    lora: str | None = None
    lora_path: str = ""
    lora_size_bytes: int = 0
    # False: no worker serves it right now, but one did within the catalog's grace period
    # (``MODEL_GRACE_S``): listed, its requests answered 503 no_capacity + Retry-After.
    serving: bool = True

    def __post_init__(self) -> None:
        if self.template is None:
            object.__setattr__(self, "template", ChatTemplate.for_tokenizer(self.tokenizer))



def with_model_defaults(limits: ModelLimits, defaults: SamplingDefaults | None) -> ModelLimits:
    """``limits`` with the model's generation-config defaults wherever the operator set none."""
    if defaults is None:
        return limits
    model = {"default_temperature": defaults.temperature, "default_top_p": defaults.top_p,
             "default_top_k": defaults.top_k, "default_min_p": defaults.min_p,
             "default_repetition_penalty": defaults.repetition_penalty,
             "default_max_tokens": defaults.max_tokens if defaults.max_tokens and defaults.max_tokens > 0 else None,
             "max_tokens_override": (defaults.max_tokens_override
                                     if defaults.max_tokens_override and defaults.max_tokens_override > 0 else None)}
    changes = {name: value for name, value in model.items() if value is not None and getattr(limits, name) is None}
    return msgspec.structs.replace(limits, **changes) if changes else limits


def tokenizer_source(workers: list[WorkerInfo], files: TokenizerFiles | None = None) -> str | None:
    """What a model's requests are tokenized with (a ``load_tokenizer`` spec: ``byte`` or a
    directory; with ``files``, the fetched copy where this host cannot read the workers'
    directory, None while it is on its way); ``meshserve tokenizer export`` hands clients
    the same."""
    if files is not None:
        return files.source(workers[0])
    return directory_of(workers[0].model_dir, workers[0].tokenizer) or "byte"


def model_max_len(workers: list[WorkerInfo]) -> int:
    """The context every replica of a model can take (0: none of them says)."""
    return min((w.max_model_len for w in workers if w.max_model_len), default=0)


class ModelCatalog:
    def __init__(self, registry: WorkerRegistry, limits: Mapping[str, ModelLimits], aliases: Mapping[str, str],
                 adapters: Mapping[str, AdapterRecord] | None = None, tokenizer_files: TokenizerFiles | None = None,
                 *, grace_s: float = MODEL_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.tokenizer_files = tokenizer_files
        self.limits = limits
        self.aliases = aliases
        self.adapters = adapters if adapters is not None else {}  # the gateway's AdapterStore.records
        self.grace_s = grace_s
        self.clock = clock
        self._specs: dict[tuple[str, str, int, str, str, bytes], ModelSpec] = {}
        self._adapter_specs: dict[str, tuple[AdapterRecord, ModelSpec, ModelSpec]] = {}
        # Each model served → its workers when last seen serving it (its spec is built from
        # them), and when: every heartbeat of a worker serving it says so, so a model's last
        # worker leaving is known within a heartbeat, requests or not.
        self._served: dict[str, tuple[list[WorkerInfo], float]] = {}
        self._not_serving: dict[str, tuple[ModelSpec, ModelSpec]] = {}  # model → (its spec, that spec not serving)
        registry.on_change(self._registry_changed)

    def _registry_changed(self, worker_id: str, info: WorkerInfo | None) -> None:
        if info is not None and info.state in ("ready", "draining"):  # as ``WorkerRegistry.models``
            workers, _ = self._served.get(info.model, ([info], 0.0))
            self._served[info.model] = (workers, self.clock())

    def _note_served(self) -> dict[str, list[WorkerInfo]]:
        """The live registry's models, each noted as served now."""
        now = self.clock()
        live = self.registry.models()
        for model, workers in live.items():
            self._served[model] = (workers, now)
        return live

    def specs(self) -> dict[str, ModelSpec]:
        """Servable models from the live registry (aliases and adapters of served models
        included), tokenizers cached. A model name wins over an adapter of the same name.
        A model whose last worker left within ``grace_s`` is included, not ``serving``."""
        specs: dict[str, ModelSpec] = {}
        live = self._note_served()
        for model, workers in live.items():
            spec = self._spec(model, workers)
            if spec is not None:
                specs[model] = spec
        now = self.clock()
        for model, (workers, seen) in list(self._served.items()):
            if model in specs:
                continue
            if model not in live and now - seen >= self.grace_s:
                del self._served[model]
                self._not_serving.pop(model, None)
                continue
            spec = self._spec(model, workers)  # cached: the spec it had
            if spec is not None:
                specs[model] = self._waiting(model, spec)
        for alias, target in self.aliases.items():
            if target in specs:
                specs[alias] = specs[target]
        for name, record in list(self.adapters.items()):
            base = specs.get(record.base)
            if base is not None and name not in specs and base.lora is None:
                specs[name] = self._adapter_spec(name, record, base)
        return specs

    def _waiting(self, model: str, spec: ModelSpec) -> ModelSpec:
        """``spec`` marked not serving; the same object while ``spec`` is (adapters' cache)."""
        cached = self._not_serving.get(model)
        if cached is None or cached[0] is not spec:
            cached = (spec, dataclasses.replace(spec, serving=False))
            self._not_serving[model] = cached
        return cached[1]

    def _adapter_spec(self, name: str, record: AdapterRecord, base: ModelSpec) -> ModelSpec:
        """The base's spec with the adapter's fields; built once per (record, base spec):
        ``specs`` runs for every request."""
        cached = self._adapter_specs.get(name)
        if cached is not None and cached[0] is record and cached[1] is base:
            return cached[2]
        spec = dataclasses.replace(base, lora=name, lora_path=record.path, lora_size_bytes=record.size_bytes)
        self._adapter_specs[name] = (record, base, spec)
        return spec

    def _spec(self, model: str, workers: list[WorkerInfo]) -> ModelSpec | None:
        tokenizer = tokenizer_source(workers, self.tokenizer_files)
        if tokenizer is None:
            return None  # its files are on their way (bus.tokenizers): not servable yet
        max_len = model_max_len(workers) or 4096
        parsers = (workers[0].tool_parser, workers[0].reasoning_parser)
        defaults = workers[0].sampling_defaults
        cache_key = (model, tokenizer, max_len, *parsers, msgspec.msgpack.encode(defaults) if defaults else b"")
        spec = self._specs.get(cache_key)
        if spec is None:
            try:
                tok = load_tokenizer(tokenizer)
            except Exception as exc:
                log.error("cannot load tokenizer %r for %s: %s", tokenizer, model, exc)
                return None
            limits = self.limits.get(model)
            limits = msgspec.structs.replace(limits, max_model_len=max_len) if limits else ModelLimits(max_model_len=max_len)
            limits = with_model_defaults(limits, defaults)
            spec = ModelSpec(name=model, tokenizer=tok, limits=limits, tool_parser=parsers[0],
                             reasoning_parser=parsers[1])
            self._specs[cache_key] = spec
        return spec

    def block_size(self, model: str) -> int:
        """The KV block size of the model's pool (per engine: 16 on vLLM GPU, 128 on its CPU build)."""
        workers = self.registry.ready_workers(model)
        return workers[0].block_size if workers else 0
