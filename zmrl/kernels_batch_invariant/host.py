"""Host-to-device copies that do not stall the host."""
from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor built this step, on ``device``. On CUDA it goes through pinned memory, non-blocking:
    ``t.to("cuda")`` from pageable memory waits for the stream to drain (a stall of everything queued so far).
    The caching host allocator keeps the pinned block until the copy has run."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
