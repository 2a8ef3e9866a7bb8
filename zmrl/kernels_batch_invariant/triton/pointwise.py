"""Triton ``sigmoid_op`` and ``add_cast`` (``kernels_batch_invariant/pointwise.py``): one launch each where
the torch composition takes several on the GPU.

Elementwise over the flattened tensors in fixed tiles (``ELEMENTWISE_BLOCK``): every element runs the same
instructions wherever it sits. ``sigmoid`` is ``_common.sigmoid``, the one the fused Triton kernels inline
(``1 / (1 + exp(-x))`` in fp32); ``add_cast`` widens b, adds in fp32 and rounds once, as the torch ops do.
Backward: the torch compositions' (``with_reference_backward``): [T, H] and [T, D] elementwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import pointwise as _ops
from ._autograd import with_reference_backward
from ._common import ELEMENTWISE_BLOCK, ELEMENTWISE_WARPS, await_previous_kernel, cdiv, compute_in_fp64, pdl, sigmoid

sigmoid_op = _ops.sigmoid_op
add_cast = _ops.add_cast


@triton.jit
def _sigmoid_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    await_previous_kernel()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, sigmoid(x).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _add_cast_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    await_previous_kernel()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0.0)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(a.dtype)
    tl.store(y_ptr + offs, (a + b).to(y_ptr.dtype.element_ty), mask=m)


@sigmoid_op.register("triton")
@with_reference_backward(sigmoid_op.impls["torch"])
def sigmoid_op_triton(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:  # fp64 gradchecks; other dtypes are computed by torch as the op defines
        return sigmoid_op.impls["torch"](x)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _sigmoid_kernel[(cdiv(n, ELEMENTWISE_BLOCK),)](xc, y, n, BLOCK=ELEMENTWISE_BLOCK, num_warps=ELEMENTWISE_WARPS,
                                                           **pdl(),
                                                       )
    return y


@add_cast.register("triton")
@with_reference_backward(add_cast.impls["torch"])
def add_cast_triton(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    _ops.check_add_cast(a, b)
    if a.dtype != torch.float32 or compute_in_fp64(b):
        return add_cast.impls["torch"](a, b, out_dtype)
    ac, bc = a.contiguous(), b.contiguous()
    y = torch.empty(a.shape, dtype=out_dtype, device=a.device)
    n = ac.numel()
    if n:
        _add_cast_kernel[(cdiv(n, ELEMENTWISE_BLOCK),)](ac, bc, y, n, BLOCK=ELEMENTWISE_BLOCK,
                                                         num_warps=ELEMENTWISE_WARPS, **pdl())
    return y
