"""NATS plumbing shared by every meshserve service."""

from .client import Bus, connect
from .provision import StreamLimits, provision
from .runner import Service, run_service, run_services
from .settings import BusSettings, RunOptions
from .tasks import cancel_and_wait

__all__ = ["Bus", "BusSettings", "RunOptions", "Service", "StreamLimits", "cancel_and_wait", "connect", "provision", "run_service", "run_services"]
