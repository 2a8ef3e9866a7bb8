"""Backward of ``expert_linear`` (moe_gemm.py) as two grouped Triton GEMMs over the expert-sorted rows.

For rows ``offsets[e]:offsets[e+1]`` that went through expert e's weight W_e [N, K]:

    dx[rows of e] = gy[rows of e] @ W_e            (``_expert_dx_kernel``)
    dW_e          = gy[rows of e]^T @ x[rows of e]  (``_expert_dw_kernel``)

Both read gy, x and the weights in place (any strides; per-expert weights through the forward's cached
weight-offset table, triton/matmul.py ``_expert_weight_table``) and write their results straight into
dx [M, K] and one [E, N, K] weight-gradient buffer: no padding, gather, scatter or dtype-copy kernels.

* dx is ``expert_linear(gy, W^T)``: one program per (row tile of one expert, column tile of K); each
  program finds its expert and rows from the E+1 row offsets on the device, as the forward kernel does;
  the grid is the exact tile count from the host offsets. Rows of all experts tile [0, M), so every row
  of dx is written once (no zero fill).
* dW: one program per (expert, N tile, K tile), walking that expert's rows in ascending BLOCK_R steps
  with an fp32 accumulator (no split over rows, no atomics). An expert without rows writes zeros.

Run to run the gradients are bitwise equal: the tiles are a function of the shapes alone and every
output element is one accumulator fed in a fixed order. They are not batch-invariant (the backward need
not be: docs/numerics.md).

Compute class, as in the torch path (moe_gemm_grads.py): when x and the weights share a 16-bit dtype
the operands are that dtype (an fp32 output gradient is rounded to it in registers, to nearest even, as
the Triton ``linear`` backward does with a cast) and the dots are tensor-core MMAs with fp32
accumulation; anything else is computed in fp32 (16-bit operands upcast in registers, exactly) with dots
at the numerics contract's ``backward_matmul_precision``: TF32 ("tf32", the default), bf16 MMAs of the
tiles rounded in registers ("bf16"; the tile configs are TF32's) or IEEE FMA ("ieee"). Results are rounded
once to x's dtype (dx) and the weights' dtype (dW).

Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tests) a dot is an explicit fp32 product and
sum (the interpreter's bf16 dot is wrong), its fp32 -> 16-bit conversions truncate, so a 16-bit class
output gradient is rounded on the host beforehand and 16-bit results are stored as fp32 and rounded by
torch: the same values the compiled kernel computes in registers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import moe_gemm_grads as _grads
from ..moe_gemm import RowGather
from ..host import to_device_async
from ..numerics import current_numerics
from ._common import INTERPRET, await_previous_kernel, cdiv, next_pow2, pdl
from . import matmul as _matmul  # linear_config looked up at every call (benchmarks may replace it)
from .matmul import _TL_DTYPE, GemmConfig, _expert_weight_table, dot_acc, expert_tile, expert_weight_offset

_HALF = (torch.bfloat16, torch.float16)
# The dW grid should cover the H100/H200's 132 SMs about twice (shape-derived, so fixed per shape).
MIN_DW_PROGRAMS = 264


@dataclass(frozen=True)
class WeightGradConfig:
    """Tiles of the weight-gradient kernel: a [block_n, block_k] output tile, block_r rows per step."""

    block_n: int
    block_k: int
    block_r: int
    num_warps: int
    num_stages: int


def compute_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The class of a product with x of ``x_dtype`` and weights of ``w_dtype``: their shared 16-bit
    dtype, else fp32 (moe_gemm_grads.py's rule on CUDA)."""
    return x_dtype if (x_dtype == w_dtype and x_dtype in _HALF) else torch.float32


def _clamp_pow2(v: int, cap: int) -> int:
    """A tile dim for an extent v: its power of two, at least 16 (tl.dot's minimum), at most cap."""
    return max(16, min(cap, next_pow2(v)))


def dx_config(k_out: int, n_red: int, dtype: torch.dtype, rows_per_expert: int, precision: str) -> GemmConfig:
    """Tiles for dx [M, k_out] = gy [M, n_red] @ W_e [n_red, k_out] per expert, in ``GemmConfig``'s
    terms (block_n: dx columns, block_k: the reduction step). 16-bit: the forward's tiles for the same
    product (``linear_config``); fp32 at TF32: 128-row tiles with a 32-wide step; IEEE: the forward's fp32
    tiles. Each dim is cut to the extent's power of two (a 32-wide LoRA factor gets no 128-wide tile)."""
    if dtype in _HALF or precision == "ieee":
        cfg = _matmul.linear_config(k_out, n_red, dtype, rows_per_expert, experts=True)
    else:
        cfg = GemmConfig(128 if rows_per_expert > 64 else 64, 64, 32, 4, 3)
    return GemmConfig(cfg.block_m, _clamp_pow2(k_out, cfg.block_n), _clamp_pow2(n_red, cfg.block_k),
                      cfg.num_warps, cfg.num_stages)


def dw_config(n: int, k: int, n_experts: int, dtype: torch.dtype, precision: str) -> WeightGradConfig:
    """Tiles for dW_e [n, k] over the expert's rows. 16-bit: up to 128x128 tiles, 64 rows per step;
    fp32: up to 64x128 (TF32) or 64x64 (IEEE) tiles, 32 rows per step (fp32 tiles take twice the shared
    memory). Tiles shrink (K first) until the E x tiles grid has ``MIN_DW_PROGRAMS`` programs, where the
    dims allow it."""
    half = dtype in _HALF
    bn = _clamp_pow2(n, 128 if half else 64)
    bk = _clamp_pow2(k, 128 if (half or precision != "ieee") else 64)
    while n_experts * cdiv(n, bn) * cdiv(k, bk) < MIN_DW_PROGRAMS and max(bn, bk) > 32:
        if bk >= bn:
            bk //= 2
        else:
            bn //= 2
    return WeightGradConfig(bn, bk, 64 if half else 32, 8 if bn * bk >= 128 * 128 else 4, 3)


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _to_class(v, CDT: tl.constexpr):
    """An operand tile in the compute class: 16-bit by round-to-nearest-even, fp32 exactly."""
    if v.dtype.primitive_bitwidth > CDT.primitive_bitwidth:
        out = v.to(CDT, fp_downcast_rounding="rtne")
    else:
        out = v.to(CDT)
    return out


@triton.jit
def _dx_term(acc, g_ptr, w_ptr, woff, offs_m, m_mask, offs_k, k_mask, N,
             stride_gm, stride_gn, stride_wn, stride_wk,
             CDT: tl.constexpr, HALF: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
             BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """acc + gy[rows, :N] @ W[:N, k tile] for one expert's weight (``woff`` elements after ``w_ptr``), the
    reduction in ascending BLOCK_N steps."""
    offs_n = tl.arange(0, BLOCK_N)
    g_ptrs = g_ptr + offs_m.to(tl.int64)[:, None] * stride_gm + offs_n[None, :] * stride_gn
    w_ptrs = w_ptr + woff + offs_n[:, None] * stride_wn + offs_k.to(tl.int64)[None, :] * stride_wk
    for n0 in tl.range(0, N, BLOCK_N, num_stages=STAGES):  # ascending, fixed steps
        n_mask = offs_n < N - n0
        g = tl.load(g_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot_acc(acc, _to_class(g, CDT), _to_class(w, CDT), HALF, PRECISION, INTERPRET)
        g_ptrs += BLOCK_N * stride_gn
        w_ptrs += BLOCK_N * stride_wn
    return acc


@triton.jit(do_not_specialize=["M"])
def _expert_dx_kernel(
    gy_ptr, w_ptr, dx_ptr, offs_ptr, woff_ptr,
    M, N, K, N_EXPERTS, TILES_K,
    stride_gm, stride_gn,
    stride_wg, stride_wn, stride_wk,
    stride_xm, stride_xk,
    g2_ptr, w2_ptr, N2,
    stride_g2m, stride_g2n,
    stride_w2g, stride_w2n, stride_w2k,
    W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr, CDT: tl.constexpr, HALF: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    STAGES: tl.constexpr,
    TERM2: tl.constexpr = False, CDT2: tl.constexpr = tl.float32, HALF2: tl.constexpr = False,
    BLOCK_N2: tl.constexpr = 16,
):
    """dx[rows, k tile] = sum_n gy[rows, n] * W_e[n, k tile] (+ sum_n g2[rows, n] * W2_e[n, k tile] with TERM2)
    for one BLOCK_M tile of expert e's rows, one fp32 accumulator, one rounding.

    Program pid: row tile pid // TILES_K, column tile pid % TILES_K (the column tiles of a row tile are
    neighbours, so its gy rows are read from HBM once and from L2 by the rest). Row tiles are numbered
    expert after expert (each expert's rows cut into BLOCK_M tiles from its first row: a tile never holds
    two experts' rows) and found from the E+1 int32 row offsets; the grid holds exactly the tiles. Expert e's
    weight starts ``woff_ptr[e]`` elements after ``w_ptr`` (W_TABLE, per-expert weights) or ``e * stride_wg``
    elements on (stacked). The second term (TERM2: stacked weights W2 [E, N2, K], its own compute class
    CDT2) is the gradient of another product of the same rows, added in the same accumulator after the
    first: the MoE's gate/up products and their LoRA A products (``expert_input_grad``)."""
    await_previous_kernel()
    pid = tl.program_id(0)
    pid_m = pid // TILES_K
    pid_k = pid % TILES_K
    # the grid holds exactly the tiles: every slot is one
    _, expert, row0, row_end = expert_tile(offs_ptr, pid_m, M, N_EXPERTS, BLOCK_M, BLOCK_E)
    woff = expert_weight_offset(woff_ptr, expert, stride_wg, W_TABLE, W_ALIGN)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_mask = offs_m < row_end
    k_mask = offs_k < K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc = _dx_term(acc, gy_ptr, w_ptr, woff, offs_m, m_mask, offs_k, k_mask, N, stride_gm, stride_gn,
                   stride_wn, stride_wk, CDT, HALF, PRECISION, INTERPRET, BLOCK_N, STAGES)
    if TERM2:
        # a short reduction (LoRA ranks): not pipelined, so the first term keeps its shared memory
        acc = _dx_term(acc, g2_ptr, w2_ptr, expert.to(tl.int64) * stride_w2g, offs_m, m_mask, offs_k, k_mask, N2,
                       stride_g2m, stride_g2n, stride_w2n, stride_w2k, CDT2, HALF2, PRECISION, INTERPRET, BLOCK_N2, 1)
    dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=m_mask[:, None] & k_mask[None, :])


@triton.jit
def _expert_dw_kernel(
    gy_ptr, x_ptr, dw_ptr, offs_ptr,
    N, K, TILES_N, TILES_K,
    stride_gm, stride_gn,
    stride_xm, stride_xk,
    stride_de, stride_dn, stride_dk,
    CDT: tl.constexpr, HALF: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    gidx_ptr=None, GATHER_DIV: tl.constexpr = 0,
):
    """dW[e, n tile, k tile] = sum over expert e's rows r of gy[r, n tile]^T x[r, k tile].

    Program pid: expert pid // (TILES_N * TILES_K) (an expert's tiles are neighbours, so they share its
    rows in L2), then its N tile and K tile. The rows offs[e]:offs[e+1] are walked in ascending BLOCK_R
    steps into one fp32 accumulator; an expert without rows stores zeros. GATHER_DIV > 0: row r of x is
    ``x[gidx[r] // GATHER_DIV]`` (the forward's gathered rows, read where they lie: ``RowGather``)."""
    await_previous_kernel()
    pid = tl.program_id(0)
    per_expert = TILES_N * TILES_K
    expert = pid // per_expert
    tile = pid % per_expert
    pid_n = tile // TILES_K
    pid_k = tile % TILES_K
    lo = tl.load(offs_ptr + expert)
    hi = tl.load(offs_ptr + expert + 1)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    k_mask = offs_k < K
    rows = (lo + offs_r).to(tl.int64)
    # gy^T tiles [BLOCK_N, BLOCK_R] are read through gy's strides (no transposed copy)
    g_ptrs = gy_ptr + offs_n.to(tl.int64)[:, None] * stride_gn + rows[None, :] * stride_gm
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):  # ascending, fixed steps
        r_mask = offs_r < hi - r0
        g = tl.load(g_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if GATHER_DIV > 0:
            src = (tl.load(gidx_ptr + r0 + offs_r, mask=r_mask, other=0) // GATHER_DIV).to(tl.int64)
            xs = tl.load(x_ptr + src[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        else:
            xs = tl.load(x_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot_acc(acc, _to_class(g, CDT), _to_class(xs, CDT), HALF, PRECISION, INTERPRET)
        g_ptrs += BLOCK_R * stride_gm
        x_ptrs += BLOCK_R * stride_xm
    dw_ptrs = (dw_ptr + expert.to(tl.int64) * stride_de + offs_n.to(tl.int64)[:, None] * stride_dn
               + offs_k[None, :] * stride_dk)
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


# --------------------------------------------------------------------------------------- host side
def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a kernel stores into: fp32 under the interpreter for 16-bit results (its fp32 -> 16-bit
    conversion truncates; torch then rounds to nearest even, as the compiled kernel's store does)."""
    return torch.float32 if (INTERPRET and dtype in _HALF) else dtype


def _operand(t: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """Under the interpreter, a wider operand of a 16-bit class is rounded here (see ``_store_dtype``)."""
    if INTERPRET and cdt in _HALF and t.dtype != cdt:
        return t.to(cdt)
    return t


@dataclass(frozen=True)
class DxTerm:
    """One product of the rows x whose input gradient ``expert_input_grad`` adds: the output gradient gy [M, N]
    and the product's weights (E x [N, K] or [E, N, K]), whose compute class with x is ``cdt``."""

    gy: torch.Tensor
    weights: _grads.Weights
    cdt: torch.dtype


def _launch_dx(term: DxTerm, offs: torch.Tensor, n_experts: int, offsets: Sequence[int], dx: torch.Tensor,
               precision: str, config: GemmConfig | None, term2: DxTerm | None = None) -> None:
    gy, cdt = term.gy, term.cdt
    m, n = gy.shape
    k = dx.shape[1]
    cfg = config or dx_config(k, n, cdt, cdiv(m, n_experts), precision)
    w3, woff, align = _expert_weight_table(term.weights, gy.device)
    n_tiles = sum(cdiv(b - a, cfg.block_m) for a, b in zip(offsets, offsets[1:]))
    if n_tiles == 0:
        return
    tiles_k = cdiv(k, cfg.block_n)
    if term2 is None:
        g2, w2, n2, step2, cdt2 = gy, w3, 0, 16, torch.float32  # (unread)
    else:
        g2, w2, cdt2 = _operand(term2.gy, term2.cdt), term2.weights, term2.cdt
        if not isinstance(w2, torch.Tensor) or w2.dim() != 3 or w2.shape[2] != k or g2.shape != (m, w2.shape[1]):
            raise ValueError(f"expert_input_grad: the second term needs stacked weights [E, N2, {k}] and gy [{m}, N2], "
                             f"got {tuple(g2.shape)} and {getattr(w2, 'shape', type(w2))}")
        n2 = w2.shape[1]
        step2 = dx_config(k, n2, cdt2, cdiv(m, n_experts), precision).block_k
    _expert_dx_kernel[(n_tiles * tiles_k,)](
        _operand(gy, cdt), w3, dx, offs, woff if woff is not None else offs,
        m, n, k, n_experts, tiles_k,
        gy.stride(0), gy.stride(1),
        w3.stride(0), w3.stride(1), w3.stride(2),
        dx.stride(0), dx.stride(1),
        g2, w2, n2,
        g2.stride(0), g2.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        W_TABLE=woff is not None, W_ALIGN=align, CDT=_TL_DTYPE[cdt], HALF=cdt in _HALF,
        PRECISION=precision, INTERPRET=INTERPRET,
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_n, BLOCK_N=cfg.block_k, BLOCK_E=max(16, next_pow2(n_experts)),
        STAGES=cfg.num_stages, TERM2=term2 is not None, CDT2=_TL_DTYPE[cdt2], HALF2=cdt2 in _HALF, BLOCK_N2=step2,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl(),
    )


def expert_input_grad(term: DxTerm, offsets: Sequence[int], x_dtype: torch.dtype, term2: DxTerm | None = None,
                      *, dx_tiles: GemmConfig | None = None) -> torch.Tensor:
    """dx [M, K] of rows x that fed one or two expert products: ``term.gy @ W_e`` (+ ``term2.gy @ W2_e``) over
    each expert's rows, summed in one fp32 accumulator and rounded once to ``x_dtype``.

    What autograd would compute as one [M, K] gradient per product and an add per extra product: the MoE's
    gate and up products (their weights side by side, as one term) and their LoRA A products (the second
    term, fp32 class) leave four [M, K] results and three adds behind; this writes dx once. ``term2`` must
    have stacked weights; the tiles are the first term's (``dx_tiles`` replaces them), the second term's
    reduction runs in its own class's step after the first term's, unpipelined (LoRA ranks are short)."""
    n_experts = term.weights.shape[0] if isinstance(term.weights, torch.Tensor) else len(term.weights)
    if len(offsets) != n_experts + 1:
        raise ValueError(f"expert_input_grad: {n_experts} experts need {n_experts + 1} offsets, got {len(offsets)}")
    m = term.gy.shape[0]
    k = term.weights.shape[2] if isinstance(term.weights, torch.Tensor) else term.weights[0].shape[1]
    dev = term.gy.device
    if m == 0 or k == 0:
        return torch.zeros(m, k, dtype=x_dtype, device=dev)
    out = torch.empty(m, k, dtype=_store_dtype(x_dtype), device=dev)  # every row is written
    offs = to_device_async(torch.tensor(offsets, dtype=torch.int32), dev)
    _launch_dx(term, offs, n_experts, offsets, out, current_numerics().backward_matmul_precision, dx_tiles, term2)
    return out.to(x_dtype)


def _launch_dw(gy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, dw: torch.Tensor, cdt: torch.dtype,
               precision: str, config: WeightGradConfig | None, gather: RowGather | None = None) -> None:
    n_experts, n, k = dw.shape
    cfg = config or dw_config(n, k, n_experts, cdt, precision)
    tiles_n, tiles_k = cdiv(n, cfg.block_n), cdiv(k, cfg.block_k)
    gy, x = _operand(gy, cdt), _operand(x, cdt)
    gidx = None if gather is None else gather.index.to(device=gy.device, dtype=torch.int64).contiguous()
    _expert_dw_kernel[(n_experts * tiles_n * tiles_k,)](
        gy, x, dw, offs,
        n, k, tiles_n, tiles_k,
        gy.stride(0), gy.stride(1),
        x.stride(0), x.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        CDT=_TL_DTYPE[cdt], HALF=cdt in _HALF, PRECISION=precision, INTERPRET=INTERPRET,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r,
        gidx_ptr=gidx, GATHER_DIV=0 if gather is None else gather.div,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl(),
    )


def expert_linear_grads_triton(gy: torch.Tensor, x: torch.Tensor | None, weights: _grads.Weights,
                               offsets: Sequence[int], need_x: bool, need_w: Sequence[bool], x_dtype: torch.dtype,
                               *, dx_tiles: GemmConfig | None = None, dw_tiles: WeightGradConfig | None = None,
                               x_gather: RowGather | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """``moe_gemm_grads.expert_linear_grads`` with the kernels above (same arguments and results).

    ``dx_tiles`` / ``dw_tiles`` replace the shape-derived tiles (tests sweep them; benchmarks try others).
    ``x_gather``: the product's rows were ``x_gather.rows(x)`` (x is their source); the weight gradient reads them
    there.
    Per-expert weights get views of one [E, N, K] buffer as their gradients (None for an expert without
    rows or whose gradient is not needed)."""
    stacked = isinstance(weights, torch.Tensor)
    w_list = [weights] if stacked else list(weights)
    n_experts = weights.shape[0] if stacked else len(w_list)
    if len(offsets) != n_experts + 1:
        raise ValueError(f"expert_linear backward: {n_experts} experts need {n_experts + 1} offsets, "
                         f"got {len(offsets)}")
    n, k = (weights.shape[1], weights.shape[2]) if stacked else w_list[0].shape
    m = gy.shape[0]
    dev = gy.device
    w_dtype = w_list[0].dtype
    precision = current_numerics().backward_matmul_precision
    any_w = any(need_w)
    live = m > 0 and n > 0 and k > 0
    offs = to_device_async(torch.tensor(offsets, dtype=torch.int32), dev) if live and (need_x or any_w) else None

    dx = None
    if need_x:
        if not live:
            dx = torch.zeros(m, k, dtype=x_dtype, device=dev)
        else:
            out = torch.empty(m, k, dtype=_store_dtype(x_dtype), device=dev)  # every row is written
            _launch_dx(DxTerm(gy, weights, compute_dtype(x_dtype, w_dtype)), offs, n_experts, offsets, out, precision,
                       dx_tiles)
            dx = out.to(x_dtype)

    dws: list[torch.Tensor | None] = [None] * len(w_list)
    if any_w:
        if x is None:
            raise ValueError("expert_linear backward: a weight gradient needs x")
        if not live:
            buf = torch.zeros(n_experts, n, k, dtype=w_dtype, device=dev)
        else:
            out = torch.empty(n_experts, n, k, dtype=_store_dtype(w_dtype), device=dev)  # every expert is written
            _launch_dw(gy, x, offs, out, compute_dtype(x.dtype, w_dtype), precision, dw_tiles, x_gather)
            buf = out.to(w_dtype)
        if stacked:
            dws[0] = buf
        else:
            dws = [buf[e] if need and b > a else None
                   for e, (need, a, b) in enumerate(zip(need_w, offsets, offsets[1:]))]
    return dx, dws


def _runs_here(device: torch.device) -> bool:
    """CUDA tensors, and CPU tensors under the interpreter (the CPU tests of these kernels)."""
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")


_grads.register_kernel_grads(expert_linear_grads_triton, _runs_here)
