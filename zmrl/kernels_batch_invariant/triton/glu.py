"""Triton SwiGLU / SiTU-GLU (elementwise); fast-mode backends are in ``glu.py``.

Elementwise: every element runs the same instruction sequence wherever it sits, so the result is
row-invariant by construction; tiles are fixed (``ELEMENTWISE_BLOCK``) over the flattened tensor.
Order as the torch op: ``(g * sigmoid(g)) * u`` and
``((beta * tanh(g / beta)) * sigmoid(g)) * (linear_beta * tanh(u / linear_beta))`` (no cap on u when
linear_beta is None); the betas are fp32 runtime scalars (K3: 4 and 25).
Backward: SwiGLU's closed form as one Triton pass (``rowwise_grads.py``), SiTU-GLU's in torch
(``kernels_batch_invariant/grads.py``); both through ``with_analytic_backward``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import glu as _ops
from .. import grads as _grads
from . import rowwise_grads as _rowgrads
from ._autograd import with_analytic_backward
from ._common import (
    ELEMENTWISE_BLOCK, ELEMENTWISE_WARPS, await_previous_kernel, cdiv, compute_in_fp64, pdl, sigmoid, tanh
)

swiglu = _ops.swiglu
situ_glu = _ops.situ_glu


@triton.jit
def _glu_kernel(g_ptr, u_ptr, y_ptr, n, width, g_stride, u_stride, beta, linear_beta, SITU: tl.constexpr,
                CAP_UP: tl.constexpr, BLOCK: tl.constexpr):
    """y [n / width, width] contiguous; gate and up rows ``g_stride`` / ``u_stride`` elements apart (the two
    column halves of a fused gate|up projection output are read where they lie)."""
    await_previous_kernel()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    row = offs // width
    col = offs - row * width
    g = tl.load(g_ptr + row * g_stride + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + col, mask=m, other=0.0).to(tl.float32)
    if SITU:
        if CAP_UP:
            u = linear_beta * tanh(u / linear_beta)
        y = ((beta * tanh(g / beta)) * sigmoid(g)) * u
    else:
        y = (g * sigmoid(g)) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def _launch(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None, situ: bool, beta: float = 4.0,
            linear_beta: float | None = 25.0) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    y = torch.empty(gate.shape, dtype=out_dtype or gate.dtype, device=gate.device)
    n = y.numel()
    if n:
        width = gate.shape[-1]
        _glu_kernel[(cdiv(n, ELEMENTWISE_BLOCK),)](
            g, u, y, n, width, g.stride(0), u.stride(0), float(beta), float(linear_beta or 1.0), SITU=situ,
            CAP_UP=linear_beta is not None, BLOCK=ELEMENTWISE_BLOCK, num_warps=ELEMENTWISE_WARPS, **pdl())
    return y


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [R, width] rows with adjacent columns: in place when it is (a column slice, e.g. the gate or up half
    of a fused projection output), else a contiguous copy."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


@swiglu.register("triton")
@with_analytic_backward(swiglu.impls["torch"], _rowgrads.swiglu_grads)
def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    _ops._check(gate, up, "swiglu")
    if compute_in_fp64(gate, up):
        return swiglu.impls["torch"](gate, up, out_dtype)
    return _launch(gate, up, out_dtype, situ=False)


@situ_glu.register("triton")
@with_analytic_backward(situ_glu.impls["torch"], _grads.situ_glu_grads)
def situ_glu_triton(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None, beta: float = 4.0,
                    linear_beta: float | None = 25.0) -> torch.Tensor:
    _ops._check(gate, up, "situ_glu")
    _ops._check_betas(beta, linear_beta)
    if compute_in_fp64(gate, up):
        return situ_glu.impls["torch"](gate, up, out_dtype, beta, linear_beta)
    return _launch(gate, up, out_dtype, situ=True, beta=beta, linear_beta=linear_beta)
