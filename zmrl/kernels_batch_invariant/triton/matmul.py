"""Triton GEMMs: ``linear``, ``linear_concat``, ``linear_blockdiag``, ``grouped_linear``, ``bmm_fixed`` and
the MoE ``expert_linear``.

One kernel (``_gemm_kernel``) computes every product here. A program owns one [BLOCK_M, BLOCK_N]
output tile, walks K in ascending BLOCK_K steps with an fp32 accumulator (no atomics), adds the bias
in fp32 and rounds once to the output dtype. Products with an fp32 weight and K > ``SPLIT_K_CHUNK``
(the LoRA A factors) split K into fixed chunks, one program each, summed in ascending order by
``_split_k_sum``: the split depends on (K, dtypes) only. Why a row's bits do not depend on M:

* Every output element is one fp32 accumulator fed by the 16-wide MMA steps over K in ascending order;
  the tile shape only decides which program computes it. Measured on the H200 (benchmarks/probes/
  h200_probe.py, results/2026-11-29_probe_h200.json): bf16 products gave the same bits for every
  BLOCK_M in {16..128}, BLOCK_N in {32..256}, BLOCK_K in {32, 64, 128} and 4 or 8 warps (mma.sync and
  wgmma alike). ``linear_config`` therefore may pick a small-tile config for decode-sized M and a
  large-tile one for prefill/training M; the GPU tests sweep M across the bucket boundary and assert
  ``torch.equal`` row by row, which is what guards this. Rows beyond M (and K/N beyond the edge) are
  loaded as exact zeros, which add nothing.
* M (and the per-tile row bounds of the grouped mode) are runtime values that Triton must not
  specialise on (``do_not_specialize``), so M=1 does not compile a different kernel.
* ``expert_linear`` runs the same kernel body over expert tiles (each tile's expert and row range;
  tiles never straddle two experts) with ``linear_config(..., experts=True)`` for the expert's (N, K): a row's
  result equals Triton ``linear(row, weights[e])`` bitwise. Each program finds its tile from the
  E+1 row offsets in the kernel (no host-built table), so the offsets may stay on the device: the
  grid is then the fixed upper bound ``M // BLOCK_M + min(E, M)`` tiles and programs past the live
  tile count exit at once (CUDA-graph capture, docs/cuda_graph_decode.md item 7). Host offsets take
  the same kernel with the exact tile count as grid, so both give the same bits.

Operand precision: bf16/fp16 x bf16/fp16 (same dtype) uses tensor-core dots with fp32 accumulation
(the products are exact in fp32). fp32 activations against bf16 weights (MLA's fp32 attention output
through W_UV) split each activation into three bf16 pieces and run three bf16 MMAs: exact products,
fp32 accuracy, tensor-core speed. bf16 activations against fp32 weights (the LoRA A factors, an fp32
router) split the weight tile the same way, and fp32 x fp32 (the fp32 LoRA intermediate through
lora_B, fp32 models) splits both and sums the six products down to 2^-16 relative (what it drops is
below 2^-24 of |x||W|): fp32-accurate, on the tensor cores. Other mixes (fp16 with fp32) compute in
fp32 with IEEE dots (``input_precision="ieee"``: no TF32). Both sides of the parity contract run these
kernels, so the split is part of the shared numerics (which dots a dtype pair takes is fixed by the
dtypes alone, never by M). fp64 inputs only come from gradchecks: they run the torch backend.
Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tests) the dot is an explicit fp32 product
and sum over each K block: the interpreter computes bf16 dots wrongly, and its fp32 dot (numpy/BLAS)
is not row-invariant within a tile; the compiled GPU kernel always uses ``tl.dot``.

Decode (M = 1..8) is memory-bound: the time is the weight read, so that read must be spread over
many SMs although split-K is not allowed. ``linear_config`` therefore picks BLOCK_N per N so that
even one M tile gives at least ``MIN_DECODE_PROGRAMS`` programs where N allows it (BLOCK_N 128 ->
64 -> 32), and uses the large 128x128 tile only for wide outputs (lm_head, q_b, kv_b, the dense MLP)
where it still leaves >= 64 programs. Narrow outputs (N <= 2048, e.g. 2048 -> 2048 projections) get
64x32 tiles: more programs at decode, at the cost of some prefill efficiency (A is re-read N/32
times, from L2). ``benchmarks/gemm_invariant_vs_cublas.py --sweep`` measures alternatives.

A delta starts the sum: ``delta`` (fp32, laid out as the output) is the accumulator's initial value and the K
products accumulate onto it; the bias follows, then the one rounding. (The torch backend adds the delta after
the sum: the backends need not agree bitwise, each one's ``delta=`` and ``lora=`` calls must.) Starting from the
delta keeps one accumulator in the tile: a delta added after the K loop needs a second one for the LoRA
product, which capped the tile at 128 x 128 (a 256-wide tile spilled) and halved the programs per SM; the
delta first allows 128 x 256 tiles, 21-29 % faster on the trainer's LoRA shapes
(benchmarks/results/2026-12-06_lora_prologue_probe_h100.json).

LoRA delta from its factors: ``linear`` / ``expert_linear`` / ``linear_concat`` / ``grouped_linear`` take a LoRA delta
as its up factors (``lora``: t = x @ A^T in fp32, B, the scale) and compute ``scale * t @ B^T`` before the K loop,
with the six split MMAs of the standalone fp32 x fp32 product in its order from zero, then the scale: the same
bits as computing the delta with ``linear(t, B)`` and passing it, without the launch and without writing and
reading the fp32 [M, N] delta (at decode the B products were the slowest GEMMs per byte; at training the routed
down projection's delta is [T * k, hidden] in fp32).

Autograd: hand-written backwards with stock torch matmuls (the backward need not be invariant, only
correct): dX = dY @ W, dW = dY^T X, dbias = sum dY. 16-bit operands use 16-bit cuBLAS GEMMs (fp32
accumulation inside) so the backward never materialises an fp32 copy of a large weight; anything
with an fp32 operand runs in fp32 at the contract's ``backward_matmul_precision`` (TF32 tensor cores
by default, ``numerics.backward_matmuls``).

Weights of ``expert_linear``: the experts' ``[N, K]`` weights stay where the model holds them (one
Linear per expert, per-expert checkpoint names). Instead of re-stacking them every forward (a copy of
all expert weights per call) or caching a stacked copy (doubles expert memory and must be invalidated
on every optimizer step), the kernel gets the element offset of each expert's weight from the
lowest-addressed one: an int64 table of E entries, cached keyed on the weights' addresses (the table
is a function of the addresses alone, so the cache can never be stale). Expert parallelism can pass
its local experts' weights and offsets unchanged. A table used while a CUDA graph is being captured
is pinned in the cache for the life of the process (the graph keeps reading its address); a table
missing during capture is an error (warm the call up eagerly first, as capture requires anyway).
Stacked ``[E, N, K]`` weights need no table: expert e's weight is ``e * stride(0)`` elements on.

``bmm_fixed`` uses the same kernel with tiles chosen from its per-matrix shape (m, n, k), which the
op's contract fixes by the model; the batch count never enters.
"""
from __future__ import annotations

import collections
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from .. import matmul as _ops
from .. import moe_gemm as _moe
from ..backward_gemms import HALF, fp32_out_gemms, mm_fp32_factor
from ..moe_gemm_grads import expert_linear_grads
from ..numerics import with_backward_matmuls
from ._common import (INTERPRET, arrival_counters, await_previous_kernel, capturing, cdiv, compute_in_fp64,
                      last_to_arrive, next_pow2, pdl, reset_arrivals)

log = logging.getLogger(__name__)

linear = _ops.linear
linear_concat = _ops.linear_concat
linear_blockdiag = _ops.linear_blockdiag
bmm_fixed = _ops.bmm_fixed
grouped_linear = _ops.grouped_linear
expert_linear = _moe.expert_linear

_HALF = (torch.bfloat16, torch.float16)
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# A decode step (one M tile) should still occupy at least this many SMs (H100/H200 have 132).
MIN_DECODE_PROGRAMS = 64


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of one GEMM; a function of (N, K, operand dtype) only."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> "GemmConfig":
        """``"64x32x64/w4/s4"`` -> GemmConfig (for benchmark command lines)."""
        tile, w, s = text.split("/")
        bm, bn, bk = (int(v) for v in tile.split("x"))
        return cls(bm, bn, bk, int(w.lstrip("w")), int(s.lstrip("s")))


# Row-count buckets: up to SMALL_M one 16-row tile with a 128-wide K step; up to DECODE_M the decode
# configs (parallelism over N); up to BATCH_M (batched decode, RL rollouts at batch 64-256) 64-row tiles
# with BLOCK_N picked so that a 128-256-row step still spreads over most SMs (128x128 tiles gave N = 2048
# outputs 32 programs: 3x cuBLAS's time at M = 256, benchmarks/results/2026-11-30_gemm_h200.json); up to
# LARGE_M 128x128 tiles; above it 256x128 (best for nearly every bench shape at M=4096 in the 2026-11-29
# H200 sweep). The SMALL_M config, measured in the bench model's decode
# step at batch 1 (H200, 2026-11-30, GEMM device time per step): 64x32x64 4.97 ms, 16x32x64 4.83 ms,
# 16x32x128 4.29 ms. A split fp32 operand (three bf16 pieces) keeps a 64-wide K step in every bucket (_launch):
# its several dots per K step make the step size part of its accumulation order.
SMALL_M = 16
SPLIT_BLOCK_K = 64
# Column tiles of 128 from which an output counts as vocabulary-wide (N >= 64K: only the lm_head)
LM_HEAD_TILES = 512
DECODE_M = 64
BATCH_M = 256
# Outputs at most this wide count as narrow at training / prefill rows (LoRA A products: r, or 5 r fused)
NARROW_N = 192
LARGE_M = 1024


def _bucket(m: int) -> int:
    return -1 if m <= SMALL_M else 0 if m <= DECODE_M else 1 if m <= BATCH_M else 2 if m < LARGE_M else 3


def linear_config(n: int, k: int, dtype: torch.dtype, m: int = 1, experts: bool = False) -> GemmConfig:
    """Tiles for ``y[m, n] = x[m, k] @ W[n, k]^T`` with operands of ``dtype`` (the compute dtype:
    bf16/fp16 for tensor-core dots, fp32 for IEEE dots). ``m`` only selects a bucket (decode-sized or
    not), which changes which program computes an element, not its bits (module doc); for a grouped
    expert product (``experts``) ``m`` is the mean rows per expert.

    Benchmarks may replace this module-level function to try other configs; it is looked up at
    every call.
    """
    return _linear_config(n, dtype, _bucket(m), experts)


@functools.lru_cache(maxsize=1024)
def _linear_config(n: int, dtype: torch.dtype, bucket: int, experts: bool = False) -> GemmConfig:
    # Decode-sized tiles were picked per product from benchmarks/lora_gemms.py --sweep (every config the
    # same bits; benchmarks/results/2026-12-01_lora_sweep_dbdebaf_h200.json): narrow outputs (the LoRA A
    # products, N = r) and the grouped fp32 LoRA B expert products (~8-32 rows per expert) run fastest on
    # 16/32-row tiles, the B expert products on wide column tiles.
    if dtype in _HALF:
        if bucket == -1:
            return GemmConfig(16, 32, 128, 4, 4)
        # Decode-step products at 64 and 256 rows, timed alone with a cold L2 by benchmarks/decode_gemms.py --sweep
        # (bits equal under every config; benchmarks/results/2026-12-05_decode_gemms_sweep_h100.json, H100): the
        # expert products at ~32 rows per expert (batch 256) run 64 x 64 tiles (gate / up with LoRA 44.5 -> 36.3 us,
        # down 58.8 -> 50.2 us); outputs up to 2048 wide at 17-64 rows and up to 1024 wide at 65-256 rows run the
        # one-row-block tile with a 128-wide K step, more programs over N (64 rows: shared-expert gate|up 12.2 ->
        # 8.7 us, MLA o_proj 42.2 -> 28.5 us, KDA o_proj 12.9 -> 9.6 us; 256 rows: gate|up 12.4 -> 10.2 us); a
        # split product's K step stays 64 whatever the config (_launch). Inside the graph-replayed step (activations
        # hot in L2, launches overlapping) the gain was within noise: GEMM kernels 4.94 -> 4.89 ms at batch 256.
        if experts and bucket == 0 and n > 64:
            return GemmConfig(64, 64, 64, 4, 4)
        if (bucket == 0 and n <= 2048) or (bucket == 1 and n <= 1024):
            return GemmConfig(16, 32, 128, 4, 4)
        if bucket >= 2 and n <= NARROW_N:
            # training / prefill rows of narrow outputs (the LoRA A products x @ A^T with the fp32 A split into
            # three bf16 pieces, dense and per expert; the router): one or a few column tiles, so the rows carry
            # the parallelism. 16K tokens, replayed alone (train_gemms.py --sweep, bits equal under every config;
            # benchmarks/results/2026-12-06_train_gemms_sweep_5684a47_h200.json): KDA's five A factors N 160 0.758 -> 0.153
            # ms, MoE gate|up A N 64 0.298 -> 0.065 ms, expert A N 32 over 128K rows 0.567 -> 0.249 ms
            return GemmConfig(128, 32, 64, 4, 4)
        if bucket == 3:
            if cdiv(n, 128) >= LM_HEAD_TILES:  # the lm_head at 1024-row chunks: 1.552 -> 1.474 ms (same sweep)
                return GemmConfig(128, 128, 64, 8, 3)
            return GemmConfig(256, 128, 64, 8, 3)
        if bucket == 2:
            return GemmConfig(128, 128, 64, 4, 4)
        if bucket == 1:  # 2-4 row tiles of 64: BLOCK_N so that N alone gives >= 32 column tiles
            if cdiv(n, 128) >= LM_HEAD_TILES:
                # the vocabulary-wide lm_head: 128-row tiles read its 0.67 GB weight half as often; at 256 rows
                # 421 -> 359 us, at 128 rows 198 us, the sweep's best there (benchmarks/results/
                # 2026-12-02_gemm_sweep_6c4c92b_h200.json)
                return GemmConfig(128, 128, 64, 8, 3)
            if cdiv(n, 128) >= 32:
                return GemmConfig(64, 128, 64, 4, 4)
            # up to 2048 wide: 64 x 32 tiles (KDA o_proj 14.3 -> 13.5 us, MLA o_proj 47.3 -> 45.2 us at 256 rows)
            return GemmConfig(64, 32, 64, 4, 4)
        if cdiv(n, 128) >= MIN_DECODE_PROGRAMS:
            return GemmConfig(128, 128, 64, 8, 4)
        if cdiv(n, 64) >= MIN_DECODE_PROGRAMS:
            return GemmConfig(64, 64, 64, 4, 4)
        return GemmConfig(64, 32, 64, 4, 4)
    # The fp32 class: both operands split (fp32 x fp32, six bf16 MMAs per K step; _launch fixes their
    # BLOCK_K) or IEEE FMA dots (smaller K steps keep the tiles in registers). 64-row tiles above one row
    # for dense products: 16/32-row tiles for every fp32 product at decode made the decode step's GEMMs
    # slower on the H200, 4.45 -> 4.79 ms at batch 64 and 6.27 -> 7.08 ms at 256
    # (benchmarks/results/2026-12-01_h200_summary.md, fifth session); the expert rule below is per product.
    if experts and bucket in (-1, 0):  # B expert r -> hidden at 8 / 32 rows per expert: 45.9 -> 23.3 / 49.9 -> 34.3 us
        wide = n >= 1024  # measured at N = 256 (r -> inter) and N = 2048 (r -> hidden) only
        if bucket == -1:
            return GemmConfig(16, 128, 32, 4, 3) if wide else GemmConfig(16, 64, 32, 4, 3)
        return GemmConfig(32, 128, 32, 4, 3) if wide else GemmConfig(16, 128, 32, 4, 3)
    if bucket == -1:  # B r -> hidden at one row: 3.2 -> 2.5 us
        return GemmConfig(16, 32, 32, 4, 3)
    if bucket in (0, 1) and n <= 64:  # the fp32 router at 64 / 256 rows: 17.9 -> 14.3 / 18.2 -> 14.9 us (decode_gemms)
        return GemmConfig(16, 32, 64, 4, 4)
    if bucket >= 2 and n >= 256:
        # prefill / training rows of the LoRA B products (fp32 [M, r] @ [N, r]^T, one K step, bound by the fp32
        # output they write): 64x64 tiles took 5.5x the bound at 16K tokens (the expert r -> hidden product,
        # 1.43 ms vs 0.27 ms, benchmarks/results/2026-12-01_lora_gemms_splitk_9661ae3_h200.json)
        return GemmConfig(128, 128, 32, 8, 3)
    if cdiv(n, 64) >= MIN_DECODE_PROGRAMS:
        return GemmConfig(64, 64, 32, 4, 3)
    return GemmConfig(64, 32, 32, 4, 3)


def bmm_config(m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """Tiles for ``bmm_fixed`` ([m, k] @ [k, n] per batch element). Its per-matrix shape is fixed by
    the model (the op's contract), so the config may follow m as well; the batch count never enters.
    Tile dims are powers of two >= 16 (tl.dot's minimum), capped at 64."""
    def fit(v: int, cap: int) -> int:
        return max(16, min(cap, next_pow2(max(v, 1))))

    return GemmConfig(fit(m, 64), fit(n, 64), fit(k, 64 if dtype in _HALF else 32), 4, 2)


def _interpreting() -> bool:
    return INTERPRET


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _split_bf16(t):
    """fp32 (or bf16) tile -> three bf16 tiles whose exact sum is the tile."""
    t32 = t.to(tl.float32)
    hi = t32.to(tl.bfloat16)
    res = t32 - hi.to(tl.float32)
    mid = res.to(tl.bfloat16)
    lo = (res - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def dot_acc(acc, a, b, HALF: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b with fp32 accumulation: 16-bit tiles (HALF) as tensor-core MMAs, fp32 tiles at
    ``input_precision=PRECISION``, or rounded to bf16 MMAs when PRECISION is "bf16" (backward kernels
    only: the contract's ``backward_matmul_precision``). Under the interpreter an explicit fp32 product and
    sum over K: its bf16 dot is wrong, and numpy's matmul (its fp32 dot) computes tile rows with different
    BLAS micro-kernels depending on their position in the tile, so invariance tests on CPU need every
    element in one order."""
    if INTERPRET:
        if not HALF and PRECISION == "bf16":
            a = a.to(tl.bfloat16)
            b = b.to(tl.bfloat16)
        out = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif HALF:
        out = tl.dot(a, b, acc)
    elif PRECISION == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def _dot_split_both(acc, a, b, INTERPRET: tl.constexpr):
    """acc + a @ b for fp32 tiles a and b, both split into three bf16 pieces (``_split_bf16``): the six
    products down to 2^-16 relative, in this order (the three dropped ones, mid*lo, lo*mid, lo*lo, are below
    2^-24 of |a||b| together). The GEMM's K loop and its in-launch LoRA delta both call it: one order."""
    a_hi, a_mid, a_lo = _split_bf16(a)
    b_hi, b_mid, b_lo = _split_bf16(b)
    acc = dot_acc(acc, a_hi, b_hi, True, "ieee", INTERPRET)
    acc = dot_acc(acc, a_hi, b_mid, True, "ieee", INTERPRET)
    acc = dot_acc(acc, a_mid, b_hi, True, "ieee", INTERPRET)
    acc = dot_acc(acc, a_hi, b_lo, True, "ieee", INTERPRET)
    acc = dot_acc(acc, a_mid, b_mid, True, "ieee", INTERPRET)
    acc = dot_acc(acc, a_lo, b_hi, True, "ieee", INTERPRET)
    return acc


@triton.jit
def expert_tile(offs_ptr, pid_m, M, N_EXPERTS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(tiles in all, expert, first row, end row) of row-tile slot ``pid_m`` of expert-sorted rows, from
    the E+1 int32 row offsets: expert e's rows are cut into BLOCK_M tiles from its first row, numbered
    expert after expert. One lane per expert (BLOCK_E >= N_EXPERTS): a few vector ops on E integers,
    nothing next to the K loop. Offsets are clamped into [0, M] and made non-decreasing, so malformed
    device offsets (never checked on the host: that would sync) cannot address rows outside [0, M);
    valid offsets pass unchanged. A slot >= the tile count belongs to no tile."""
    lanes = tl.arange(0, BLOCK_E)
    in_e = lanes < N_EXPERTS
    lo = tl.load(offs_ptr + lanes, mask=in_e, other=0)
    hi = tl.load(offs_ptr + lanes + 1, mask=in_e, other=0)
    lo = tl.minimum(tl.maximum(lo, 0), M)
    hi = tl.minimum(tl.maximum(hi, lo), M)
    e_tiles = (hi - lo + (BLOCK_M - 1)) // BLOCK_M
    e_tiles_end = tl.cumsum(e_tiles, axis=0)  # tile slots [end - tiles, end) belong to expert e
    # the expert of slot pid_m: the number of experts whose slots all lie before it
    expert = tl.sum((e_tiles_end <= pid_m).to(tl.int32), axis=0)
    here = lanes == expert
    first_slot = tl.sum(tl.where(here, e_tiles_end - e_tiles, 0), axis=0)
    row0 = tl.sum(tl.where(here, lo, 0), axis=0) + (pid_m - first_slot) * BLOCK_M
    row_end = tl.sum(tl.where(here, hi, 0), axis=0)
    return tl.sum(e_tiles, axis=0), expert, row0, row_end


@triton.jit
def expert_weight_offset(woff_ptr, expert, stride_wg, W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr):
    """Element offset of expert ``expert``'s weight from the base: the table entry (per-expert weights)
    or ``expert * stride_wg`` (stacked)."""
    if W_TABLE:
        woff = tl.load(woff_ptr + expert)
    else:
        woff = expert.to(tl.int64) * stride_wg
    if W_ALIGN > 1:
        # Every expert's weight starts on a 16-byte boundary (W_ALIGN elements from the base): telling
        # the compiler lets it vectorise the weight loads.
        woff = tl.multiple_of(woff, W_ALIGN)
    return woff


@triton.jit
def grouped_tile(pid_0, pid_1, GROUP: tl.constexpr):
    """(row tile, column tile) of program (pid_0, pid_1) when the programs, taken in launch order (dim 0
    fastest), walk bands of GROUP row tiles column tile by column tile: the programs resident at one time
    share a few row tiles of x and a run of the weight's column tiles, both read from HBM once and from L2
    by the rest. In launch order (row tile fastest) a wave of programs covers one column of row tiles: at
    16K rows it reads all of x (64 MB at K = 2048, more than the L2) once per column tile. A bijection on
    the grid: which program computes a tile, never what it computes."""
    rows = tl.num_programs(0)
    cols = tl.num_programs(1)
    lin = pid_1 * rows + pid_0
    per_band = GROUP * cols
    first = (lin // per_band) * GROUP
    height = tl.minimum(rows - first, GROUP)
    in_band = lin % per_band
    return first + in_band % height, in_band // height


@triton.jit(do_not_specialize=["M", "M_TILES"])
def _gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, d_ptr,
    offs_ptr, woff_ptr, t_ptr, lb_ptr, lboff_ptr,
    M, M_TILES, N, K, N_EXPERTS,
    stride_xg, stride_xm, stride_xk,
    stride_wg, stride_wn, stride_wk,
    stride_yg, stride_ym, stride_yn, stride_ys,
    stride_tm, stride_lbg, stride_lbn, lora_scale,
    o_ptr, cnt_ptr, stride_og, stride_om, stride_on, gidx_ptr,
    HAS_BIAS: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_LORA: tl.constexpr, LORA_R: tl.constexpr,
    BLOCK_R: tl.constexpr, EXPERTS: tl.constexpr, SEGMENTS: tl.constexpr,
    X_SEGMENTS: tl.constexpr, W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr, F32_DOT: tl.constexpr,
    SPLIT_X: tl.constexpr, SPLIT_W: tl.constexpr,
    K_CHUNK: tl.constexpr, SERIAL_SUM: tl.constexpr, SUM_BIAS: tl.constexpr, SUM_DELTA: tl.constexpr,
    GATHER_DIV: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr = 1,
):
    """y[g, m, n] = (d[g, m, n] + sum_k x[g, m, k] * w[g, n, k]) (+ b[n]) for one [BLOCK_M, BLOCK_N] tile.

    ``d`` (HAS_DELTA): an fp32 tensor laid out as y (same strides), the accumulator's initial value: the K
    products accumulate onto it, the bias follows, one rounding. (A split-K product adds it after its partials
    instead: SUM_DELTA.)
    HAS_LORA (plain or batched mode, or expert mode): the delta from its factors instead,
    ``lora_scale * t @ lb^T`` with t [M, LORA_R] fp32 (rows as x's, ``stride_tm`` apart, unit column
    stride) and lb [N, LORA_R] fp32 (expert e's at ``e * stride_lbg``; ``stride_lbn`` between rows, unit
    stride over r; batched mode: element g's t rows g*M.. and its B at ``g * stride_lbg``, 0 for a shared B):
    the six split MMAs of the fp32 x fp32 product in the K loop's order, over the one K
    step the standalone product ``linear(t, lb)`` takes (r <= BLOCK_R; its zero-padded K columns add
    exact zeros), times the scale, so the initial value is that product's, bit for bit. With SEGMENTS (``linear_concat`` with
    ``LoraUpConcat``): segment s's B starts ``lboff_ptr[s]`` elements after ``lb_ptr`` and its t columns are
    s * LORA_R.. of t's rows (every adapter of the group has rank LORA_R), so each segment adds the delta
    ``linear(x, w_s, lora=...)`` adds.

    Plain/batched mode (EXPERTS=False): program (g * M_TILES + pid_m, pid_n) owns rows
    pid_m*BLOCK_M.. of batch element g (linear: one element; grouped_linear/bmm_fixed: G elements;
    the batch shares grid dim 0 with the M tiles because dims 1 and 2 are limited to 65535).
    Expert mode: ``offs_ptr`` holds the N_EXPERTS+1 row offsets (int32); expert e's rows
    offs[e]:offs[e+1] are cut into BLOCK_M tiles from its first row, numbered expert after expert,
    and program pid_m finds tile pid_m (expert, first row, end row) itself; programs past the last
    tile exit. Expert e's weight starts ``woff_ptr[e]`` elements after ``w_ptr`` (W_TABLE) or
    ``e * stride_wg`` elements (stacked weights).
    Segment mode (SEGMENTS, ``linear_concat``): the columns of y are N_EXPERTS segments, segment s
    the output columns offs[s]:offs[s+1] of its own weight ``woff_ptr[s]`` elements after ``w_ptr``;
    each segment is cut into BLOCK_N column tiles from its first column (a tile never straddles two
    segments) and program pid_n finds its (segment, tile) the way expert mode finds its rows.
    X_SEGMENTS (with SEGMENTS, ``linear_blockdiag``): segment s also reads its own block of x's columns,
    offs[N_EXPERTS+1+s]:offs[N_EXPERTS+2+s] (K_s = its width, replacing K): a block-diagonal product.
    GATHER_DIV > 0 (expert mode, ``expert_linear``'s ``gather``): row r of the product reads x's row
    ``gidx[r] // GATHER_DIV`` (the MoE's dispatch of token rows to expert-sorted pairs, without materialising
    the gathered rows); everything else (t, delta, y) keeps the product's row r.
    GROUP_M > 1: programs take their (row tile, column tile) from ``grouped_tile`` (bands of GROUP_M row tiles),
    which programs run together, not what any computes.
    SERIAL_SUM (with K_CHUNK): the tile's last program to finish (an arrival counter per tile at ``cnt_ptr``,
    reset by that program) adds the fp32 partials in ascending split order from zero, then the bias
    (SUM_BIAS) and the delta (SUM_DELTA, laid out as the output), and stores the result into the output
    ``o_ptr`` (strides ``stride_o*``): ``_split_k_sum``'s arithmetic in the same launch. Which program sums
    depends on timing; what it computes does not.
    """
    await_previous_kernel()
    pid_0 = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUP_M > 1:
        pid_0, pid_n = grouped_tile(pid_0, pid_n, GROUP_M)
    if EXPERTS:
        pid_m = pid_0
        n_tiles, expert, row0, row_end = expert_tile(offs_ptr, pid_m, M, N_EXPERTS, BLOCK_M, BLOCK_E)
        if pid_m >= n_tiles:
            return  # a slot of the fixed upper-bound grid that no tile needs
        w_base = w_ptr + expert_weight_offset(woff_ptr, expert, stride_wg, W_TABLE, W_ALIGN)
        x_base = x_ptr
        y_base = y_ptr
        o_off = 0
        d_base = d_ptr
        lb_base = lb_ptr + expert.to(tl.int64) * stride_lbg
        t_base = t_ptr
    else:
        pid_g = (pid_0 // M_TILES).to(tl.int64)
        pid_m = pid_0 % M_TILES
        row0 = pid_m * BLOCK_M
        row_end = M
        w_base = w_ptr + pid_g * stride_wg
        x_base = x_ptr + pid_g * stride_xg
        y_base = y_ptr + pid_g * stride_yg
        o_off = pid_g * stride_og
        d_base = d_ptr + pid_g * stride_yg
        # batched LoRA (grouped_linear): group g's t rows follow the previous groups' M rows; its B is
        # ``stride_lbg`` elements on (0: one B shared by every group)
        lb_base = lb_ptr + pid_g * stride_lbg
        t_base = t_ptr + pid_g * M * stride_tm

    n_end = N
    tile_n = pid_n
    k_end = K
    if SEGMENTS:
        lanes_s = tl.arange(0, BLOCK_E)
        in_s = lanes_s < N_EXPERTS
        c_lo = tl.load(offs_ptr + lanes_s, mask=in_s, other=0)
        c_hi = tl.load(offs_ptr + lanes_s + 1, mask=in_s, other=0)
        s_tiles = (c_hi - c_lo + (BLOCK_N - 1)) // BLOCK_N
        s_tiles_end = tl.cumsum(s_tiles, axis=0)
        seg = tl.sum((s_tiles_end <= pid_n).to(tl.int32), axis=0)
        here_s = lanes_s == seg
        tile_n = pid_n - tl.sum(tl.where(here_s, s_tiles_end - s_tiles, 0), axis=0)
        n_end = tl.sum(tl.where(here_s, c_hi - c_lo, 0), axis=0)
        soff = tl.load(woff_ptr + seg)
        if W_ALIGN > 1:
            soff = tl.multiple_of(soff, W_ALIGN)
        w_base += soff
        c0 = tl.sum(tl.where(here_s, c_lo, 0), axis=0).to(tl.int64)
        y_base += c0 * stride_yn
        d_base += c0 * stride_yn
        o_off += c0 * stride_on
        if X_SEGMENTS:
            # the x column table follows the N_EXPERTS+1 output column offsets
            # (names unlike the split pieces': a name reused in the K loop changes type, a compile error)
            xcol0 = tl.load(offs_ptr + N_EXPERTS + 1 + seg)
            k_end = tl.load(offs_ptr + N_EXPERTS + 2 + seg) - xcol0
            x_base += xcol0.to(tl.int64) * stride_xk
        if HAS_LORA:
            lb_base += tl.load(lboff_ptr + seg)
            t_base += seg * LORA_R

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < row_end
    n_mask = offs_n < n_end
    # int64 row/column offsets: lm_head-sized outputs and weights exceed 2^31 elements at long M.
    k_lo = 0
    k_hi = k_end
    if K_CHUNK > 0:
        # Split K (see _launch): program (.., .., s) sums the K range [s * K_CHUNK, (s + 1) * K_CHUNK) into
        # partial s of y (``stride_ys`` apart); _split_k_sum adds the partials in ascending s.
        pid_s = tl.program_id(2)
        k_lo = pid_s * K_CHUNK
        k_hi = tl.minimum(k_end, k_lo + K_CHUNK)
        y_base += pid_s.to(tl.int64) * stride_ys
    if GATHER_DIV > 0:
        x_rows = (tl.load(gidx_ptr + offs_m, mask=m_mask, other=0) // GATHER_DIV).to(tl.int64)
    else:
        x_rows = offs_m.to(tl.int64)
    x_ptrs = x_base + x_rows[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    w_ptrs = w_base + (k_lo + offs_k)[:, None] * stride_wk + offs_n.to(tl.int64)[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tile = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    # The delta is the accumulator's initial value (the K products accumulate onto it): the LoRA delta from its
    # factors, computed here into the one accumulator (the standalone product's one K step, the same six split
    # products from zero, then the scale: ``linear(t, lb)``'s bits times the scale, rounded), or a given fp32 delta.
    # Both start the same sum, so lora= and delta= give the same bits.
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < LORA_R
        t = tl.load(t_base + offs_m.to(tl.int64)[:, None] * stride_tm + offs_r[None, :],
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        lb = tl.load(lb_base + offs_r[:, None] + offs_n.to(tl.int64)[None, :] * stride_lbn,
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot_split_both(acc, t, lb, INTERPRET) * lora_scale
    elif HAS_DELTA:
        acc = tl.load(d_base + tile, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
    # Ascending K in fixed BLOCK_K steps: every output element sees the same accumulation order.
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = offs_k < k_hi - k0
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if SPLIT_X or SPLIT_W:
            # An fp32 operand is split into three bf16 pieces, t = hi + mid + lo (the residuals are
            # exact in fp32; the pieces hold >= 24 significant bits, all of fp32). Products of bf16
            # pieces are exact in fp32, so a few bf16 MMAs give an fp32-accurate product on the tensor
            # cores instead of the ~10x slower fp32 FMA dot. A row's pieces depend on that row alone
            # (x) or on the weight alone (W), so the split keeps every row's result independent of M.
            # fp32 x, bf16 W (MLA's attention output through W_UV): 3 MMAs. bf16 x, fp32 W (LoRA A
            # factors): 3 MMAs (at decode a narrow output, N = r = 32, is one program walking K: with
            # FMA dots that took tens of microseconds per call). fp32 x fp32 (the LoRA intermediate
            # through lora_B, fp32 models): the 6 products down to 2^-16 relative; the 3 dropped ones
            # (mid*lo, lo*mid, lo*lo) are below 2^-24 of |x||W| together.
            if SPLIT_X and SPLIT_W:
                acc = _dot_split_both(acc, a, b, INTERPRET)
            elif SPLIT_X:
                x_hi, x_mid, x_lo = _split_bf16(a)
                acc = dot_acc(acc, x_hi, b, True, "ieee", INTERPRET)
                acc = dot_acc(acc, x_mid, b, True, "ieee", INTERPRET)
                acc = dot_acc(acc, x_lo, b, True, "ieee", INTERPRET)
            else:
                w_hi, w_mid, w_lo = _split_bf16(b)
                acc = dot_acc(acc, a, w_hi, True, "ieee", INTERPRET)
                acc = dot_acc(acc, a, w_mid, True, "ieee", INTERPRET)
                acc = dot_acc(acc, a, w_lo, True, "ieee", INTERPRET)
        elif F32_DOT:  # another mix with an fp32 operand (always so under the interpreter): IEEE fp32 dots
            acc = dot_acc(acc, a.to(tl.float32), b.to(tl.float32), False, "ieee", INTERPRET)
        else:
            acc = dot_acc(acc, a, b, True, "ieee", INTERPRET)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_base + tile, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    if SERIAL_SUM:
        _serial_split_sum(y_base - tl.program_id(2).to(tl.int64) * stride_ys + tile, stride_ys, o_ptr + o_off,
                          d_ptr + o_off, b_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, stride_om, stride_on,
                          SUM_BIAS, SUM_DELTA, BLOCK_M, BLOCK_N)


@triton.jit
def _serial_split_sum(p_ptrs, stride_ps, o_base, d_base, b_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask,
                      stride_om, stride_on,
                      HAS_BIAS: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The split-K sum of a tile by its last program to arrive (``last_to_arrive``; see ``_gemm_kernel``'s
    SERIAL_SUM), which reads the other partials from L2 (``.cg``: never a stale L1 line)."""
    tile_id = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if last_to_arrive(cnt_ptr, tile_id, tl.num_programs(2)):
        mask = m_mask[:, None] & n_mask[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sp in range(0, tl.num_programs(2)):  # ascending, from zero: _split_k_sum's order
            acc += tl.load(p_ptrs + sp * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        if HAS_DELTA:  # laid out as the output
            acc += tl.load(d_base + out, mask=mask, other=0.0)
        tl.store(o_base + out, acc.to(o_base.dtype.element_ty), mask=mask)
        reset_arrivals(cnt_ptr, tile_id)


@triton.jit(do_not_specialize=["M", "M_TILES"])
def _split_k_sum(
    p_ptr, b_ptr, d_ptr, y_ptr, M, M_TILES, N, S,
    stride_ps, stride_pg, stride_pm, stride_yg, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """y[g] = sum over s ascending of the fp32 partials p[s, g] (+ b) (+ d[g], laid out as y), rounded
    once to y's dtype."""
    await_previous_kernel()
    pid_g = (tl.program_id(0) // M_TILES).to(tl.int64)
    offs_m = (tl.program_id(0) % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    p_ptrs = p_ptr + pid_g * stride_pg + offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for sp in range(0, S):
        acc += tl.load(p_ptrs + sp * stride_ps, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tile = pid_g * stride_yg + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    if HAS_DELTA:
        acc += tl.load(d_ptr + tile, mask=mask, other=0.0)
    tl.store(y_ptr + tile, acc.to(y_ptr.dtype.element_ty), mask=mask)


# Row tiles per band of the launch order (``grouped_tile``); 1 keeps the plain order (benchmarks compare). Used
# where the grid has several row and column tiles (never at one-row-tile decode launches, whose order it
# would not change).
GROUP_M = int(os.environ.get("ZMRL_GEMM_GROUP_M", "8"))

_SPLIT_PARTNERS = (torch.float32, torch.bfloat16)

# Split K for fp32-weight products (the LoRA A factors, [r, in] with r = 32): at decode such a product is
# one program walking all of K (its N fits one or a few tiles and the rows one tile), which left most SMs
# idle for tens of microseconds per call. Each K_CHUNK-long range of K is summed by its own program into
# an fp32 partial and the partials are added in ascending order (_split_k_sum). The split is a function of
# (K, dtypes) alone — never of M or N — so a row's bits still do not depend on the batch, and a column of
# linear_concat / a row of expert_linear equals the plain linear's.
SPLIT_K_CHUNK = 512
_SUM_BLOCK_M, _SUM_BLOCK_N = 32, 64
# The partials are summed in the GEMM's own launch by each tile's last program to finish (the kernel's
# SERIAL_SUM: one launch instead of two, ~120 fewer launches per decode step of the bench model) unless
# ZMRL_SERIAL_SPLIT_SUM=0 (then by ``_split_k_sum``). The same additions in the same order: the same bits.
SERIAL_SPLIT_SUM = os.environ.get("ZMRL_SERIAL_SPLIT_SUM", "1") != "0"
assert SPLIT_K_CHUNK % SPLIT_BLOCK_K == 0  # every chunk is whole K steps of the split products


def _k_chunk(x: torch.dtype, w: torch.dtype, k: int) -> int:
    """K_CHUNK of a product: SPLIT_K_CHUNK for an fp32 weight with K > SPLIT_K_CHUNK, else 0 (no split)."""
    return SPLIT_K_CHUNK if _split_w(x, w) and k > SPLIT_K_CHUNK else 0


def _split_x(x: torch.dtype, w: torch.dtype) -> bool:
    """fp32 activations against bf16 or fp32 weights: x is split into three bf16 pieces (see the kernel)."""
    return x == torch.float32 and w in _SPLIT_PARTNERS


def _split_w(x: torch.dtype, w: torch.dtype) -> bool:
    """fp32 weights (LoRA factors) against bf16 or fp32 activations: W is split likewise."""
    return w == torch.float32 and x in _SPLIT_PARTNERS


def _config_dtype(x: torch.dtype, w: torch.dtype) -> torch.dtype:
    """The dtype class ``linear_config`` is asked for: the tensor-core class (bf16) when one operand
    is split, the fp32 class (smaller tiles: both operand tiles are fp32 in shared memory) when both
    are, else the dot's operand dtype."""
    split_x, split_w = _split_x(x, w), _split_w(x, w)
    if split_x and split_w:
        return torch.float32
    return torch.bfloat16 if split_x or split_w else _dot_dtype(x, w)


def _dot_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """Compute class of a product: 16-bit tensor-core dots only when both operands share a 16-bit
    dtype; otherwise fp32 (the torch backend computes such mixes in fp32 too)."""
    return a if (a == b and a in _HALF) else torch.float32


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in _TL_DTYPE:
        raise TypeError(f"triton GEMM: {what} has unsupported dtype {t.dtype}")


@dataclass(frozen=True)
class _ExpertLaunch:
    """Expert-mode arguments of ``_launch``.

    offsets: int32 [E+1] row offsets on the device; woff: int64 [E] weight element offsets from the
    base weight (per-expert weights) or None (stacked weights: expert e at ``e * stride(0)``);
    align: guaranteed alignment of every expert's weight start, in elements; n_tiles: programs along
    M (the exact tile count, or an upper bound: surplus programs exit)."""

    offsets: torch.Tensor
    woff: torch.Tensor | None
    align: int
    n_experts: int
    n_tiles: int
    gather: torch.Tensor | None = None  # int64 [M]: row r reads x's row gather[r] // gather_div
    gather_div: int = 1


@dataclass(frozen=True)
class _SegmentLaunch:
    """Segment-mode arguments of ``_launch`` (``linear_concat``): int32 [S+1] column offsets and
    int64 [S] weight element offsets from the base weight, both on the device; the alignment of every
    weight start in elements; the exact number of column tiles (host shapes). ``x_blocks``
    (``linear_blockdiag``): ``col_offsets`` is [2S+2], the S+1 cumulative x column offsets after the
    output's, and segment s multiplies its own block of x's columns."""

    col_offsets: torch.Tensor
    woff: torch.Tensor
    align: int
    n_segments: int
    n_tiles: int
    x_blocks: bool = False


# Largest output tile (BLOCK_M * BLOCK_N) of a GEMM with a LoRA delta from its factors (which program computes an
# element, never its bits: the module doc).
LORA_MAX_TILE = 128 * 256
# Outputs at least this wide take the LoRA tile 128 x 256 at training / prefill rows instead of 256 x 128
LORA_WIDE_N = 1024


def lora_config(cfg: GemmConfig, n: int) -> GemmConfig:
    """``cfg`` for an n-wide GEMM with a LoRA delta from its factors. The LoRA product's pieces live next to the
    accumulator before the K loop, so a 256 x 128 tile is at the register limit (32 bytes of spill per thread in
    its sm_90 build) and 128 x 256 is not (246 registers): wide outputs take 128 x 256 (16384 rows, LoRA r = 32,
    H100: N 6400 K 2048 0.99 -> 0.89 ms, N 2048 K 8192 1.23 -> 0.96 ms), narrow ones keep 256 x 128 (N 512:
    0.31 vs 0.22 ms; benchmarks/results/2026-12-06_lora_prologue_probe_h100.json). Callers apply it before they
    size the grid from the tile (expert mode counts its row tiles from BLOCK_M)."""
    if cfg.block_m == 256 and cfg.block_n == 128 and n >= LORA_WIDE_N:
        return GemmConfig(128, 256, cfg.block_k, 8, min(cfg.num_stages, 3))
    if cfg.block_m * cfg.block_n <= LORA_MAX_TILE:
        return cfg
    return GemmConfig(128, 128, cfg.block_k, 8, min(cfg.num_stages, 3))


@dataclass(frozen=True)
class _LoraLaunch:
    """``_launch``'s in-launch LoRA delta: t [M, r] fp32 (unit column stride), b [N, r] fp32 or the stacked [E, N, r]
    (expert mode; unit stride over r), the scale. Segment mode: t [M, S * r], b the lowest-address segment's B
    [N_s, r] and ``b_table`` int64 [S], every segment's B offset from it in elements."""

    t: torch.Tensor
    b: torch.Tensor
    scale: float
    b_table: torch.Tensor | None = None


def _lora_rows(t: torch.Tensor, m: int) -> torch.Tensor:
    """A LoRA t as the kernel reads it: [M, width] rows with unit column stride."""
    t2 = t.reshape(m, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _lora_launch(lora: _ops.LoraUp | None, m: int, n: int, stacked: bool) -> _LoraLaunch | None:
    """A LoraUp as the kernel reads it (shapes checked): t as [M, r] rows, b with unit stride over r."""
    if lora is None:
        return None
    t, b = lora.t, lora.b
    r = t.shape[-1]
    want = (b.shape[0], n, r) if stacked else (n, r)
    if t.dtype != torch.float32 or b.dtype != torch.float32 or t.numel() != m * r or tuple(b.shape) != want:
        raise ValueError(f"lora: t must be fp32 [{m}, r] and b fp32 {list(want)}, got t {t.dtype} {tuple(t.shape)}, "
                         f"b {b.dtype} {tuple(b.shape)}")
    return _LoraLaunch(_lora_rows(t, m), b if b.stride(-1) == 1 else b.contiguous(), float(lora.scale))


def _launch(x3: torch.Tensor, w3: torch.Tensor, bias: torch.Tensor | None, y3: torch.Tensor, cfg: GemmConfig,
            m: int, n: int, k: int, *, experts: _ExpertLaunch | None = None,
            segments: _SegmentLaunch | None = None, delta: torch.Tensor | None = None,
            lora: _LoraLaunch | None = None) -> None:
    """Launch ``_gemm_kernel``. x3 [G, M, K], w3 [G, N, K] (any strides), y3 [G, M, N]; ``delta``: fp32,
    y3's shape and strides, added before the rounding (the kernel's HAS_DELTA).
    ``experts``: expert mode, with x3/y3 of G=1 and w3 the lowest-address expert weight as
    [1, N, K] (per-expert weights) or the stacked [E, N, K] weights.
    ``segments``: segment mode, G=1, w3 the lowest-address weight as [1, N_s, K], y3 [1, M, sum N_s].
    ``lora``: the delta from its factors (the kernel's HAS_LORA; plain or batched (t [G * M, r] rows, b [G, N, r]),
    expert or segment mode (with its ``b_table``), without ``delta``, x blocks or a split K, whose delta joins the
    partial sums)."""
    if lora is not None and (delta is not None or (x3.shape[0] != 1 and (experts or segments) is not None)
                             or _k_chunk(x3.dtype, w3.dtype, k)
                             or (segments is not None) != (lora.b_table is not None)
                             or (segments is not None and segments.x_blocks)):
        raise ValueError("triton GEMM: the in-launch LoRA delta takes a plain, batched, expert or concatenated product "
                         "without a delta or a split K (the callers compute such a delta unfused)")
    if lora is not None and cfg.block_m * cfg.block_n > LORA_MAX_TILE:
        # the caller sized the grid (expert mode: its tile count) for cfg: it must pick the LoRA tile first
        raise ValueError(f"triton GEMM: a {cfg} tile is larger than the in-launch LoRA delta's (lora_config)")
    _check_dtype(x3, "x")
    _check_dtype(w3, "weight")
    split_x, split_w = _split_x(x3.dtype, w3.dtype), _split_w(x3.dtype, w3.dtype)
    split = split_x or split_w
    if split and cfg.block_k != SPLIT_BLOCK_K:
        cfg = GemmConfig(cfg.block_m, cfg.block_n, SPLIT_BLOCK_K, cfg.num_warps, cfg.num_stages)
    f32 = not split and (_dot_dtype(x3.dtype, w3.dtype) == torch.float32 or _interpreting())
    f32_rows = cfg.block_m * split_x + cfg.block_n * split_w
    k_chunk = _k_chunk(x3.dtype, w3.dtype, k)
    if split and cfg.num_stages > 3 and f32_rows * cfg.block_k * 4 * cfg.num_stages > 96 * 1024:
        # the fp32 tile doubles the stage size: keep the pipeline inside the SM's shared memory
        cfg = GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, 3)
    if segments is not None and segments.x_blocks and k_chunk:
        raise ValueError("triton GEMM: a block-diagonal product cannot split K (its K differs per segment); "
                         "linear_blockdiag runs such weights one linear at a time")
    if delta is not None and (delta.dtype != torch.float32 or delta.shape != y3.shape or delta.stride() != y3.stride()):
        raise ValueError(f"triton GEMM: delta must be fp32 laid out as the output {tuple(y3.shape)}, "
                         f"got {delta.dtype} {tuple(delta.shape)} strides {delta.stride()}")
    if _interpreting() and y3.dtype != torch.float32:
        # The interpreter's fp32 -> 16-bit conversion truncates (the GPU rounds to nearest even):
        # store fp32 and let torch round, which is what the compiled kernel's store does.
        y32 = torch.empty(y3.shape, dtype=torch.float32, device=y3.device)
        _launch(x3, w3, bias, y32, cfg, m, n, k, experts=experts, segments=segments,
                delta=None if delta is None else delta.contiguous(), lora=lora)
        y3.copy_(y32)
        return
    g = x3.shape[0]
    if segments is not None:
        offs, woff, align, n_experts = segments.col_offsets, segments.woff, segments.align, segments.n_segments
        block_e = max(16, next_pow2(n_experts))
        m_tiles = cdiv(m, cfg.block_m)
        grid = (m_tiles, segments.n_tiles)
    elif experts is None:
        offs, woff, align, n_experts, block_e = x3, x3, 1, 1, 16  # unused (constexpr-disabled branch)
        m_tiles = cdiv(m, cfg.block_m)
        grid = (g * m_tiles, cdiv(n, cfg.block_n))
    else:
        offs, align, n_experts = experts.offsets, experts.align, experts.n_experts
        woff = experts.woff if experts.woff is not None else offs  # unused without W_TABLE
        block_e = max(16, next_pow2(n_experts))  # a function of the expert count (model) only
        m_tiles = experts.n_tiles
        grid = (m_tiles, cdiv(n, cfg.block_n))
        if m_tiles == 0:
            return
    out = y3
    counters = None
    if k_chunk:
        splits = cdiv(k, k_chunk)
        y3 = torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)
        counters = arrival_counters(out.device, grid[0] * grid[1]) if SERIAL_SPLIT_SUM else None
        grid = (*grid, splits)
    serial = counters is not None
    lora_r = 0 if lora is None else lora.b.shape[-1]
    _gemm_kernel[grid](
        x3, w3, bias if bias is not None else x3, y3,
        delta if delta is not None and (serial or not k_chunk) else y3, offs, woff,
        x3 if lora is None else lora.t, x3 if lora is None else lora.b,
        offs if lora is None or lora.b_table is None else lora.b_table,
        m, m_tiles, n, k, n_experts,
        x3.stride(0), x3.stride(1), x3.stride(2),
        w3.stride(0), w3.stride(1), w3.stride(2),
        *((y3.stride(1), y3.stride(2), y3.stride(3), y3.stride(0)) if k_chunk else
          (y3.stride(0), y3.stride(1), y3.stride(2), 0)),
        *((0, 0, 0, 1.0) if lora is None else
          (lora.t.stride(0), lora.b.stride(0) if lora.b.dim() == 3 else 0, lora.b.stride(-2), lora.scale)),
        out if serial else y3, counters if serial else offs,
        *((out.stride(0), out.stride(1), out.stride(2)) if serial else (0, 0, 0)),
        experts.gather if experts is not None and experts.gather is not None else offs,
        HAS_BIAS=bias is not None and not k_chunk, HAS_DELTA=delta is not None and not k_chunk,
        HAS_LORA=lora is not None, LORA_R=lora_r, BLOCK_R=max(16, next_pow2(max(lora_r, 1))),
        EXPERTS=experts is not None, SEGMENTS=segments is not None,
        X_SEGMENTS=segments is not None and segments.x_blocks,
        W_TABLE=experts is not None and experts.woff is not None, W_ALIGN=align, F32_DOT=f32, SPLIT_X=split_x,
        SPLIT_W=split_w, K_CHUNK=k_chunk,
        SERIAL_SUM=serial, SUM_BIAS=serial and bias is not None, SUM_DELTA=serial and delta is not None,
        GATHER_DIV=experts.gather_div if experts is not None and experts.gather is not None else 0,
        INTERPRET=_interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=block_e,
        GROUP_M=GROUP_M if grid[0] > 1 and grid[1] > 1 else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # no multiply-add contraction: the LoRA delta's ``product * scale`` rounds as the unfused composition's
        # (``scale * linear(t, b)``) does; contracted into an FMA with the sum it joins, the two differed at a
        # scale that is not a power of two (found on the GPU by test_grouped_linear_lora_equals_its_delta)
        enable_fp_fusion=False,
        **pdl(),
    )
    if k_chunk and not serial:
        rows, cols = out.shape[1], out.shape[2]
        sum_tiles = cdiv(rows, _SUM_BLOCK_M)
        _split_k_sum[(out.shape[0] * sum_tiles, cdiv(cols, _SUM_BLOCK_N))](
            y3, bias if bias is not None else y3, delta if delta is not None else y3, out, rows, sum_tiles, cols,
            y3.shape[0], y3.stride(0), y3.stride(1), y3.stride(2), out.stride(0), out.stride(1), out.stride(2),
            HAS_BIAS=bias is not None, HAS_DELTA=delta is not None, BLOCK_M=_SUM_BLOCK_M, BLOCK_N=_SUM_BLOCK_N,
            num_warps=4,
            **pdl(),
        )


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """[..., K] -> 16-byte aligned [M, K] rows of unit column stride, in the layout of contiguous rows as the
    compiler sees it.

    Triton compiles a kernel variant per pointer alignment and per integer argument's divisibility by 16
    (and equality to 1). Token rows reach a linear from many storages (engine decode batches, packed trainer
    batches, views at odd offsets); canonicalising them means every call with the same (N, K, dtypes) runs
    the one variant, so row invariance never rests on the compiler emitting the same MMA sequence for two
    variants. Rows that are a column block of wider rows (``project()``'s outputs: a row stride S > K) are
    read where they are when S and K are both multiples of 16 and the start is 16-byte aligned: every
    integer the kernel is specialised on (the row stride, and the batch stride M * S) then has the
    properties contiguous rows would give it, so it is the same compiled kernel, reading other addresses.
    Anything else is copied (free for the usual contiguous, aligned activations)."""
    x2 = x.reshape(-1, k)
    s_row = x2.stride(0)
    canonical = (x2.shape[0] <= 1 or s_row == k or (k % 16 == 0 and s_row % 16 == 0 and s_row >= k)) and (
        k <= 1 or x2.stride(1) == 1)
    if not canonical:
        x2 = x2.contiguous()
    if x2.shape[0] == 1 and x2.stride(0) != k:
        x2 = x2.as_strided((1, k), (k, 1))  # one row: any row stride is valid, give it contiguous rows' one
    if x2.data_ptr() % 16:
        x2 = x2.clone()  # fresh allocations are aligned
    return x2


# --------------------------------------------------------------------------------------- linear
def _linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, delta: torch.Tensor | None = None,
                    lora: _ops.LoraUp | None = None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = _rows(x, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if lora is not None and _k_chunk(x.dtype, weight.dtype, k):
        delta, lora = _ops.lora_delta(lora, linear_triton), None  # a split-K product: the delta unfused (same value)
    if m and n:
        cfg = linear_config(n, k, _config_dtype(x.dtype, weight.dtype), m)
        if lora is not None:
            cfg = lora_config(cfg, n)
        bias = None if bias is None else bias.contiguous()  # the kernel reads it with unit stride
        _launch(x2.unsqueeze(0), weight.unsqueeze(0), bias, y.unsqueeze(0), cfg, m, n, k,
                delta=_delta_rows(delta, m, n), lora=_lora_launch(lora, m, n, stacked=False))
    return y.reshape(*lead, n)


def _delta_rows(delta: torch.Tensor | None, m: int, n: int) -> torch.Tensor | None:
    """A linear's fp32 delta as the kernel reads it: [1, M, N] contiguous, the output's layout."""
    if delta is None:
        return None
    d = delta.reshape(m, n)
    return (d if d.is_contiguous() else d.contiguous()).unsqueeze(0)


def _bwd_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    return _dot_dtype(x.dtype, w.dtype)


def lora_grads(g: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float, need_t: bool,
               need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dt, db) in fp32 of ``scale * t @ b^T`` given its output gradient g [M, N] (t [M, r], b [N, r] fp32; g may be a
    column-block view). A 16-bit g is multiplied as it is (``mm_fp32_factor``: each fp32 factor as two 16-bit
    halves, fp32 accumulation), never copied to fp32: at 16K tokens that copy of a fused projection's gradient is
    the largest tensor of its backward. Otherwise (an fp32 g, or a CUDA torch without fp32-output 16-bit GEMMs)
    fp32 GEMMs at the contract's backward precision, as the unfused product's backward."""
    t2 = t.reshape(-1, t.shape[-1])
    if g.dtype in HALF and fp32_out_gemms(g.device):
        dt = mm_fp32_factor(g, b) if need_t else None
        db = mm_fp32_factor(g.t(), t2) if need_b else None
    else:
        g = g.float()
        dt = g @ b if need_t else None
        db = g.t() @ t2 if need_b else None
    if scale != 1.0:
        dt, db = (None if dt is None else dt.mul_(scale)), (None if db is None else db.mul_(scale))
    return (None if dt is None else dt.reshape(t.shape)), db


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype, delta: torch.Tensor | None = None, lora_t: torch.Tensor | None = None,
                lora_b: torch.Tensor | None = None, lora_scale: float = 1.0) -> torch.Tensor:
        # Keep only what the backward reads: x for dW, W for dX (frozen base weights: no x kept); the LoRA
        # factors for each other's gradients.
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if need_w else None, weight if need_x else None, lora_t, lora_b)
        ctx.x_meta, ctx.w_meta = (x.shape, x.dtype), (weight.shape, weight.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.lora_scale = lora_scale
        lora = None if lora_t is None else _ops.LoraUp(lora_t, lora_b, lora_scale)
        return _linear_forward(x, weight, bias, out_dtype, delta, lora)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, lora_t, lora_b = ctx.saved_tensors
        (x_shape, x_dtype), (w_shape, w_dtype) = ctx.x_meta, ctx.w_meta
        cdt = _dot_dtype(x_dtype, w_dtype)
        k, n = x_shape[-1], w_shape[0]
        g2 = gy.reshape(-1, n).to(cdt)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g2 @ w.to(cdt)).reshape(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = (g2.t() @ x.reshape(-1, k).to(cdt)).to(w_dtype)
        if ctx.needs_input_grad[2]:
            db = gy.reshape(-1, n).float().sum(0).to(ctx.bias_dtype)
        # the delta is added in fp32 before the rounding: its gradient is the output's, in fp32
        d_delta = gy.float() if ctx.needs_input_grad[4] else None
        dt = dlb = None
        if lora_t is not None and any(ctx.needs_input_grad[5:7]):
            dt, dlb = lora_grads(gy.reshape(-1, n), lora_t, lora_b, ctx.lora_scale, *ctx.needs_input_grad[5:7])
        return dx, dw, db, None, d_delta, dt, dlb, None


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@linear.register("triton")
def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, delta: torch.Tensor | None = None,
                  lora: _ops.LoraUp | None = None) -> torch.Tensor:
    """Triton ``linear``: x [..., K] @ weight[N, K]^T (+ bias) (+ delta, fp32, or the LoRA delta from its
    factors, in the launch) -> [..., N] in out_dtype (default x.dtype)."""
    if lora is not None and (delta is not None or compute_in_fp64(x, weight, bias, lora.t, lora.b)):
        # (raises with both; fp64 factors: gradchecks)
        delta, lora = _ops.resolve_delta(delta, lora, "linear", lambda up: _ops.lora_delta(up, linear_triton)), None
    if compute_in_fp64(x, weight, bias, delta):
        return linear.impls["torch"](x, weight, bias, out_dtype, delta)  # gradchecks only
    out_dtype = out_dtype or x.dtype
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear: x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if delta is not None:
        _ops.check_delta(delta, (*x.shape[:-1], weight.shape[0]))
        delta = delta.float()
    if lora is not None:
        if _needs_grad(x, weight, bias, lora.t, lora.b):
            return _LinearFn.apply(x, weight, bias, out_dtype, None, lora.t, lora.b, float(lora.scale))
        return _linear_forward(x, weight, bias, out_dtype, None, lora)
    if _needs_grad(x, weight, bias, delta):
        return _LinearFn.apply(x, weight, bias, out_dtype, delta)
    return _linear_forward(x, weight, bias, out_dtype, delta)


# ------------------------------------------------------------------------------- linear_concat
def _concat_forward(x: torch.Tensor, weights: list[torch.Tensor], out_dtype: torch.dtype,
                    delta: torch.Tensor | None = None, x_blocks: bool = False,
                    lora: _ops.LoraUpConcat | None = None) -> torch.Tensor:
    """All segments in one launch. The config is ``linear``'s for the summed N (which program computes
    an element, never its bits: module doc), so each column equals Triton ``linear(x, w_s)``'s.
    ``x_blocks`` (``linear_blockdiag``): segment s reads x's s-th block of K_s columns instead of all
    of x; the config's BLOCK_K is a function of (dtypes, M bucket) only, as for every linear, so a
    block's K loop is the one Triton ``linear(x_block, w_s)`` runs. ``lora`` (checked by the caller:
    ``_fusable_concat_lora``): every segment's LoRA delta in the launch."""
    lead, k = x.shape[:-1], x.shape[-1]
    ns = [w.shape[0] for w in weights]
    n = sum(ns)
    x2 = _rows(x, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m and n:
        w0 = weights[0]
        k_cfg = max(w.shape[1] for w in weights) if x_blocks else k
        cfg = linear_config(n, k_cfg, _config_dtype(x.dtype, w0.dtype), m)
        launch_lora = None
        if lora is not None:
            cfg = lora_config(cfg, n)  # before the column tiles are counted from BLOCK_N
            b_table = _weight_table(list(lora.bs), x.device, "lora_B")
            launch_lora = _LoraLaunch(_lora_rows(lora.t, m), lora.bs[b_table.base_index], float(lora.scale),
                                      b_table.table)
        what = "linear_blockdiag" if x_blocks else "linear_concat"
        table = _weight_table(weights, x.device, what)
        cols = _column_offsets(tuple(ns), x.device, tuple(w.shape[1] for w in weights) if x_blocks else None)
        seg = _SegmentLaunch(cols, table.table, table.align, len(weights),
                             sum(cdiv(c, cfg.block_n) for c in ns), x_blocks)
        _launch(x2.unsqueeze(0), weights[table.base_index].unsqueeze(0), None, y.unsqueeze(0), cfg, m, n, k_cfg,
                segments=seg, delta=_delta_rows(delta, m, n), lora=launch_lora)
    # 2-D x: y itself, not a reshape view of it. An autograd Function's output that is a view keeps the untracked
    # buffer as its ``_base``, and layers.joined_columns then has to copy the parts instead of slicing y
    return y if x.dim() == 2 else y.reshape(*lead, n)


def _fusable_concat_lora(x: torch.Tensor, ws: list[torch.Tensor], lora: _ops.LoraUpConcat) -> bool:
    """Whether the segment-mode launch can add ``lora``'s deltas (shapes checked, ValueError otherwise): one
    fp32 B per weight, all of one rank r and one layout, t fp32 [..., S * r], and a K the GEMM does not split
    (a split-K product adds its delta after the partial sums)."""
    t, bs = lora.t, list(lora.bs)
    rs = [b.shape[-1] if b.dim() == 2 else -1 for b in bs]
    if (len(bs) != len(ws) or any(b.dim() != 2 or b.shape[0] != w.shape[0] for b, w in zip(bs, ws))
            or tuple(t.shape[:-1]) != tuple(x.shape[:-1]) or t.shape[-1] != sum(rs)):
        raise ValueError(f"linear_concat: lora must hold one B [N_s, r_s] per weight and t [..., sum r_s] with x's "
                         f"rows, got t {tuple(t.shape)} and B {[tuple(b.shape) for b in bs]} for weights "
                         f"{[tuple(w.shape) for w in ws]}")
    return (all(tt.dtype == torch.float32 for tt in (t, *bs)) and len(set(rs)) == 1
            and all(b.stride() == bs[0].stride() and b.stride(-1) == 1 for b in bs)
            and not _k_chunk(x.dtype, ws[0].dtype, x.shape[-1]))


def _one_segment_table(ws: list[torch.Tensor]) -> bool:
    """Whether segment mode is worth it and can address these weights: more than one, one dtype and one
    set of strides (the weight-offset table assumes both)."""
    return len(ws) > 1 and all(w.dtype == ws[0].dtype and w.stride() == ws[0].stride() for w in ws)


_COLS_CACHE: dict[tuple, torch.Tensor] = {}


def _column_offsets(ns: tuple[int, ...], device: torch.device, ks: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [S+1] cumulative output column offsets on the device, followed for a block-diagonal product
    by the S+1 cumulative x column offsets of its input widths ``ks`` ([2S+2] in all); one tensor per
    (widths, device) for the life of the process (a few per model; a captured graph keeps reading the
    one it was captured with)."""
    key = (ns, ks, device)
    hit = _COLS_CACHE.get(key)
    if hit is None:
        if capturing(device):
            raise RuntimeError("linear_concat: these widths were never seen before CUDA-graph capture; "
                               "run the captured call once eagerly first (warm-up)")
        offs: list[int] = []
        for widths in (ns,) if ks is None else (ns, ks):
            offs.append(0)
            for c in widths:
                offs.append(offs[-1] + c)
        hit = _COLS_CACHE[key] = torch.tensor(offs, dtype=torch.int32, device=device)
    return hit


class _LinearConcatFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_dtype: torch.dtype, delta: torch.Tensor | None,
                lora_t: torch.Tensor | None, lora_scale: float, n_weights: int, *tensors: torch.Tensor) -> torch.Tensor:
        # tensors: the weights, then (with lora_t) one LoRA B per weight
        weights, lora_bs = tensors[:n_weights], tensors[n_weights:]
        need_w = any(ctx.needs_input_grad[6:6 + n_weights])
        ctx.save_for_backward(x if need_w else None, lora_t, *weights, *lora_bs)
        ctx.x_meta = (x.shape, x.dtype)
        ctx.n_weights, ctx.lora_scale = n_weights, lora_scale
        lora = None if lora_t is None else _ops.LoraUpConcat(lora_t, tuple(lora_bs), lora_scale)
        return _concat_forward(x, list(weights), out_dtype, delta, lora=lora)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The backward need not be invariant (docs/numerics.md), only correct and deterministic: stock
        # GEMMs. x is cast to the compute dtype once (not once per weight); the weight gradients of all
        # weights that want one come out of one GEMM over the whole output gradient when every weight
        # wants one (the per-weight gradients are row blocks of it); dX is one GEMM against the
        # weights side by side when copying them costs less than the [M, K] result (the usual trainer
        # case: a K-loop over all segments with one fp32 accumulator, one rounding), else a chain of
        # addmm's into one buffer (no separate add kernels), segment by segment in order.
        x, lora_t, *tensors = ctx.saved_tensors
        weights, lora_bs = tensors[:ctx.n_weights], tensors[ctx.n_weights:]
        x_shape, x_dtype = ctx.x_meta
        cdt = _dot_dtype(x_dtype, weights[0].dtype)
        k = x_shape[-1]
        widths = [w.shape[0] for w in weights]
        g2 = gy.reshape(-1, gy.shape[-1]).to(cdt)
        m = g2.shape[0]
        need_w = list(ctx.needs_input_grad[6:6 + ctx.n_weights])
        dx = None
        if ctx.needs_input_grad[0]:
            if sum(widths) <= m or len(weights) == 1:
                w_all = weights[0].to(cdt) if len(weights) == 1 else torch.cat([w.to(cdt) for w in weights])
                dx = g2 @ w_all
            else:
                c0 = 0
                for w in weights:
                    gs = g2[:, c0:c0 + w.shape[0]]
                    dx = gs @ w.to(cdt) if dx is None else torch.addmm(dx, gs, w.to(cdt))
                    c0 += w.shape[0]
            dx = dx.reshape(x_shape).to(x_dtype)
        dws: list[torch.Tensor | None] = [None] * len(weights)
        if any(need_w):
            xc = x.reshape(-1, k).to(cdt)
            if all(need_w):
                dws = [d.to(w.dtype) for d, w in zip((g2.t() @ xc).split(widths), weights)]
            else:
                c0 = 0
                for i, (w, need) in enumerate(zip(weights, need_w)):
                    if need:
                        dws[i] = (g2[:, c0:c0 + w.shape[0]].t() @ xc).to(w.dtype)
                    c0 += w.shape[0]
        # the delta is added in fp32 before the rounding: its gradient is the output's, in fp32
        d_delta = gy.float() if ctx.needs_input_grad[2] else None
        dt, dbs = None, [None] * len(lora_bs)
        need_b = list(ctx.needs_input_grad[6 + ctx.n_weights:])
        if lora_t is not None and (ctx.needs_input_grad[3] or any(need_b)):
            # segment s: scale * t_s @ B_s^T with the output gradient's column block s
            gs = gy.reshape(-1, gy.shape[-1]).split(widths, dim=-1)  # column-block views, no copy
            ts = lora_t.reshape(-1, lora_t.shape[-1]).split([b.shape[1] for b in lora_bs], dim=-1)
            parts = [lora_grads(g, t, b, ctx.lora_scale, ctx.needs_input_grad[3], need)
                     for g, t, b, need in zip(gs, ts, lora_bs, need_b)]
            if ctx.needs_input_grad[3]:
                dt = torch.cat([p[0] for p in parts], dim=-1).reshape(lora_t.shape)
            dbs = [p[1] for p in parts]
        return (dx, None, d_delta, dt, None, None, *dws, *dbs)


@linear_concat.register("triton")
def linear_concat_triton(x: torch.Tensor, weights: Sequence[torch.Tensor],
                         out_dtype: torch.dtype | None = None, delta: torch.Tensor | None = None,
                         lora: _ops.LoraUpConcat | None = None) -> torch.Tensor:
    """Triton ``linear_concat``: one launch over every weight (segment mode of ``_gemm_kernel``);
    bitwise the concatenation of Triton ``linear`` per weight. ``delta`` (fp32 [..., sum N]) starts the
    accumulator: column block s is bitwise Triton ``linear(x, w_s, delta=delta_s)``; ``lora`` (the deltas
    as their up factors) is computed there: column block s is bitwise Triton ``linear(x, w_s, lora=...)``."""
    ws = list(weights)
    if not ws:
        raise ValueError("linear_concat: no weights")
    k = x.shape[-1]
    for w in ws:
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"linear_concat: x has {k} features but a weight is {tuple(w.shape)}")
    if lora is not None:
        if delta is not None:
            raise ValueError("linear_concat: pass delta or lora, not both")
        fp64 = compute_in_fp64(x, lora.t, *lora.bs, *ws)
        fusable = _fusable_concat_lora(x, ws, lora)
        if len(ws) == 1 and not fp64:
            # one projection: linear's own launch (a one-block product is linear(t, B): the same delta)
            return linear_triton(x, ws[0], None, out_dtype, lora=_ops.LoraUp(lora.t, lora.bs[0], lora.scale))
        if fp64 or not _one_segment_table(ws) or not fusable:
            delta, lora = _ops.lora_concat_delta(lora, None if fp64 else linear_blockdiag_triton), None
        else:
            out_dtype = out_dtype or x.dtype
            if _needs_grad(x, lora.t, *lora.bs, *ws):
                return _LinearConcatFn.apply(x, out_dtype, None, lora.t, float(lora.scale), len(ws), *ws, *lora.bs)
            return _concat_forward(x, ws, out_dtype, lora=lora)
    if compute_in_fp64(x, delta, *ws):
        return linear_concat.impls["torch"](x, ws, out_dtype, delta)
    out_dtype = out_dtype or x.dtype
    widths = [w.shape[0] for w in ws]
    if delta is not None:
        _ops.check_delta(delta, (*x.shape[:-1], sum(widths)))
        delta = delta.float()
    if not _one_segment_table(ws):
        # one weight, or weights the segment table cannot address: separate launches, same bits
        parts = [None] * len(ws) if delta is None else delta.split(widths, dim=-1)
        return torch.cat([linear_triton(x, w, None, out_dtype, d) for w, d in zip(ws, parts)], dim=-1)
    if _needs_grad(x, delta, *ws):
        return _LinearConcatFn.apply(x, out_dtype, delta, None, 1.0, len(ws), *ws)
    return _concat_forward(x, ws, out_dtype, delta)


# ---------------------------------------------------------------------------- linear_blockdiag
class _LinearBlockdiagFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_dtype: torch.dtype, *weights: torch.Tensor) -> torch.Tensor:
        need_w = any(ctx.needs_input_grad[2:])
        ctx.save_for_backward(x if need_w else None, *weights)
        ctx.x_meta = (x.shape, x.dtype)
        return _concat_forward(x, list(weights), out_dtype, x_blocks=True)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Stock GEMMs per block (correct and deterministic; the backward need not be invariant):
        # dX_s = gY_s @ W_s, dW_s = gY_s^T @ X_s.
        x, *weights = ctx.saved_tensors
        x_shape, x_dtype = ctx.x_meta
        cdt = _dot_dtype(x_dtype, weights[0].dtype)
        ns = [w.shape[0] for w in weights]
        ks = [w.shape[1] for w in weights]
        g_blocks = gy.reshape(-1, gy.shape[-1]).to(cdt).split(ns, dim=-1)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.cat([g @ w.to(cdt) for g, w in zip(g_blocks, weights)], dim=-1).reshape(x_shape).to(x_dtype)
        dws: list[torch.Tensor | None] = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            x_blocks = x.reshape(-1, x_shape[-1]).to(cdt).split(ks, dim=-1)
            for i, need in enumerate(ctx.needs_input_grad[2:]):
                if need:
                    dws[i] = (g_blocks[i].t() @ x_blocks[i]).to(weights[i].dtype)
        return (dx, None, *dws)


@linear_blockdiag.register("triton")
def linear_blockdiag_triton(x: torch.Tensor, weights: Sequence[torch.Tensor],
                            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton ``linear_blockdiag``: one launch (segment mode with per-segment x columns); column block
    s is bitwise Triton ``linear(x[..., block s], weights[s])``."""
    ws = list(weights)
    ks = _ops.check_blockdiag(x, ws)
    if compute_in_fp64(x, *ws):
        return linear_blockdiag.impls["torch"](x, ws, out_dtype)
    out_dtype = out_dtype or x.dtype
    if not _one_segment_table(ws) or any(_k_chunk(x.dtype, ws[0].dtype, kk) for kk in ks):
        # one weight, weights the segment table cannot address, or a block whose K would be split
        # (fp32 weights with K_s > SPLIT_K_CHUNK): separate launches, same bits
        return torch.cat([linear_triton(xs, w, None, out_dtype) for xs, w in zip(x.split(ks, dim=-1), ws)], dim=-1)
    if _needs_grad(x, *ws):
        return _LinearBlockdiagFn.apply(x, out_dtype, *ws)
    return _concat_forward(x, ws, out_dtype, x_blocks=True)


# ------------------------------------------------------------------------------- grouped_linear
def _grouped_forward(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                     delta: torch.Tensor | None = None, lora: _ops.LoraUp | None = None) -> torch.Tensor:
    g, m, k = x.shape
    n = weight.shape[1]
    y = torch.empty(g, m, n, dtype=out_dtype, device=x.device)
    if g and m and n:
        # linear's config: a row of group g equals Triton linear(row, weight[g]) bitwise.
        cfg = linear_config(n, k, _config_dtype(x.dtype, weight.dtype), m)
        launch_lora = None
        if lora is not None:
            cfg = lora_config(cfg, n)
            b = lora.b
            if b.stride(-1) != 1:  # the kernel reads B rows with unit stride over r
                # a shared B (an expanded view, e.g. MLA's A^T for every head): one [N, r] copy, still shared
                b = b[0].contiguous().expand(g, -1, -1) if b.stride(0) == 0 else b.contiguous()
            launch_lora = _LoraLaunch(lora.t.reshape(g * m, lora.t.shape[-1]).contiguous(), b, float(lora.scale))
        xs = x if (x.stride(-1) == 1 or k <= 1) else x.contiguous()
        # the kernel reads the delta with y's strides: [G, M, N] contiguous
        _launch(xs, weight, None, y, cfg, m, n, k, delta=None if delta is None else delta.contiguous(),
                lora=launch_lora)
    return y


def _fusable_grouped_lora(x: torch.Tensor, weight: torch.Tensor, lora: _ops.LoraUp) -> bool:
    """Whether the batched launch can add ``lora``'s delta (shapes checked, ValueError otherwise): fp32 t [G, M, r]
    and b [G, N, r] of x's and weight's groups and rows, r within one K step of the LoRA product, and a K the GEMM does not
    split (a split-K product adds its delta after the partial sums)."""
    (g, m, k), n = x.shape, weight.shape[1]
    t, b = lora.t, lora.b
    r = t.shape[-1]
    if tuple(t.shape) != (g, m, r) or tuple(b.shape) != (g, n, r):
        raise ValueError(f"grouped_linear: lora must hold t [{g}, {m}, r] and b [{g}, {n}, r], got t "
                         f"{tuple(t.shape)} and b {tuple(b.shape)}")
    return t.dtype == torch.float32 and b.dtype == torch.float32 and r <= SPLIT_BLOCK_K and not _k_chunk(
        x.dtype, weight.dtype, k)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                delta: torch.Tensor | None = None, lora_t: torch.Tensor | None = None,
                lora_b: torch.Tensor | None = None, lora_scale: float = 1.0) -> torch.Tensor:
        ctx.save_for_backward(x, weight, lora_t, lora_b)
        ctx.lora_scale = lora_scale
        lora = None if lora_t is None else _ops.LoraUp(lora_t, lora_b, lora_scale)
        return _grouped_forward(x, weight, out_dtype, delta, lora)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, lora_t, lora_b = ctx.saved_tensors
        cdt = _bwd_dtype(x, w)
        g = gy.to(cdt)
        dx = torch.bmm(g, w.to(cdt)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(g.transpose(1, 2), x.to(cdt)).to(w.dtype) if ctx.needs_input_grad[1] else None
        # the delta is added in fp32 before the rounding: its gradient is the output's, in fp32
        d_delta = gy.float() if ctx.needs_input_grad[3] else None
        dt = db = None
        if lora_t is not None and any(ctx.needs_input_grad[4:6]):
            # scale * t[g] @ b[g]^T: per group dt = scale gy b, db = scale gy^T t (a shared b's expand sums them)
            g32 = gy.float()
            dt = torch.bmm(g32, lora_b) if ctx.needs_input_grad[4] else None
            db = torch.bmm(g32.transpose(1, 2), lora_t) if ctx.needs_input_grad[5] else None
            if ctx.lora_scale != 1.0:
                dt, db = (None if v is None else v.mul_(ctx.lora_scale) for v in (dt, db))
        return dx, dw, None, d_delta, dt, db, None


@grouped_linear.register("triton")
def grouped_linear_triton(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
                          delta: torch.Tensor | None = None, lora: _ops.LoraUp | None = None) -> torch.Tensor:
    """Triton ``grouped_linear``: y[g] = x[g] @ weight[g]^T (+ delta[g], fp32, or the LoRA delta from its factors,
    in the launch) for x [G, M, K], weight [G, N, K] (any strides, e.g. expanded or transposed views)."""
    g, m, k = x.shape
    if weight.shape[0] != g or weight.shape[2] != k:
        raise ValueError(f"grouped_linear: x {tuple(x.shape)} vs weight {tuple(weight.shape)}")
    if lora is not None and (delta is not None or compute_in_fp64(x, weight, lora.t, lora.b)
                             or not _fusable_grouped_lora(x, weight, lora)):
        # (raises with both; fp64 factors: gradchecks) the delta unfused: the same value
        delta, lora = _ops.resolve_delta(delta, lora, "grouped_linear",
                                         lambda up: _ops.grouped_lora_delta(up, grouped_linear_triton)), None
    if compute_in_fp64(x, weight, delta):
        return grouped_linear.impls["torch"](x, weight, out_dtype, delta)
    out_dtype = out_dtype or x.dtype
    if lora is not None:
        if _needs_grad(x, weight, lora.t, lora.b):
            return _GroupedLinearFn.apply(x, weight, out_dtype, None, lora.t, lora.b, float(lora.scale))
        return _grouped_forward(x, weight, out_dtype, lora=lora)
    if delta is not None:
        _ops.check_delta(delta, (g, m, weight.shape[1]))
    if _needs_grad(x, weight, delta):
        return _GroupedLinearFn.apply(x, weight, out_dtype, delta)
    return _grouped_forward(x, weight, out_dtype, delta)


# ------------------------------------------------------------------------------------ bmm_fixed
def _bmm_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    bsz = math.prod(lead)  # explicit: reshape(-1, ...) is ambiguous when a matrix dim is 0
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(bsz, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(bsz, *b.shape[-2:])
    return a3, b3, lead


def _bmm_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a3, b3, lead = _bmm_operands(a, b)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    y = torch.empty(a3.shape[0], m, n, dtype=torch.float32, device=a.device)
    if y.numel():
        cfg = bmm_config(m, n, k, _config_dtype(a.dtype, b.dtype))
        # b [G, k, n] as the kernel's weight [G, n, k]: a transposed view (strides swapped).
        _launch(a3, b3.transpose(1, 2), None, y, cfg, m, n, k)
    return y.reshape(*lead, m, n)


class _BmmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _bmm_forward(a, b)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        cdt = torch.float32
        g = gy.to(cdt)
        da = db = None
        if ctx.needs_input_grad[0]:
            da = (g @ b.to(cdt).transpose(-1, -2)).sum_to_size(a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            db = (a.to(cdt).transpose(-1, -2) @ g).sum_to_size(b.shape).to(b.dtype)
        return da, db


@bmm_fixed.register("triton")
def bmm_fixed_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Triton ``bmm_fixed``: batched a [..., m, k] @ b [..., k, n] (broadcast leading dims), fp32 out."""
    if compute_in_fp64(a, b):
        return bmm_fixed.impls["torch"](a, b)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"bmm_fixed: a {tuple(a.shape)} and b {tuple(b.shape)} do not chain")
    if _needs_grad(a, b):
        return _BmmFn.apply(a, b)
    return _bmm_forward(a, b)


# -------------------------------------------------------------------------------- expert_linear
@dataclass(frozen=True)
class _WeightTable:
    """Cached per-expert weight offsets of one set of per-expert weights (see the module doc)."""

    table: torch.Tensor  # int64 [E] element offsets from the base weight, on the device
    align: int  # guaranteed alignment of every expert's weight start, in elements
    base_index: int  # which expert's weight is the base (the lowest address)


_WOFF_CACHE: "collections.OrderedDict[tuple, _WeightTable]" = collections.OrderedDict()
_WOFF_CACHE_SIZE = 1024
# Tables read by a captured CUDA graph: the graph holds their address, not a reference, so they must
# outlive it; they are never evicted (E int64 each, a few per MoE layer).
_WOFF_PINNED: dict[tuple, _WeightTable] = {}


def _build_weight_table(views: list[torch.Tensor], ptrs: tuple[int, ...], device: torch.device,
                        what: str) -> _WeightTable:
    """Validate a weight set (once per set: every call afterwards hits the cache) and build its table.
    Experts share one [N, K]; the segments of ``linear_concat`` share K (their N differ); those of
    ``linear_blockdiag`` need only share strides."""
    w0 = views[0]
    same = {"expert_linear": lambda w: w.shape == w0.shape, "linear_blockdiag": lambda w: True}.get(
        what, lambda w: w.shape[1:] == w0.shape[1:])
    for w in views:
        if w.dim() != 2 or not same(w):
            raise ValueError(f"{what}: every weight must be [N, K] with the same "
                             f"{'N, K' if what == 'expert_linear' else 'K'}")
        if w.dtype != w0.dtype or w.stride() != w0.stride() or w.device != w0.device:
            raise ValueError(f"{what}: the weights must share dtype, strides and device")
    es = w0.element_size()
    base_i = min(range(len(ptrs)), key=ptrs.__getitem__)
    deltas = [p - ptrs[base_i] for p in ptrs]
    if any(d % es for d in deltas):
        raise ValueError(f"{what}: the weights are not element-aligned to each other")
    # Weight loads vectorise when every weight starts on a 16-byte boundary: then every offset is a
    # multiple of 16 bytes' worth of elements.
    align = 16 // es if all(p % 16 == 0 for p in ptrs) and 16 % es == 0 else 1
    table = torch.tensor([d // es for d in deltas], dtype=torch.int64, device=device)
    return _WeightTable(table, align, base_i)


def _weight_table(views: list[torch.Tensor], device: torch.device, what: str) -> _WeightTable:
    """The cached table of a set of separate weights (``_build_weight_table``), keyed on their addresses,
    shapes, dtype, strides and device: a function of the key alone, so the cache is never stale, and the
    same device tensor on every call, which is what a captured CUDA graph needs."""
    w0 = views[0]
    ptrs = tuple(w.data_ptr() for w in views)
    # w0.device: always indexed (cuda:0)
    key = (what, ptrs, w0.dtype, tuple(tuple(w.shape) for w in views), w0.stride(), w0.device)
    hit = _WOFF_PINNED.get(key)
    if hit is None:
        in_capture = capturing(device)
        hit = _WOFF_CACHE.get(key)
        if hit is None:
            if in_capture:
                # building it now would record a copy from a temporary host buffer into the graph
                raise RuntimeError(f"{what}: this set of weights was never seen before CUDA-graph "
                                   "capture; run the captured call once eagerly first (warm-up)")
            hit = _build_weight_table(views, ptrs, device, what)
            _WOFF_CACHE[key] = hit
            if len(_WOFF_CACHE) > _WOFF_CACHE_SIZE:
                _WOFF_CACHE.popitem(last=False)
        else:
            _WOFF_CACHE.move_to_end(key)
        if in_capture:
            _WOFF_PINNED[key] = _WOFF_CACHE.pop(key)
    return hit


def _expert_weight_table(weights: _moe.Weights, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(the kernel's weight base, int64 element offsets [E] of every expert from it or None, the
    offsets' guaranteed alignment in elements).

    Per-expert weights: the base is the expert weight at the lowest address as [1, N, K], so all
    offsets are >= 0; all experts must share shape, dtype and strides (true for the model's experts);
    the table is ``_weight_table``'s. Stacked [E, N, K] weights: the base is the stack itself and no
    table is needed."""
    if isinstance(weights, torch.Tensor):
        es = weights.element_size()
        aligned = (16 % es == 0 and weights.data_ptr() % 16 == 0
                   and (weights.shape[0] == 1 or (weights.stride(0) * es) % 16 == 0))
        return weights, None, 16 // es if aligned else 1
    views = list(weights)
    hit = _weight_table(views, device, "expert_linear")
    return views[hit.base_index].unsqueeze(0), hit.table, hit.align


def _expert_tiles(offsets: Sequence[int], block_m: int) -> int:
    """Exact number of BLOCK_M tiles of host offsets (each expert's rows cut from its first row; a
    tile never holds rows of two experts). The kernel finds each tile's expert and rows itself."""
    return sum(cdiv(b - a, block_m) for a, b in zip(offsets, offsets[1:]))


def _max_expert_tiles(m: int, n_experts: int, block_m: int) -> int:
    """Upper bound of the tile count for any offsets of M rows over E experts, from host shapes only:
    sum_e ceil(c_e / B) <= sum_e floor(c_e / B) + #{e: c_e > 0} <= M // B + min(E, M)."""
    return m // block_m + min(n_experts, m)


def _expert_forward(x: torch.Tensor, weights: _moe.Weights, offsets: list[int] | torch.Tensor,
                    out_dtype: torch.dtype, delta: torch.Tensor | None = None,
                    lora: _ops.LoraUp | None = None, gather: _moe.RowGather | None = None) -> torch.Tensor:
    """``offsets``: a host list (validated here) or an integer tensor [E+1] on x's device (trusted:
    reading its values would sync; the kernel clamps them into [0, M]). ``lora``: t [M, r], stacked b
    [E, N, r] (in the launch; unfused for a split-K product). ``gather``: the product's rows are x's rows
    by its index (the kernel reads them there)."""
    dev = offsets if isinstance(offsets, torch.Tensor) else None
    rows = x if gather is None else torch.empty(gather.index.shape[0], x.shape[1], device="meta")  # shapes only
    if dev is None:
        e, n, k = _moe.check_expert_args(rows, weights, offsets, every_weight=False)
    else:
        e, n, k = _moe.check_expert_shapes(rows, weights, dev.shape[0], every_weight=False)
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    w_dtype = weights.dtype if isinstance(weights, torch.Tensor) else weights[0].dtype
    if lora is not None and _k_chunk(x.dtype, w_dtype, k):
        delta, lora = _moe.expert_lora_delta(lora, offsets, expert_linear_triton), None  # the same value, unfused
    # The config follows model dims and the bucket of the mean rows per expert (host shapes only), as
    # for linear: at batch 256 an expert sees ~32 of the 2048 routed rows, a decode-sized tile.
    cfg = linear_config(n, k, _config_dtype(x.dtype, w_dtype), cdiv(m, e), experts=True)
    if lora is not None:
        cfg = lora_config(cfg, n)  # before the row tiles are counted from its BLOCK_M
    w3, woff, align = _expert_weight_table(weights, x.device)
    if dev is None:
        n_tiles = _expert_tiles(offsets, cfg.block_m)
        offs = torch.tensor(offsets, dtype=torch.int32, device=x.device)
    else:
        # A fixed grid for a fixed M: capture-safe; surplus programs exit in the kernel.
        n_tiles = _max_expert_tiles(m, e, cfg.block_m)
        offs = dev if (dev.dtype == torch.int32 and dev.is_contiguous()) else dev.to(torch.int32).contiguous()
    xs = _rows(x, k)
    gidx = None if gather is None else gather.index.to(device=x.device, dtype=torch.int64).contiguous()
    _launch(xs.unsqueeze(0), w3, None, y.unsqueeze(0), cfg, m, n, k,
            experts=_ExpertLaunch(offs, woff, align, e, n_tiles, gidx, 1 if gather is None else gather.div),
            delta=_delta_rows(delta, m, n), lora=_lora_launch(lora, m, n, stacked=True))
    return y


def _prefetch_offsets(offsets: torch.Tensor) -> tuple[int, torch.Tensor, torch.cuda.Event]:
    """Start copying device offsets into pinned host memory, for the backward (which needs host row
    ranges) to read without a stall: reading them back there (``.tolist()``) would wait for the whole
    stream. One copy per offsets tensor (an MoE layer passes one to all of its expert_linear calls),
    remembered on the tensor with its version (an in-place change would start a new copy)."""
    hit = getattr(offsets, "_zmrl_host_offsets", None)
    if hit is not None and hit[0] == offsets._version:
        return hit
    host = torch.empty(offsets.shape, dtype=offsets.dtype, pin_memory=True)
    host.copy_(offsets, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    hit = (offsets._version, host, done)
    offsets._zmrl_host_offsets = hit
    return hit


def _backward_offsets(ctx: Any) -> list[int]:
    if ctx.host_offsets is None:
        return _moe.as_offsets(ctx.offsets)
    _, host, done = ctx.host_offsets
    done.synchronize()  # the forward's copy: long finished by the time the backward runs
    return [int(o) for o in host.tolist()]


class _ExpertLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offsets: list[int] | torch.Tensor, out_dtype: torch.dtype, stacked: bool,
                delta: torch.Tensor | None, lora_t: torch.Tensor | None, lora_b: torch.Tensor | None,
                lora_scale: float, *weights: torch.Tensor) -> torch.Tensor:
        ws: _moe.Weights = weights[0] if stacked else list(weights)
        ctx.offsets, ctx.stacked, ctx.x_dtype, ctx.lora_scale = offsets, stacked, x.dtype, lora_scale
        ctx.host_offsets = (_prefetch_offsets(offsets) if isinstance(offsets, torch.Tensor) and offsets.is_cuda
                            else None)
        # x only feeds dW: with frozen expert weights (LoRA training) it is not kept.
        ctx.save_for_backward(x if any(ctx.needs_input_grad[8:]) else None, lora_t, lora_b, *weights)
        lora = None if lora_t is None else _ops.LoraUp(lora_t, lora_b, lora_scale)
        return _expert_forward(x, ws, offsets, out_dtype, delta, lora)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, lora_t, lora_b, *weights = ctx.saved_tensors
        ws = weights[0] if ctx.stacked else weights
        offsets = _backward_offsets(ctx)
        # Device offsets come from the copy the forward started (no stall); the backward is two grouped
        # kernels over the expert-sorted rows (triton/expert_grads.py via moe_gemm_grads.py), no loop over experts.
        dx, dws = expert_linear_grads(gy, x, ws, offsets, ctx.needs_input_grad[0],
                                      list(ctx.needs_input_grad[8:]), ctx.x_dtype)
        # the delta is added in fp32 before the rounding: its gradient is the output's, in fp32
        d_delta = gy.float() if ctx.needs_input_grad[4] else None
        dt = dlb = None
        if lora_t is not None and any(ctx.needs_input_grad[5:7]):
            # the LoRA up product's backward: that of expert_linear(t, b) (fp32 factors: fp32 compute class) on the
            # output's gradient as it is (a 16-bit one is widened in the kernels' registers, exactly: no fp32 copy),
            # then scaled
            dt, dlbs = expert_linear_grads(gy, lora_t, lora_b, offsets, ctx.needs_input_grad[5],
                                           [ctx.needs_input_grad[6]], lora_t.dtype)
            dlb = dlbs[0]
            if ctx.lora_scale != 1.0:
                dt, dlb = (None if dt is None else dt * ctx.lora_scale), (None if dlb is None else dlb * ctx.lora_scale)
        return (dx, None, None, None, d_delta, dt, dlb, None, *dws)


@expert_linear.register("triton")
def expert_linear_triton(x: torch.Tensor, weights: _moe.Weights, offsets: Sequence[int] | torch.Tensor,
                         out_dtype: torch.dtype | None = None, delta: torch.Tensor | None = None,
                         lora: _ops.LoraUp | None = None, gather: _moe.RowGather | None = None) -> torch.Tensor:
    """Triton ``expert_linear``: all experts in one launch; a row's result equals Triton
    ``linear(row, weights[e])`` bitwise. Offsets as an integer tensor on x's device are never read
    on the host (capture-safe forward); host lists / other tensors take the same kernel. ``lora``: the
    experts' LoRA delta from its factors, in the launch. ``gather``: read in the kernel without autograd (the
    engine), materialised first under autograd (the backward works on the gathered rows)."""
    if gather is not None:
        _moe.check_gather(x, gather)
    if lora is not None and (delta is not None or compute_in_fp64(x, lora.t, lora.b)):
        # (raises with both; fp64 factors: gradchecks)
        delta, lora = _ops.resolve_delta(delta, lora, "expert_linear",
                                         lambda up: _moe.expert_lora_delta(up, offsets, expert_linear_triton)), None
    dev = _moe.device_offsets(offsets, x)
    offs: list[int] | torch.Tensor = dev if dev is not None else _moe.as_offsets(offsets)
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if not ws:
        raise ValueError("expert_linear: no experts")
    # Expert weights share one dtype (checked with the weight table), so the first one decides.
    if compute_in_fp64(x, ws[0], delta) or (lora is not None and compute_in_fp64(ws[0])):
        return expert_linear.impls["torch"](x, weights, offs, out_dtype, delta, lora, gather)
    out_dtype = out_dtype or x.dtype
    n = weights.shape[1] if isinstance(weights, torch.Tensor) else ws[0].shape[0]
    if delta is not None:
        _ops.check_delta(delta, (x.shape[0] if gather is None else gather.index.shape[0], n))
        delta = delta.float()
    lt, lb, ls = (None, None, 1.0) if lora is None else (lora.t, lora.b, float(lora.scale))
    if _needs_grad(x, delta, lt, lb, *ws):
        rows = x if gather is None else gather.rows(x)  # the backward works on the gathered rows
        return _ExpertLinearFn.apply(rows, offs, out_dtype, isinstance(weights, torch.Tensor), delta, lt, lb, ls, *ws)
    return _expert_forward(x, weights, offs, out_dtype, delta, lora, gather)
