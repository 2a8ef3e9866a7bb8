"""A CPU platform for verl (``VERL_PLATFORM=cpu``), so that ``main_ppo`` runs on a machine without an
accelerator: Ray places the workers on logical GPUs (``ray_kwargs.ray_init.num_gpus``), tensors stay on
the CPU, collectives use gloo.

verl's training worker initialises ``torch.distributed`` with the backend string
``"cpu:gloo,<device>:<backend>"``, which torch rejects when both halves name the CPU. The platform is
first asked for its device name while that string is built, inside the worker and before the
process-group check; at that point the Ray worker's rendezvous variables (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) are set, so the platform initialises the process group itself,
with gloo, and verl's own call finds it initialised. Nothing of verl is replaced.
"""
from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM_NAME = "cpu"
_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the accelerator calls verl makes around training (memory statistics, cache
    release, RNG state, device name): on the CPU they are no-ops or zeros."""
    mod = types.ModuleType("zmrl_verl_cpu_device")
    for name in ("synchronize", "current_stream", "stream", "Stream", "Event", "device_count", "is_available",
                 "current_device", "set_device"):
        if hasattr(torch.cpu, name):
            setattr(mod, name, getattr(torch.cpu, name))
    zero = lambda *a, **k: 0
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.set_device = lambda *a, **k: None
    mod.get_device_name = lambda *a, **k: "CPU"  # verl's FLOPs table has a "CPU" entry
    mod.empty_cache = lambda: None
    mod.max_memory_allocated = zero
    mod.max_memory_reserved = zero
    mod.memory_allocated = zero
    mod.memory_reserved = zero
    mod.reset_peak_memory_stats = lambda *a, **k: None
    mod.mem_get_info = lambda *a, **k: (0, 0)
    mod.memory_stats = lambda *a, **k: {}
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_rng_state = torch.get_rng_state
    mod.set_rng_state = torch.set_rng_state
    return mod


def init_gloo_process_group() -> bool:
    """Initialise torch.distributed with gloo from the Ray worker's rendezvous variables, once; False when
    they are not set (not inside a verl worker) or a group already exists."""
    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        return False
    if any(v not in os.environ for v in _RENDEZVOUS_VARS):
        return False
    torch.distributed.init_process_group(backend="gloo", rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]),
                                         init_method=os.environ.get("DIST_INIT_METHOD") or None)
    return True


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl on CPU cores: device "cpu", backend gloo, Ray resource "GPU" (declared as logical GPUs)."""

    _device_module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        init_gloo_process_group()
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # never auto-detected: selected explicitly with VERL_PLATFORM=cpu
        return False

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
