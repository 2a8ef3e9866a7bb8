"""Triton L2 normalisation over the last dim (KDA's q/k per-head norm); fast mode: ``l2norm.py``.

One program per row, column blocks of a fixed width (from the head dim only) in ascending order, an
fp32 vector accumulator and one ``tl.sum``: a row's bits depend on the row alone. Order as the torch
op: ``x / sqrt(sum(x^2) + eps)`` (a true division, not a multiply by rsqrt).
Backward: the closed form as one Triton pass (``rowwise_grads.py``, ``with_analytic_backward``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import l2norm as _ops
from . import rowwise_grads as _rowgrads
from ._autograd import with_analytic_backward
from ._common import await_previous_kernel, compute_in_fp64, pdl, row_block, row_offset, row_view, row_warps

l2_norm = _ops.l2_norm


@triton.jit
def _l2_norm_kernel(x_ptr, y_ptr, D, eps, group, group_stride, row_stride, BLOCK: tl.constexpr):
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row_offset(row, group, group_stride, row_stride)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        c = start + cols
        x = tl.load(x_row + c, mask=c < D, other=0.0).to(tl.float32)
        acc += x * x
    den = tl.sqrt(tl.sum(acc, axis=0) + eps)
    for start in range(0, D, BLOCK):
        c = start + cols
        m = c < D
        x = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + c, (x / den).to(y_ptr.dtype.element_ty), mask=m)


@l2_norm.register("triton")
@with_analytic_backward(l2_norm.impls["torch"], _rowgrads.l2_norm_grads)
def l2_norm_triton(x: torch.Tensor, eps: float = 1e-6, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if compute_in_fp64(x):
        return l2_norm.impls["torch"](x, eps, out_dtype)
    d = x.shape[-1]
    xv = row_view(x)  # q / k read where they lie in the fused projection's output: no copy
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if xv.rows and d:
        block = row_block(d)
        _l2_norm_kernel[(xv.rows,)](xv.base, y, d, float(eps), xv.group, xv.group_stride, xv.row_stride,
                                    BLOCK=block, num_warps=row_warps(block), **pdl())
    return y
