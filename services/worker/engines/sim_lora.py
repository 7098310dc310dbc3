"""Runtime LoRA adapters in the sim (issue 21): GPU slots and a host cache, as vLLM keeps them.

vLLM runs at most ``max_loras`` distinct adapters in one batch (their weights sit in GPU
slots) and keeps up to ``max_cpu_loras`` in host memory. A request whose adapter is in
neither is loaded from storage; one in host memory only is copied to a slot. The
scheduler does not start a waiting request whose adapter would need a slot while every
slot holds an adapter the running batch uses: it skips it for later requests (vLLM V1's
scheduler does the same). A load is paid in the step that first runs the adapter.

``LoraSlots`` is that bookkeeping, pure and synchronous (``SimCore`` drives it with
simulated time): which adapters are known (their size), resident in a slot (LRU), or
cached in host memory (LRU), and how long an activation takes:
``size / disk_bytes_per_s`` from storage (then also ``size / host_to_gpu_bytes_per_s``),
``size / host_to_gpu_bytes_per_s`` from host memory, nothing when resident. Adapters
given at start (``static``) are known with no load cost: the worker was started with
them, as ``--lora-modules`` preloads vLLM. ``max_loras`` 0 keeps the old behaviour: only
the static adapters are accepted, and slots are not modelled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoraConfig:
    max_loras: int = 0  # GPU slots; 0: no runtime loading (static adapters only)
    max_cpu_loras: int = 0  # host cache; below max_loras it is raised to it (vLLM's rule)
    max_lora_rank: int = 16  # the largest rank a slot takes (vLLM's default); checked at ``adapters add``
    disk_bytes_per_s: float = 2e9  # storage → host (a local NVMe copy)
    host_to_gpu_bytes_per_s: float = 2.5e10  # PCIe 4 x16, roughly

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.max_cpu_loras < 0:
            raise ValueError("max_loras and max_cpu_loras must be ≥ 0")
        if self.disk_bytes_per_s <= 0 or self.host_to_gpu_bytes_per_s <= 0:
            raise ValueError("the adapter load bandwidths must be positive")

    @property
    def dynamic(self) -> bool:
        return self.max_loras > 0

    @property
    def host_slots(self) -> int:
        return max(self.max_cpu_loras, self.max_loras)


class LoraSlots:
    __slots__ = ("config", "gpu", "host", "load_seconds", "loads_from_disk", "loads_from_host", "sizes", "static")

    def __init__(self, config: LoraConfig, static: Iterable[str] = ()) -> None:
        self.config = config
        self.static = frozenset(static)
        self.sizes: dict[str, int] = {}  # runtime adapters seen, name → bytes
        self.gpu: OrderedDict[str, None] = OrderedDict()  # in a slot, least recently used first
        self.host: OrderedDict[str, None] = OrderedDict()  # in host memory only, LRU first
        self.loads_from_disk = 0
        self.loads_from_host = 0
        self.load_seconds = 0.0

    def accepts(self, name: str, size_bytes: int = 0) -> bool:
        """Whether a request for ``name`` can run here; a runtime adapter (with its size)
        becomes known. Static ones always can; others only with runtime loading on."""
        if name in self.static or name in self.sizes:
            return True
        if not self.config.dynamic or size_bytes <= 0:
            return False
        self.sizes[name] = size_bytes
        return True

    def can_run(self, name: str, active: Collection[str]) -> bool:
        """Whether a request for ``name`` may join a batch already running ``active``."""
        if not self.config.dynamic or name in self.static or name in active:
            return True
        busy = sum(1 for a in active if a not in self.static)
        return busy < self.config.max_loras

    def activate(self, name: str, active: Collection[str]) -> float:
        """Make ``name`` resident for a batch running ``active`` (``can_run`` held);
        the seconds its load adds to the step (0 when it is resident already)."""
        if not self.config.dynamic or name in self.static:
            return 0.0
        if name in self.gpu:
            self.gpu.move_to_end(name)
            return 0.0
        size = self.sizes[name]
        cfg = self.config
        seconds = size / cfg.host_to_gpu_bytes_per_s
        if name in self.host:
            del self.host[name]
            self.loads_from_host += 1
        else:
            seconds += size / cfg.disk_bytes_per_s
            self.loads_from_disk += 1
        if len(self.gpu) >= cfg.max_loras:
            victim = next((a for a in self.gpu if a not in active), None)
            if victim is None:  # can_run said there was room: a caller bug
                raise RuntimeError(f"no free LoRA slot for {name!r}: every slot is in use")
            del self.gpu[victim]
            self.host[victim] = None
        self.gpu[name] = None
        # Host memory holds the slots' adapters too (vLLM's CPU cache is a superset).
        while len(self.host) + len(self.gpu) > cfg.host_slots and self.host:
            self.host.popitem(last=False)
        self.load_seconds += seconds
        return seconds

    def resident(self) -> list[str]:
        """Adapters a request can use without a load: static ones and those in a slot."""
        return sorted(self.static) + [a for a in self.gpu if a not in self.static]

    def cached(self) -> list[str]:
        """Adapters in host memory only (a fast load)."""
        return list(self.host)
