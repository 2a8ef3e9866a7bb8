"""Triton KDA forget gate (elementwise); fast-mode backend in ``kda_gate.py``.

``g = -exp(A_log[h]) * softplus(z + dt_bias)`` or ``g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias))``:
every element is a function of its own ``z`` and the per-head parameters, computed by the same
instruction sequence wherever it sits (fixed tiles over the flattened [T, H*dk]), so row-invariant by
construction. Backward: the closed form as one Triton pass (``rowwise_grads.py``; parameter gradients in
torch, ``kernels_batch_invariant/grads.py``), through ``with_analytic_backward``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import kda_gate as _ops
from . import rowwise_grads as _rowgrads
from ._autograd import with_analytic_backward
from ._common import (
    ELEMENTWISE_BLOCK, ELEMENTWISE_WARPS, await_previous_kernel, cdiv, compute_in_fp64, pdl, sigmoid, softplus
)

kda_gate = _ops.kda_gate


@triton.jit
def _kda_gate_kernel(z_ptr, a_ptr, b_ptr, g_ptr, n, HD, DK, lower_bound,
                     LOWER: tl.constexpr, BLOCK: tl.constexpr):
    await_previous_kernel()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    col = offs % HD
    head = col // DK
    a = tl.exp(tl.load(a_ptr + head, mask=m, other=0.0).to(tl.float32))
    x = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32) + tl.load(b_ptr + col, mask=m, other=0.0).to(tl.float32)
    if LOWER:
        g = lower_bound * sigmoid(a * x)
    else:
        g = -a * softplus(x, 20.0)
    tl.store(g_ptr + offs, g, mask=m)


@kda_gate.register("triton")
@with_analytic_backward(kda_gate.impls["torch"], _rowgrads.kda_gate_grads)
def kda_gate_triton(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int,
                    lower_bound: float | None = None) -> torch.Tensor:
    t, hd = z.shape
    if hd % num_heads:
        raise ValueError(f"kda_gate: {hd} features do not split into {num_heads} heads")
    if compute_in_fp64(z):
        return kda_gate.impls["torch"](z, A_log, dt_bias, num_heads, lower_bound)
    dk = hd // num_heads
    zc = z.contiguous()
    a = A_log.reshape(num_heads).contiguous()
    b = dt_bias.reshape(hd).contiguous()
    g = torch.empty(t, num_heads, dk, dtype=torch.float32, device=z.device)
    n = zc.numel()
    if n:
        _kda_gate_kernel[(cdiv(n, ELEMENTWISE_BLOCK),)](
            zc, a, b, g, n, hd, dk, float(lower_bound if lower_bound is not None else 0.0),
            LOWER=lower_bound is not None, BLOCK=ELEMENTWISE_BLOCK, num_warps=ELEMENTWISE_WARPS, **pdl())
    return g
