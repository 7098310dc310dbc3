"""A model whose last worker left stays in the gateway's catalog for a grace period
(``services.gateway.models``), answered 503 ``no_capacity`` + Retry-After
(``normalized.resolve_model``); placement's "no capacity" carries a Retry-After too."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import pytest

from proto import ErrorCode, WorkerInfo
from proto.errors import NO_CAPACITY_RETRY_AFTER_S
from services.gateway.errors import ApiError
from services.gateway.models import MODEL_GRACE_S, ModelCatalog
from services.gateway.normalized import resolve_model
from services.gateway.tokenize_api import tokenize
from services.gateway.upstream import no_capacity
from services.router.retry import GiveUp, Refusal, after_refusal, no_worker

MODEL = "sim-llama-8b"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Registry:
    """The registry's view the catalog reads (``models``) and its change feed."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self.listeners: list[Callable[[str, WorkerInfo | None], None]] = []

    def models(self) -> dict[str, list[WorkerInfo]]:
        out: dict[str, list[WorkerInfo]] = {}
        for w in self.workers.values():
            out.setdefault(w.model, []).append(w)
        return out

    def on_change(self, listener: Callable[[str, WorkerInfo | None], None]) -> None:
        self.listeners.append(listener)

    def set(self, worker_id: str, info: WorkerInfo | None) -> None:
        if info is None:
            self.workers.pop(worker_id, None)
        else:
            self.workers[worker_id] = info
        for listener in self.listeners:
            listener(worker_id, info)


def catalog() -> tuple[ModelCatalog, Registry, Clock]:
    registry, clock = Registry(), Clock()
    models = ModelCatalog(cast(Any, registry), {}, {"llama": MODEL}, clock=clock)
    return models, registry, clock


def worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, model=MODEL, engine="sim", state="ready", tokenizer="byte",
                      max_model_len=2048)


def error_of(name: str, models: ModelCatalog) -> ApiError:
    with pytest.raises(ApiError) as info:
        resolve_model(name, models.specs(), None)
    return info.value


def test_a_model_whose_workers_left_answers_503_with_retry_after_for_the_grace_period() -> None:
    models, registry, clock = catalog()
    registry.set("w1", worker("w1"))
    served = resolve_model(MODEL, models.specs(), None)
    assert served.serving and served.limits.max_model_len == 2048
    clock.now += 3600.0  # served an hour without a request, then its worker leaves
    registry.set("w1", worker("w1"))  # a heartbeat
    registry.set("w1", None)
    clock.now += MODEL_GRACE_S - 1
    specs = models.specs()
    assert set(specs) == {MODEL, "llama"}  # still listed, with its alias, the spec it had
    assert not specs[MODEL].serving and specs[MODEL].limits == served.limits
    for name in (MODEL, "llama"):
        error = error_of(name, models)
        assert (error.status, error.code, error.type) == (503, "no_capacity", "server_error")
        assert error.headers()["Retry-After"] == "5"
    assert error_of("never-served", models).status == 404
    # A forbidden key gets the 404 it always got: keys cannot probe the catalog.
    with pytest.raises(ApiError) as info:
        resolve_model(MODEL, models.specs(), ["other-model"])
    assert info.value.status == 404

    # Tokenizing needs no replica: the gateway holds the tokenizer (vLLM's /tokenize
    # answers whenever its server is up).
    assert tokenize(json.dumps({"model": "llama", "prompt": "hi"}), models.specs()).tokens == [107, 108]
    with pytest.raises(ApiError) as info:
        tokenize(json.dumps({"model": MODEL, "prompt": "hi"}), models.specs(), allowed_models=["other-model"])
    assert info.value.status == 404

    registry.set("w2", worker("w2"))  # back
    assert resolve_model(MODEL, models.specs(), None).serving


def test_past_the_grace_period_the_model_is_unknown_again() -> None:
    models, registry, clock = catalog()
    registry.set("w1", worker("w1"))
    registry.set("w1", None)
    clock.now += MODEL_GRACE_S
    assert models.specs() == {}
    assert error_of(MODEL, models).status == 404


def test_no_capacity_from_placement_carries_a_retry_after() -> None:
    refusals = [Refusal("w1", ErrorCode.TIMEOUT, "no reply within 2.0s"),
                Refusal("w2", ErrorCode.TIMEOUT, "no reply within 2.0s")]
    give_up = after_refusal(refusals)
    assert give_up is not None and give_up.error().retry_after == NO_CAPACITY_RETRY_AFTER_S
    assert no_worker(refusals[:1], ErrorCode.NO_CAPACITY, "none ready").error().retry_after == NO_CAPACITY_RETRY_AFTER_S
    assert GiveUp(ErrorCode.UNKNOWN_MODEL, "no worker serves model 'x'").error().retry_after is None
    assert no_capacity("no ready worker").retry_after == NO_CAPACITY_RETRY_AFTER_S
