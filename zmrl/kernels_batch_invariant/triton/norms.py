"""Triton RMSNorm / LayerNorm / gated RMSNorm (KDA output norm); fast mode: ``norms.py``.

One program per row; the row is read in column blocks of a fixed width (``row_block(D)``, a function of
the model width only) in ascending order, squares/deviations are accumulated elementwise into an fp32
vector, and one ``tl.sum`` of that vector (a fixed tree for a fixed block) gives the statistic. So a
row's bits depend on the row alone, not on the number or order of rows in the call. Evaluation order
follows the torch op (``zmrl/kernels_batch_invariant/norms.py``): ``y = ((x * r) * w) [+ b | * sigmoid(g)]``.
The GPU result need not equal the CPU torch backend bitwise (different summation tree).

Backward: RMSNorm's (plain and gated) closed form as one Triton pass (``rowwise_grads.py``), LayerNorm's in
torch (``kernels_batch_invariant/grads.py``); both through ``with_analytic_backward``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import norms as _ops
from .. import grads as _grads
from . import rowwise_grads as _rowgrads
from ._autograd import with_analytic_backward
from ._common import (
    as_rows, await_previous_kernel, compute_in_fp64, pdl, row_block, row_offset, row_view, row_warps, sigmoid
)

rms_norm = _ops.rms_norm
layer_norm = _ops.layer_norm
rms_norm_gated = _ops.rms_norm_gated
add_rms_norm = _ops.add_rms_norm


@triton.jit
def _row_values(x_row, r_row, h_row, c, m, RESIDUAL: tl.constexpr, STORE_H: tl.constexpr):
    """Columns c of a row in fp32: x, or with RESIDUAL h = x + residual rounded to x's dtype (torch's add of
    two 16-bit tensors: an fp32 sum, one rounding), stored to h's row when STORE_H."""
    x = tl.load(x_row + c, mask=m, other=0.0)
    if RESIDUAL:
        h = (x.to(tl.float32) + tl.load(r_row + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        if STORE_H:
            tl.store(h_row + c, h, mask=m)
        x = h
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, r_ptr, h_ptr, D, eps, group, x_gs, x_rs, g_gs, g_rs,
                     HAS_W: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """x and the gate are ``RowView`` s of one row grouping (``group``), each with its own strides. RESIDUAL
    (``add_rms_norm``; contiguous rows): the row normalised is h = x + residual, written to h_ptr in the first
    pass and recomputed (the same rounding) in the second."""
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row_offset(row, group, x_gs, x_rs)
    y_row = y_ptr + row * D
    r_row = r_ptr + row * D
    h_row = h_ptr + row * D
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        c = start + cols
        x = _row_values(x_row, r_row, h_row, c, c < D, RESIDUAL, True)
        acc += x * x
    r = tl.math.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for start in range(0, D, BLOCK):
        c = start + cols
        m = c < D
        x = _row_values(x_row, r_row, h_row, c, m, RESIDUAL, False)
        y = x * r
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        if GATED:
            y = y * sigmoid(tl.load(g_ptr + row_offset(row, group, g_gs, g_rs) + c, mask=m, other=0.0).to(tl.float32))
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, D, eps,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    y_row = y_ptr + row * D
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        c = start + cols
        acc += tl.load(x_row + c, mask=c < D, other=0.0).to(tl.float32)
    mu = tl.sum(acc, axis=0) / D
    # Two-pass variance, mean((x - mu)^2), as the torch op (E[x^2] - mu^2 would cancel).
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        c = start + cols
        m = c < D
        d = tl.where(m, tl.load(x_row + c, mask=m, other=0.0).to(tl.float32) - mu, 0.0)
        acc += d * d
    r = tl.math.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for start in range(0, D, BLOCK):
        c = start + cols
        m = c < D
        y = (tl.load(x_row + c, mask=m, other=0.0).to(tl.float32) - mu) * r
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=m)


def _check_param(p: torch.Tensor | None, d: int, what: str, op: str) -> torch.Tensor | None:
    if p is None:
        return None
    if p.numel() != d:
        raise ValueError(f"{op}: {what} has {p.numel()} elements, expected {d} (the last dim of x)")
    return p.reshape(d).contiguous()


def _rms_launch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                out_dtype: torch.dtype | None, op: str) -> torch.Tensor:
    d = x.shape[-1]
    xv = row_view(x)  # e.g. a column slice of a fused projection's output, read in place
    w = _check_param(weight, d, "weight", op)
    gv = xv
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"{op}: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ in shape")
        gv = row_view(gate)
        if gv.group != xv.group:  # one grouping for both (the same shape gives the same, unless one was copied)
            xv, gv = row_view(x.contiguous()), row_view(gate.contiguous())
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if xv.rows and d:
        block = row_block(d)
        _rms_norm_kernel[(xv.rows,)](
            xv.base, gv.base, w if w is not None else xv.base, y, xv.base, xv.base, d, float(eps),
            xv.group, xv.group_stride, xv.row_stride, gv.group_stride, gv.row_stride,
            HAS_W=w is not None, GATED=gate is not None, RESIDUAL=False, BLOCK=block, num_warps=row_warps(block),
               **pdl(),
           )
    return y


@rms_norm.register("triton")
@with_analytic_backward(rms_norm.impls["torch"], _rowgrads.rms_norm_grads)
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if compute_in_fp64(x, weight):
        return rms_norm.impls["torch"](x, weight, eps, out_dtype)
    return _rms_launch(x, None, weight, eps, out_dtype, "rms_norm")


@rms_norm_gated.register("triton")
@with_analytic_backward(rms_norm_gated.impls["torch"], _rowgrads.rms_norm_gated_grads)
def rms_norm_gated_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if compute_in_fp64(x, gate, weight):
        return rms_norm_gated.impls["torch"](x, gate, weight, eps, out_dtype)
    return _rms_launch(x, gate, weight, eps, out_dtype, "rms_norm_gated")


@add_rms_norm.register("triton")
def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: h and its norm (``_rms_norm_kernel`` with RESIDUAL, the norm's instructions unchanged). Under
    autograd, or for an fp32/fp64 x, the add and ``rms_norm`` as two ops (their backwards; the same bits)."""
    _ops.check_add_rms_norm(x, residual)
    if (x.dtype not in (torch.bfloat16, torch.float16) or compute_in_fp64(weight)
            or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight)))):
        return add_rms_norm.impls["torch"](x, residual, weight, eps)
    d = x.shape[-1]
    xc, rc = as_rows(x), as_rows(residual)
    w = _check_param(weight, d, "weight", "add_rms_norm")
    h = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    if xc.shape[0] and d:
        block = row_block(d)
        _rms_norm_kernel[(xc.shape[0],)](
            xc, xc, w if w is not None else xc, y, rc, h, d, float(eps), 1, d, d, d, d,
            HAS_W=w is not None, GATED=False, RESIDUAL=True, BLOCK=block, num_warps=row_warps(block), **pdl())
    return h.view(x.shape), y.view(x.shape)


@layer_norm.register("triton")
@with_analytic_backward(layer_norm.impls["torch"], _grads.layer_norm_grads)
def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if compute_in_fp64(x, weight, bias):
        return layer_norm.impls["torch"](x, weight, bias, eps, out_dtype)
    d = x.shape[-1]
    x2 = as_rows(x)
    w = _check_param(weight, d, "weight", "layer_norm")
    b = _check_param(bias, d, "bias", "layer_norm")
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = row_block(d)
        _layer_norm_kernel[(x2.shape[0],)](
            x2, w if w is not None else x2, b if b is not None else x2, y, d, float(eps),
            HAS_W=w is not None, HAS_B=b is not None, BLOCK=block, num_warps=row_warps(block), **pdl())
    return y.reshape(x.shape)
