"""Backward of ``expert_linear`` (moe_gemm.py) without a loop over experts.

For expert-sorted rows (rows ``offsets[e]:offsets[e+1]`` went through expert e's weight W_e [N, K]):

    dx[rows of e] = gy[rows of e] @ W_e          dW_e = gy[rows of e]^T @ x[rows of e]

Two implementations, one contract (``expert_linear_grads``):

* Triton kernels (triton/expert_grads.py; they register themselves here when the Triton backend loads):
  grouped GEMMs that read the expert-sorted rows in place and write dx and dW directly, for CUDA
  tensors (and CPU tensors under ``TRITON_INTERPRET=1``, the kernels' CPU tests). fp64 never goes there.
* The torch path below (``expert_linear_grads_torch``: CPU, fp64 gradchecks, CUDA without Triton). The
  experts are put into buckets by the size class of their row count (ceil(log2(count))), and each
  bucket is one batched GEMM over its experts, their rows gathered into a padded [experts, P, .]
  block (P = the bucket's largest count): so the number of GEMM launches is the number of size classes
  (a handful; at most log2(M) + 1), not the number of experts, and padding costs less than 2x the rows.
  The padded slots of the output gradient are exact zeros, so they add exact zeros to dW (their x rows
  are real rows of x, finite, left unmasked); their dx rows land in one spare row that is dropped. The
  scatter back into dx writes each real row once (no accumulation, so dx needs no zero fill: rows
  ``offsets[0]:offsets[E]`` cover all M rows), and the GEMMs are stock batched GEMMs.

Both are deterministic run to run; neither is batch-invariant (the backward need not be:
docs/numerics.md).

Compute dtype (both paths): 16-bit GEMMs with fp32 accumulation when x and the weights share a 16-bit
dtype on CUDA (the output gradient is rounded to it, as the Triton ``linear`` backward does), fp64 for
fp64, fp32 otherwise (on CUDA at the numerics contract's ``backward_matmul_precision``, TF32 by
default). Gradients are returned in the dtypes of x and of the weights.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .host import to_device_async
from .numerics import with_backward_matmuls

Weights = torch.Tensor | Sequence[torch.Tensor]

_HALF = (torch.bfloat16, torch.float16)


def size_buckets(counts: Sequence[int]) -> list[list[int]]:
    """Experts with rows, grouped by ceil(log2(count)) (ascending): in each bucket the largest count
    is less than twice the smallest, so padding every expert to the largest wastes < 2x."""
    groups: dict[int, list[int]] = {}
    for e, c in enumerate(counts):
        if c > 0:
            groups.setdefault((c - 1).bit_length(), []).append(e)
    return [groups[k] for k in sorted(groups)]


def _compute_dtype(a: torch.dtype, b: torch.dtype, cuda: bool) -> torch.dtype:
    if torch.float64 in (a, b):
        return torch.float64
    if cuda and a == b and a in _HALF:
        return a
    return torch.float32


def _stack(weights: Weights, experts: list[int], sel: torch.Tensor) -> torch.Tensor:
    if isinstance(weights, torch.Tensor):
        return weights.index_select(0, sel)
    return torch.stack([weights[e] for e in experts])


Grads = tuple[torch.Tensor | None, list[torch.Tensor | None]]
GradsFn = Callable[[torch.Tensor, "torch.Tensor | None", Weights, Sequence[int], bool, Sequence[bool], torch.dtype],
                   Grads]

# The kernel implementation and the devices it takes (set by triton/expert_grads.py when it loads).
_kernel_grads: tuple[GradsFn, Callable[[torch.device], bool]] | None = None


def register_kernel_grads(fn: GradsFn, runs_on: Callable[[torch.device], bool]) -> None:
    """Install the kernel backward ``fn`` for gradients on devices where ``runs_on(device)``."""
    global _kernel_grads
    _kernel_grads = (fn, runs_on)


def expert_linear_grads(gy: torch.Tensor, x: torch.Tensor | None, weights: Weights, offsets: Sequence[int],
                        need_x: bool, need_w: Sequence[bool], x_dtype: torch.dtype) -> Grads:
    """(dx, weight gradients) of ``expert_linear(x, weights, offsets)`` given the output gradient ``gy``.

    gy: [M, N]; x: [M, K] (only read when a weight gradient is needed); weights: E x [N, K] or [E, N, K];
    offsets: E+1 host ints; need_w: one flag per weight tensor (one for stacked weights). Returns dx
    [M, K] in ``x_dtype`` (or None) and a list with one gradient per weight tensor (None where not
    needed; per-expert weights: None also for an expert without rows, as autograd would give; stacked
    weights: a single [E, N, K] gradient, zero for experts without rows).

    The Triton kernels where they are registered for gy's device, unless an operand is fp64; else the
    torch path (``expert_linear_grads_torch``).
    """
    w0 = weights if isinstance(weights, torch.Tensor) else weights[0]
    fp64 = torch.float64 in (gy.dtype, w0.dtype, x_dtype) or (x is not None and x.dtype == torch.float64)
    if _kernel_grads is not None and not fp64 and _kernel_grads[1](gy.device):
        return _kernel_grads[0](gy, x, weights, offsets, need_x, need_w, x_dtype)
    return expert_linear_grads_torch(gy, x, weights, offsets, need_x, need_w, x_dtype)


def expert_linear_grads_torch(gy: torch.Tensor, x: torch.Tensor | None, weights: Weights, offsets: Sequence[int],
                              need_x: bool, need_w: Sequence[bool], x_dtype: torch.dtype) -> Grads:
    """``expert_linear_grads`` with stock batched GEMMs over size-class buckets (the module doc)."""
    stacked = isinstance(weights, torch.Tensor)
    w_list = [weights] if stacked else list(weights)
    k = weights.shape[2] if stacked else w_list[0].shape[1]
    m = gy.shape[0]
    dev = gy.device
    w_dtype = w_list[0].dtype
    any_w = any(need_w)
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    n_e = len(counts)
    buckets = size_buckets(counts)
    idle = [e for e, c in enumerate(counts) if c == 0]
    # Every index the loop needs, in one host-to-device copy: row starts, counts, each bucket's experts, idle experts.
    packed = to_device_async(torch.tensor([*offsets[:-1], *counts, *(e for b in buckets for e in b), *idle],
                                          dtype=torch.int64), dev)
    starts_all, counts_all = packed[:n_e], packed[n_e:2 * n_e]
    # One spare row: padded slots scatter their dx rows there, so the scatter needs no boolean-mask copy
    # of the batched result; the spare row is dropped at the end. Every real row is written exactly once
    # below (the experts' row ranges tile [0, M)), so the buffer is not zero-filled.
    dx_spare = torch.empty(m + 1, k, dtype=x_dtype, device=dev) if need_x else None
    dx = None if dx_spare is None else dx_spare[:m]
    if stacked:
        dws: list[torch.Tensor | None] = [None]
        if need_w[0]:
            # Experts with rows get their gradient copied in below; only the others need zeros.
            if m == 0 or len(idle) == len(counts):
                dws[0] = torch.zeros_like(weights)
            else:
                dws[0] = torch.empty_like(weights)
                if idle:
                    dws[0].index_fill_(0, packed[packed.numel() - len(idle):], 0)
    else:
        dws = [None] * len(w_list)  # filled per expert below; an expert without rows gets None, as autograd
    if m == 0 or not (need_x or any_w):
        if dx_spare is not None:
            dx.zero_()  # (no rows: an empty tensor)
        return dx, dws
    cuda = dev.type == "cuda"
    at = 2 * n_e
    for experts in buckets:
        p = max(counts[e] for e in experts)
        sel = packed[at:at + len(experts)]
        at += len(experts)
        col = torch.arange(p, device=dev)
        full = all(counts[e] == p for e in experts)  # no padded slot in this bucket (e.g. a single expert)
        rows = starts_all[sel][:, None] + col[None, :]
        if not full:
            valid = col[None, :] < counts_all[sel][:, None]  # [B, P]
            rows = torch.where(valid, rows, 0)  # padded slots read row 0 ...
        g = gy[rows]  # [B, P, N]
        if not full and any_w:
            g = g.masked_fill(~valid[..., None], 0)  # ... and are zeroed where they would reach dW
        if need_x:
            w = _stack(weights, experts, sel)  # [B, N, K]
            cdt = _compute_dtype(x_dtype, w_dtype, cuda)
            out = torch.bmm(g.to(cdt), w.to(cdt)).to(x_dtype)  # [B, P, K]
            dst = (rows if full else torch.where(valid, rows, m)).reshape(-1)
            dx_spare.index_copy_(0, dst, out.reshape(-1, k))  # real rows are written once each
        if any_w:
            xs = x[rows]  # [B, P, K]; padded slots hold row 0 against a zero output gradient
            cdt = _compute_dtype(x.dtype, w_dtype, cuda)
            dwb = torch.bmm(g.to(cdt).transpose(1, 2), xs.to(cdt)).to(w_dtype)  # [B, N, K]
            if stacked:
                if dws[0] is not None:
                    dws[0].index_copy_(0, sel, dwb)
            else:
                # per-expert weights (trained only without LoRA): one copy out of the batched result each
                for i, e in enumerate(experts):
                    if need_w[e]:
                        dws[e] = dwb[i].clone()
    return dx, dws


class ExpertLinearFn(torch.autograd.Function):
    """``expert_linear`` with ``forward`` given by the caller (the backend's invariant forward) and the
    grouped backward above. Used by the torch backend; the Triton backend's own Function calls
    ``expert_linear_grads`` too."""

    @staticmethod
    def forward(ctx, fwd, x: torch.Tensor, offsets: list[int], out_dtype: torch.dtype,  # type: ignore[override]
                stacked: bool, *weights: torch.Tensor) -> torch.Tensor:
        ctx.offsets, ctx.stacked, ctx.x_dtype = offsets, stacked, x.dtype
        ctx.save_for_backward(x if any(ctx.needs_input_grad[5:]) else None, *weights)
        return fwd(x, weights[0] if stacked else list(weights), offsets, out_dtype)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        ws: Weights = weights[0] if ctx.stacked else weights
        dx, dws = expert_linear_grads(gy, x, ws, ctx.offsets, ctx.needs_input_grad[1],
                                      list(ctx.needs_input_grad[5:]), ctx.x_dtype)
        return (None, dx, None, None, None, *dws)
