"""KDA forget gate: per-token, per-channel log-decay ``g`` (natural log, fp32).

Two variants (docs/model.md, KDA):

* Kimi Linear:   ``g = -exp(A_log[h]) * softplus(z + dt_bias)``             (g <= 0, unbounded)
* lower bound:   ``g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias))``        (g in (lb, 0))

Everything is elementwise, so a token's gate is a function of its own ``z`` alone. softplus and
sigmoid come from ``pointwise`` (composed from exp/log1p), because torch's own fp32 activations
round differently in the SIMD bulk and the scalar tail of a tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import invariant_op
from .pointwise import sigmoid, softplus


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@invariant_op
def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_heads: int,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """z: [T, H*dk] (f_b_proj output); A_log: [H] (any shape with H elements, e.g. HF's
    [1, 1, H, 1]); dt_bias: [H*dk]. Returns g: [T, H, dk] in fp32 (fp64 if z is fp64)."""
    cdt = _compute_dtype(z.dtype)
    t, hd = z.shape
    if hd % num_heads:
        raise ValueError(f"kda_gate: {hd} features do not split into {num_heads} heads")
    dk = hd // num_heads
    a = torch.exp(A_log.reshape(num_heads).to(cdt)).view(1, num_heads, 1)
    x = (z.to(cdt) + dt_bias.to(cdt).reshape(hd)).view(t, num_heads, dk)
    if lower_bound is None:
        return -a * softplus(x)
    return lower_bound * sigmoid(a * x)


def kda_gate_ref(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_heads: int,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """float64 reference (torch's own softplus/sigmoid)."""
    t, hd = z.shape
    a = torch.exp(A_log.double().reshape(num_heads)).view(1, num_heads, 1)
    x = (z.double() + dt_bias.double().reshape(hd)).view(t, num_heads, hd // num_heads)
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


# ----------------------------------------------------------------------------- fast mode (stock kernels)
# ``F.softplus`` / ``torch.sigmoid``: not invariant, for measuring what bitwise mode costs.


@kda_gate.register("fast")
def kda_gate_fast(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int,
                  lower_bound: float | None = None) -> torch.Tensor:
    cdt = torch.float64 if z.dtype == torch.float64 else torch.float32
    t, hd = z.shape
    if hd % num_heads:
        raise ValueError(f"kda_gate: {hd} features do not split into {num_heads} heads")
    a = torch.exp(A_log.reshape(num_heads).to(cdt)).view(1, num_heads, 1)
    x = (z.to(cdt) + dt_bias.to(cdt).reshape(hd)).view(t, num_heads, hd // num_heads)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)
