"""Triton backend of the batch-invariant ops (docs/numerics.md), registered under "triton" for CUDA tensors.

Rules every kernel here follows (the GPU form of the CPU rules):

* Launch configurations (tile sizes, warps, stages) are fixed per kernel or chosen from model
  dimensions only (head dims, hidden sizes), never from the number of tokens, rows or sequences, and
  never autotuned: autotuning could pick different configs in the rollout and trainer processes.
* No atomics in any reduction; K loops run in ascending order in fixed blocks. The one split K (fp32 weights,
  K > 512: ``matmul.py``) splits at fixed K offsets and adds its partials in ascending order; an atomic
  arrival counter only chooses which program of a tile does that sum.
* Reductions are one row per program with a fixed block order and fp32 accumulation.

Each module registers its kernels on the op objects of the torch backend when imported; importing
this package is a no-op where Triton is unavailable. Without a GPU the kernels still run under
Triton's interpreter (``TRITON_INTERPRET=1``) when called through ``triton_impl(op)``.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import pkgutil
from typing import Iterator

import torch

from .._dispatch import InvariantOp, get_mode

log = logging.getLogger(__name__)

# ZMRL_DISABLE_TRITON=1 keeps CUDA tensors on the torch backend (for debugging a kernel suspect).
HAS_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("ZMRL_DISABLE_TRITON") != "1"

# Every public module of this package holds kernels and registers them on import.
_MODULES: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def triton_impl(op: InvariantOp):
    """The op's Triton implementation (for tests and benchmarks that call it directly)."""
    if "triton" not in op.impls:
        raise LookupError(f"{op.name} has no triton implementation (is triton installed?)")
    return op.impls["triton"]


@contextlib.contextmanager
def triton_everywhere() -> Iterator[None]:
    """Within it, every op that has a Triton backend dispatches to it on any device, the CPU included (where
    the kernels run under ``TRITON_INTERPRET=1``): model-level interpreter tests and CPU launch counts. Fast
    mode and ops without a Triton backend keep their dispatch."""
    original = InvariantOp.backend_for

    def backend_for(self: InvariantOp, device: torch.device | None) -> str:
        if get_mode() != "fast" and "triton" in self.impls:
            return "triton"
        return original(self, device)

    InvariantOp.backend_for = backend_for  # type: ignore[method-assign]
    try:
        yield
    finally:
        InvariantOp.backend_for = original  # type: ignore[method-assign]


def load() -> list[str]:
    """Import every kernel module; returns the names that loaded."""
    loaded = []
    if not HAS_TRITON:
        return loaded
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")
        loaded.append(name)
    return loaded


load()
