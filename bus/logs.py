"""Logging: human-readable by default, JSON lines with ``MESHSERVE_LOG_FORMAT=json``."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonLinesFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str | None = None, fmt: str | None = None) -> None:
    level = (level or os.environ.get("MESHSERVE_LOG_LEVEL", "INFO")).upper()
    fmt = fmt or os.environ.get("MESHSERVE_LOG_FORMAT", "text")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLinesFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # nats-py logs every reconnect attempt at ERROR through its own callbacks; ours say it once.
    logging.getLogger("nats").setLevel(logging.WARNING)
