"""NATS plumbing shared by every meshserve service."""

from .client import Bus, connect
from .provision import StreamLimits, provision
from .runner import Service, run_service
from .settings import BusSettings, RunOptions

__all__ = ["Bus", "BusSettings", "RunOptions", "Service", "StreamLimits", "connect", "provision", "run_service"]
