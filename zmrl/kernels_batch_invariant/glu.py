"""Gated-linear-unit activations for the MLP / expert hidden layer.

Both are elementwise, so invariance only needs every element to be computed by the same
arithmetic wherever it sits in the tensor: torch's fp32 sigmoid/SiLU are not (SIMD bulk and scalar
tail differ in the last ulp), so the sigmoid is ``pointwise.sigmoid`` and everything else is
IEEE ``* /`` and fp32 ``tanh``/``exp``. Computed in fp32 (fp64 stays fp64), cast once at the end to
``out_dtype`` (default: the dtype of ``gate``). Fixed evaluation order (a Triton backend must match):

    swiglu:   (g * sigmoid(g)) * u
    situ_glu: ((beta * tanh(g / beta)) * sigmoid(g)) * (linear_beta * tanh(u / linear_beta))
              (linear_beta None: the up branch is u itself; K3 uses beta 4, linear_beta 25)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import invariant_op
from .pointwise import sigmoid, silu


def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(gate: torch.Tensor, up: torch.Tensor, name: str) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")


@invariant_op
def swiglu(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu(gate) * up``. gate, up: [..., I]; returns [..., I]."""
    _check(gate, up, "swiglu")
    cdt = _cdt(gate.dtype)
    return (silu(gate.to(cdt)) * up.to(cdt)).to(out_dtype or gate.dtype)


def _check_betas(beta: float, linear_beta: float | None) -> None:
    if not beta > 0 or (linear_beta is not None and not linear_beta > 0):
        raise ValueError(f"situ_glu: beta={beta} and linear_beta={linear_beta} must be > 0 (linear_beta may be None)")


@invariant_op
def situ_glu(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None, beta: float = 4.0,
             linear_beta: float | None = 25.0) -> torch.Tensor:
    """Kimi K3 SiTU-GLU: ``beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta)``.

    gate, up: [..., I]. ``linear_beta`` None leaves the up branch uncapped (``u``)."""
    _check(gate, up, "situ_glu")
    _check_betas(beta, linear_beta)
    cdt = _cdt(gate.dtype)
    g, u = gate.to(cdt), up.to(cdt)
    # Soft caps: the gate branch is bounded by beta, the linear branch by linear_beta (both ~identity near 0).
    a = (beta * torch.tanh(g / beta)) * sigmoid(g)
    b = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (a * b).to(out_dtype or gate.dtype)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """float64 reference for ``swiglu``."""
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


def situ_glu_ref(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
                 linear_beta: float | None = 25.0) -> torch.Tensor:
    """float64 reference for ``situ_glu``."""
    g, u = gate.double(), up.double()
    b = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * b


# ----------------------------------------------------------------------------- fast mode (stock kernels)
# ``F.silu`` / ``torch.tanh``: not invariant, for measuring what bitwise mode costs.


@swiglu.register("fast")
def swiglu_fast(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    _check(gate, up, "swiglu")
    cdt = _cdt(gate.dtype)
    return (F.silu(gate.to(cdt)) * up.to(cdt)).to(out_dtype or gate.dtype)


@situ_glu.register("fast")
def situ_glu_fast(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None, beta: float = 4.0,
                  linear_beta: float | None = 25.0) -> torch.Tensor:
    _check(gate, up, "situ_glu")
    _check_betas(beta, linear_beta)
    cdt = _cdt(gate.dtype)
    g, u = gate.to(cdt), up.to(cdt)
    b = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * b).to(out_dtype or gate.dtype)
