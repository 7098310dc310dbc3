"""Inference engines behind one interface (``base.Engine``); pick one with ``create_engine``."""

from .base import (
    ENGINE_NAMES,
    Engine,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    create_engine,
)

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "create_engine",
]
