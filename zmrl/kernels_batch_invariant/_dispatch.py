"""Backend dispatch for batch-invariant ops.

Every op is written once as a torch composition (the "torch" backend, used on CPU and as the
portable fallback). A Triton backend registers itself under the same name for CUDA tensors, and a
"fast" backend (stock kernels, not invariant) exists so users can measure what bitwise mode costs.
The caller never chooses a backend per call: the device of the first tensor argument and the global
mode decide, so the engine and the trainer always reach the same implementation.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Literal

import torch

Mode = Literal["bitwise", "fast"]
_mode: Mode = "bitwise"


def get_mode() -> Mode:
    return _mode


def _set_dispatch_mode(mode: Mode) -> None:
    """Only ``numerics.apply_numerics`` calls this: the mode is part of the process's numerics contract."""
    global _mode
    _mode = mode


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


class InvariantOp:
    """A named op with one implementation per backend ("torch", "triton", "fast")."""

    def __init__(self, fn: Callable[..., Any]):
        functools.update_wrapper(self, fn)
        self.name = fn.__name__
        self.impls: dict[str, Callable[..., Any]] = {"torch": fn}

    def register(self, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(impl: Callable[..., Any]) -> Callable[..., Any]:
            self.impls[backend] = impl
            return impl

        return deco

    def backend_for(self, device: torch.device | None) -> str:
        if _mode == "fast" and "fast" in self.impls:
            return "fast"
        if device is not None and device.type == "cuda" and "triton" in self.impls:
            return "triton"
        return "torch"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = _first_tensor(args, kwargs)
        return self.impls[self.backend_for(t.device if t is not None else None)](*args, **kwargs)

    def __repr__(self) -> str:
        return f"InvariantOp({self.name}, backends={sorted(self.impls)})"


def invariant_op(fn: Callable[..., Any]) -> InvariantOp:
    """Decorator: the decorated torch function becomes the op's reference backend."""
    return InvariantOp(fn)
