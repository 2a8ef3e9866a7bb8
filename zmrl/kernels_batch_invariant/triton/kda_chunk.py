"""Triton forward of ``kda_chunk`` (chunked Kimi Delta Attention); its "fast" (fla-core) backend
is in ``kda/chunk.py``.

Same signature, returns and semantics as the torch backend in ``kda/chunk.py`` (read its docstring):
chunks of 64 rows aligned to each sequence's start, a token's output computed from the fp32 state at
its chunk start plus the chunk's rows <= itself, the state advancing only through complete chunks.

Two kernels:

1. ``_kda_intra_kernel``, one program per (chunk, head), all chunks of all sequences at once: the
   state-independent part of a chunk. It writes (fp32 scratch) ``A_qk`` (lower, diagonal kept),
   ``W``/``U`` = (I + A_kk)^-1 diag(beta) [exp(gc) K | V] and the decayed read-out / update factors
   ``qg = scale q exp(gc)``, ``kd = exp(gc_last - gc) K``, ``exp(gc_last)`` (gc: the in-chunk
   cumulative log-decay), so the sequential kernel below runs no exp.
2. ``_kda_inter_kernel``, one program per (sequence, head, dv tile): the chunk-by-chunk recurrence
   with the fp32 state [dk, BV] held in registers; it writes the outputs, the chunk states and the
   final state.

Why row r of a chunk gets the same bits whether rows > r are real (prefill / trainer) or zero padding
(decode re-running its current partial chunk from the boundary state), and whatever other chunks and
sequences share the launch:

* every tile is 64 rows whatever the number of real rows (padding loaded as exact zeros), and the
  launch configuration depends on model dims only (dk, dv), never on T, N or the chunk count;
* ``gc`` is ``tl.cumsum`` over the rows of a fixed [64, dk] tile: an inclusive scan whose combine tree
  is fixed by the tile shape and only ever combines rows <= r into row r;
* A entries (i, j): off-diagonal 16-row blocks are a fixed sequence of ``tl.dot`` (dk in
  ascending column blocks) of row i's factor ``x_i * exp(gc_i - gc_r)`` (r = first row of i's
  block, r <= i) with ``k_j * exp(gc_r - gc_j)`` (j < r, other columns masked to exact 0 *before*
  the exp, so both exponents are <= 0 and nothing overflows); diagonal blocks are masked exponent
  differences reduced over dk per row, for the chunk's real columns j (the others stay exact 0);
* the unit lower-triangular inverse T = (I + A_kk)^-1 is built row by row by forward substitution,
  ``T[i, :] = e_i - sum_{j<i} A_kk[i, j] T[j, :]``; at step i the rows > i of T are still zero and
  A_kk[i, j >= i] is exactly 0, so row i reads rows < i only;
* every product ``X @ Y`` that mixes rows (T @ rhs, A_qk @ V_e) has X[i, j] = 0 exactly for j > i,
  so rows j > i of Y add exact zeros to row i whatever they hold; every other product is row-wise;
* the recurrence advances the state only when the chunk is complete, in ascending chunk order.

Dots run on fp32 operands with ``input_precision`` = ``ZMRL_KDA_DOT_PRECISION``: "tf32x3" (default:
three TF32 tensor-core passes, fp32-level accuracy, ~1e-6 relative), "ieee" (fp32 FMA, slowest) or
"tf32" (one pass, fastest, ~1e-3 relative: still 8x finer than the bf16 operands fla-core uses).
The precision changes the bits but not the invariance: it is a compile-time constant of the kernel,
read once at import, so the rollout and trainer processes must run with the same value (the
default unless someone sets it).

Decode step (``kda_chunk_step``, the CUDA-graph entry): the same two kernels on a fixed layout, N
chunks of 64 rows, sequence i's chunk at rows [64 i, 64 i + num_rows[i]) of the [N*64, H, d] inputs.
Its tables (chunk/sequence start = 64 i, rows = length = num_rows, chunk id = i) are built with torch
ops on the device from ``num_rows``, the grids from (N, H, dk, dv): nothing is read back to the host,
so the call can be captured. Sequence i's program runs exactly what ``kda_chunk`` runs for a one-chunk
segment of num_rows[i] rows (same kernels, constexprs and launch config, masks from num_rows), hence
the same bits; ``o`` is zero-filled first, so its rows >= num_rows are exact zeros.

Autograd: the forward is the kernel; the backward is fla-core's chunked KDA backward
(``kda_chunk_bwd.py``: why it is the gradient of the same function, and its fallback to the torch
composition). fp64 inputs (gradcheck) run the torch backend.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..kda.chunk import CHUNK_SIZE, _check_step_args, kda_chunk, kda_chunk_step
from ._common import cdiv, next_pow2
from .kda_chunk_bwd import with_fla_backward

_SUB = 16  # sub-block rows of the intra-chunk A products (the off-diagonal factorisation)
_DOT_PRECISIONS = ("tf32x3", "ieee", "tf32")
DOT_PRECISION: str = os.environ.get("ZMRL_KDA_DOT_PRECISION", "tf32x3")
if DOT_PRECISION not in _DOT_PRECISIONS:
    raise ValueError(f"ZMRL_KDA_DOT_PRECISION must be one of {_DOT_PRECISIONS}, got {DOT_PRECISION!r}")


# --------------------------------------------------------------------------------------- kernels
# Addressing: every tile address is a scalar base pointer (int64 arithmetic, once per tile) plus
# int32 in-tile offsets; int64 offset tiles would cost two registers per element.


@triton.jit
def _kda_intra_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # packed [T, H, d] / [T, H] inputs
    chunk_tok_ptr, chunk_rows_ptr,  # [NC] first token and number of real rows of each chunk
    qg_ptr, kd_ptr, aqk_ptr, w_ptr, u_ptr,  # fp32 scratch [NC, H, 64, dk | dk | 64 | dk | dv]
    dec_ptr,  # fp32 scratch [NC, H, dk]: exp(gc of row 63), the state decay of a complete chunk
    scale, H,
    DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BK: tl.constexpr,
    BVI: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr,
):
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok0 = tl.load(chunk_tok_ptr + cid).to(tl.int64)
    nr = tl.load(chunk_rows_ptr + cid)
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    dks = tl.arange(0, DKP)
    rmask = rows < nr
    kmask = dks < DK
    all_rows = rows >= 0  # full-shape masks for the scratch stores
    sk = H * DK  # token stride of q, k, g
    sv = H * DV  # token stride of v
    q_base = q_ptr + (tok0 * H + h) * DK
    k_base = k_ptr + (tok0 * H + h) * DK
    g_base = g_ptr + (tok0 * H + h) * DK
    v_base = v_ptr + (tok0 * H + h) * DV
    b_base = beta_ptr + tok0 * H + h
    sc = (cid * H + h) * C  # first scratch row of this (chunk, head)
    qg_base = qg_ptr + sc * DK
    kd_base = kd_ptr + sc * DK
    w_base = w_ptr + sc * DK
    u_base = u_ptr + sc * DV
    aqk_base = aqk_ptr + sc * C
    dec_base = dec_ptr + (cid * H + h) * DK

    # In-chunk cumulative log-decay; pad rows carry g = 0, so they repeat the last real row. It is
    # parked in the qg scratch (overwritten with q * exp(gc) at the end); the loads below read rows
    # that other threads of this program wrote, hence the barrier.
    gc_base = qg_base
    g = tl.load(g_base + rows[:, None] * sk + dks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    gc = tl.cumsum(g.to(tl.float32), axis=0)
    tl.store(gc_base + rows[:, None] * DK + dks[None, :], gc, mask=all_rows[:, None] & kmask[None, :])
    tl.debug_barrier()

    tt = tl.zeros([C, C], dtype=tl.float32)  # T^T, where T = (I + A_kk)^-1 is built row by row
    for blk in range(0, C // BC):  # a run-time loop: 4x less code to compile than unrolled
        lo = blk * BC
        r16 = lo + tl.arange(0, BC)
        a_qk = tl.zeros([BC, C], dtype=tl.float32)
        a_kk = tl.zeros([BC, C], dtype=tl.float32)
        if blk > 0:
            # Columns j < lo in one product, factored through the decay at row lo: both exponents
            # are <= 0 (the other columns are masked to -inf before the exp), nothing overflows.
            # The reduction over dk runs in BK-wide column blocks (bounded registers), ascending.
            for kb in tl.static_range(DKP // BK):
                kc = kb * BK + tl.arange(0, BK)
                kcm = kc < DK
                m16 = (r16 < nr)[:, None] & kcm[None, :]
                q_b = tl.load(q_base + r16[:, None] * sk + kc[None, :], mask=m16, other=0.0).to(tl.float32) * scale
                k_b = tl.load(k_base + r16[:, None] * sk + kc[None, :], mask=m16, other=0.0).to(tl.float32)
                gc_b = tl.load(gc_base + r16[:, None] * DK + kc[None, :], mask=(r16 >= 0)[:, None] & kcm[None, :],
                               other=0.0)
                gc_r = tl.load(gc_base + lo * DK + kc, mask=kcm, other=0.0)
                k_all = tl.load(k_base + rows[:, None] * sk + kc[None, :],
                                mask=(rows < tl.minimum(nr, lo))[:, None] & kcm[None, :], other=0.0).to(tl.float32)
                gc_all = tl.load(gc_base + rows[:, None] * DK + kc[None, :], mask=all_rows[:, None] & kcm[None, :],
                                 other=0.0)
                right_t = tl.trans(k_all * tl.exp(tl.where(rows[:, None] < lo, gc_r[None, :] - gc_all, float("-inf"))))
                left = tl.exp(gc_b - gc_r[None, :])
                a_qk = tl.dot(q_b * left, right_t, acc=a_qk, input_precision=DOT_PREC)
                a_kk = tl.dot(k_b * left, right_t, acc=a_kk, input_precision=DOT_PREC)
        # Diagonal block, one column at a time: exp of masked exponent differences, reduced over dk.
        m16 = (r16 < nr)[:, None] & kmask[None, :]
        q_i = tl.load(q_base + r16[:, None] * sk + dks[None, :], mask=m16, other=0.0).to(tl.float32) * scale
        k_i = tl.load(k_base + r16[:, None] * sk + dks[None, :], mask=m16, other=0.0).to(tl.float32)
        gc_i = tl.load(gc_base + r16[:, None] * DK + dks[None, :], mask=(r16 >= 0)[:, None] & kmask[None, :],
                       other=0.0)
        # Only the chunk's real rows (rows >= nr stay exact zeros either way); a run-time trip
        # count also keeps the compiler from unrolling these loops into a register-hungry block.
        n_real = tl.minimum(tl.maximum(nr - lo, 0), BC)
        for jj in range(0, n_real):
            j = lo + jj
            k_j = tl.load(k_base + j * sk + dks, mask=kmask, other=0.0).to(tl.float32)
            gc_j = tl.load(gc_base + j * DK + dks, mask=kmask, other=0.0)
            dec = tl.exp(tl.where(r16[:, None] >= j, gc_i - gc_j[None, :], float("-inf")))
            kj_dec = k_j[None, :] * dec
            col_qk = tl.sum(q_i * kj_dec, axis=1)
            col_kk = tl.sum(k_i * kj_dec, axis=1)
            a_qk = tl.where(cols[None, :] == j, col_qk[:, None], a_qk)
            a_kk = tl.where(cols[None, :] == j, col_kk[:, None], a_kk)
        tl.store(aqk_base + r16[:, None] * C + cols[None, :], a_qk)
        b_i = tl.load(b_base + r16 * H, mask=r16 < nr, other=0.0).to(tl.float32)
        a_kk = tl.where(cols[None, :] < r16[:, None], a_kk, 0.0) * b_i[:, None]
        # Forward substitution for this block's rows of T (row i reads rows < i of T only).
        for ii in range(0, n_real):
            i = lo + ii
            a_row = tl.sum(tl.where(r16[:, None] == i, a_kk, 0.0), axis=0)  # A_kk[i, :], exact
            t_row = -tl.sum(tt * a_row[None, :], axis=1)  # T[i, c] for every c
            t_row = tl.where(rows == i, 1.0, t_row)
            tt = tl.where(cols[None, :] == i, t_row[:, None], tt)

    # W = T diag(beta) exp(gc) K, U = T diag(beta) V and the recurrence factors, BK / BVI columns at
    # a time (columns are independent: the blocking changes no arithmetic, only the registers held).
    t_mat = tl.trans(tt)
    b_all = tl.load(b_base + rows * H, mask=rmask, other=0.0).to(tl.float32)
    for vb in range(0, DVP // BVI):
        vc = vb * BVI + tl.arange(0, BVI)
        vcm = vc < DV
        v_t = tl.load(v_base + rows[:, None] * sv + vc[None, :], mask=rmask[:, None] & vcm[None, :],
                      other=0.0).to(tl.float32)
        u = tl.dot(t_mat, v_t * b_all[:, None], input_precision=DOT_PREC)
        tl.store(u_base + rows[:, None] * DV + vc[None, :], u, mask=all_rows[:, None] & vcm[None, :])
    for kb in range(0, DKP // BK):
        kt_c = kb * BK + tl.arange(0, BK)
        kt_cm = kt_c < DK
        in_t = rows[:, None] * sk + kt_c[None, :]
        sc_t = rows[:, None] * DK + kt_c[None, :]
        m_t = rmask[:, None] & kt_cm[None, :]
        sm_t = all_rows[:, None] & kt_cm[None, :]
        k_t = tl.load(k_base + in_t, mask=m_t, other=0.0).to(tl.float32)
        gc_t = tl.load(gc_base + sc_t, mask=sm_t, other=0.0)
        g_last = tl.load(gc_base + (C - 1) * DK + kt_c, mask=kt_cm, other=0.0)
        w = tl.dot(t_mat, k_t * tl.exp(gc_t) * b_all[:, None], input_precision=DOT_PREC)
        tl.store(w_base + sc_t, w, mask=sm_t)
        # The state-independent factors of the recurrence, so that the sequential kernel runs no
        # exp: kd = exp(g_last - gc) * K (state update), qg = scale * q * exp(gc) (read-out).
        tl.store(kd_base + sc_t, k_t * tl.exp(g_last[None, :] - gc_t), mask=sm_t)
        tl.store(dec_base + kt_c, tl.exp(g_last), mask=kt_cm)
        qg = tl.load(q_base + in_t, mask=m_t, other=0.0).to(tl.float32) * scale * tl.exp(gc_t)
        tl.debug_barrier()  # every thread is done reading these gc columns before qg overwrites them
        tl.store(qg_base + sc_t, qg, mask=sm_t)


@triton.jit
def _kda_inter_kernel(
    qg_ptr, kd_ptr, aqk_ptr, w_ptr, u_ptr, dec_ptr,  # scratch written by _kda_intra_kernel
    h0_ptr, o_ptr, ht_ptr, cs_ptr,  # [N, H, dk, dv] in, [T, H, dv] out, [N, H, dk, dv], [NCC, H, dk, dv]
    seq_tok0_ptr, seq_len_ptr,  # [N] first token and number of tokens of each sequence
    seq_chunk0_ptr, seq_complete0_ptr,  # [N] first chunk / complete chunk ids
    H,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_H0: tl.constexpr, STORE_CS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # The state [dk, BV] is held as one or two [BK, BV] row blocks (TWO: dk > BK) so that no
    # [64, dk] fp32 tile has to sit in registers whole; products over dk run block 0 then block 1.
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    # Start and length as separate tables (not cu_seqlens): the decode step's sequences sit at fixed
    # 64-row slots (start 64 i, length num_rows[i]), with gaps between them.
    bos = tl.load(seq_tok0_ptr + s).to(tl.int64)
    n = tl.load(seq_len_ptr + s).to(tl.int64)
    n_chunks = ((n + C - 1) // C).to(tl.int32)
    chunk0 = tl.load(seq_chunk0_ptr + s).to(tl.int64)
    comp0 = tl.load(seq_complete0_ptr + s).to(tl.int64)
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    k0 = tl.arange(0, BK)
    k1 = BK + tl.arange(0, BK)
    vs = vb * BV + tl.arange(0, BV)
    k0m = k0 < DK
    k1m = k1 < DK
    vmask = vs < DV
    st_base = (s * H + h).to(tl.int64) * DK
    st0 = (st_base + k0[:, None]) * DV + vs[None, :]
    st1 = (st_base + k1[:, None]) * DV + vs[None, :]
    st0m = k0m[:, None] & vmask[None, :]
    st1m = k1m[:, None] & vmask[None, :]
    if HAS_H0:
        s0 = tl.load(h0_ptr + st0, mask=st0m, other=0.0).to(tl.float32)
    else:
        s0 = tl.zeros([BK, BV], dtype=tl.float32)
    if TWO:
        if HAS_H0:
            s1 = tl.load(h0_ptr + st1, mask=st1m, other=0.0).to(tl.float32)
        else:
            s1 = tl.zeros([BK, BV], dtype=tl.float32)
    sc0m = (rows >= 0)[:, None] & k0m[None, :]
    sc1m = (rows >= 0)[:, None] & k1m[None, :]
    for c in range(0, n_chunks):
        cid = chunk0 + c
        tok0 = bos + c * C
        nr = tl.minimum(n - c * C, C)
        sc_base = (cid * H + h) * C
        sc0 = (sc_base + rows[:, None]) * DK + k0[None, :]
        sc1 = (sc_base + rows[:, None]) * DK + k1[None, :]
        u = tl.load(u_ptr + (sc_base + rows[:, None]) * DV + vs[None, :],
                    mask=(rows >= 0)[:, None] & vmask[None, :], other=0.0)
        ws = tl.dot(tl.load(w_ptr + sc0, mask=sc0m, other=0.0), s0, input_precision=DOT_PREC)
        if TWO:
            ws = tl.dot(tl.load(w_ptr + sc1, mask=sc1m, other=0.0), s1, acc=ws, input_precision=DOT_PREC)
        v_e = u - ws
        o = tl.dot(tl.load(qg_ptr + sc0, mask=sc0m, other=0.0), s0, input_precision=DOT_PREC)
        if TWO:
            o = tl.dot(tl.load(qg_ptr + sc1, mask=sc1m, other=0.0), s1, acc=o, input_precision=DOT_PREC)
        a_qk = tl.load(aqk_ptr + (sc_base + rows[:, None]) * C + cols[None, :])
        o = o + tl.dot(a_qk, v_e, input_precision=DOT_PREC)
        o_off = ((tok0 + rows[:, None]) * H + h) * DV + vs[None, :]
        tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=(rows < nr)[:, None] & vmask[None, :])
        if nr == C:  # only complete chunks advance the state
            dec_base = (cid * H + h) * DK
            kd0 = tl.load(kd_ptr + sc0, mask=sc0m, other=0.0)
            dec0 = tl.load(dec_ptr + dec_base + k0, mask=k0m, other=0.0)
            s0 = dec0[:, None] * s0 + tl.dot(tl.trans(kd0), v_e, input_precision=DOT_PREC)
            cs_base = ((comp0 + c) * H + h) * DK
            if STORE_CS:
                tl.store(cs_ptr + (cs_base + k0[:, None]) * DV + vs[None, :], s0, mask=st0m)
            if TWO:
                kd1 = tl.load(kd_ptr + sc1, mask=sc1m, other=0.0)
                dec1 = tl.load(dec_ptr + dec_base + k1, mask=k1m, other=0.0)
                s1 = dec1[:, None] * s1 + tl.dot(tl.trans(kd1), v_e, input_precision=DOT_PREC)
                if STORE_CS:
                    tl.store(cs_ptr + (cs_base + k1[:, None]) * DV + vs[None, :], s1, mask=st1m)
    tl.store(ht_ptr + st0, s0, mask=st0m)
    if TWO:
        tl.store(ht_ptr + st1, s1, mask=st1m)


# --------------------------------------------------------------------------------------- host side


@dataclass
class _ChunkTables:
    """Per-chunk and per-sequence index tables (int32, on the compute device)."""

    chunk_tok: torch.Tensor  # [NC] first token of each chunk
    chunk_rows: torch.Tensor  # [NC] real rows of each chunk (1..64)
    seq_chunk0: torch.Tensor  # [N] id of each sequence's first chunk
    seq_complete0: torch.Tensor  # [N] id of each sequence's first complete chunk
    seq_tok0: torch.Tensor  # [N] first token of each sequence
    seq_len: torch.Tensor  # [N] tokens of each sequence
    n_chunks: int
    n_complete: int


def _tables(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> _ChunkTables:
    c = CHUNK_SIZE
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if not cu or cu[0] != 0 or cu[-1] != total or any(n < 0 for n in lens):
        raise ValueError(f"kda_chunk: cu_seqlens {cu} does not describe {total} packed tokens")
    chunk_tok, chunk_rows, seq_chunk0, seq_complete0 = [], [], [], []
    acc_c = 0
    for a, n in zip(cu[:-1], lens):
        seq_chunk0.append(len(chunk_tok))
        seq_complete0.append(acc_c)
        acc_c += n // c
        for start in range(0, n, c):
            chunk_tok.append(a + start)
            chunk_rows.append(min(c, n - start))
    if total >= 2**31:
        raise ValueError("kda_chunk (triton): more than 2^31 tokens")

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)

    cu_d = dev(cu)
    return _ChunkTables(dev(chunk_tok), dev(chunk_rows), dev(seq_chunk0), dev(seq_complete0), cu_d[:-1],
                        cu_d[1:] - cu_d[:-1], len(chunk_tok), acc_c)


def _pow2(n: int) -> int:
    return max(16, next_pow2(n))  # tl.dot needs every dim >= 16


def _launch_config(dk: int, dv: int) -> dict[str, int]:
    """Tile sizes and warps from the head dims only (never from T, N or the chunk count)."""
    dkp, dvp = _pow2(dk), _pow2(dv)
    big = dkp >= 128 or dvp >= 128
    # Warps and BV were picked by register spills of the sm_90 build (ptxas -v, Triton 3.9): both
    # kernels sit at the 255-register cap; these choices spill least at dk = dv = 64 and 128.
    # The recurrence holds the state as one or two [BK, BV] row blocks (dk <= 128: blocks of <= 64).
    bk_state = dkp if dkp <= 64 else max(64, dkp // 2)
    return {
        "DKP": dkp,
        "DVP": dvp,
        "BK": min(dkp, 64),  # column block of the intra kernel's dk loops
        "BVI": min(dvp, 64),  # column block of U
        "BK_STATE": bk_state,
        "TWO": dkp > bk_state,
        # State tile [dk, BV]: a small BV keeps it in registers and gives more programs.
        "BV": min(dvp, 32),
        "intra_warps": 8 if big or dkp >= 64 else 4,
        "inter_warps": 8 if big else 4,
    }


def kda_chunk_triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_chunk_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The Triton forward (no autograd); see ``kda_chunk`` for shapes and semantics."""
    if q.dtype == torch.float64:  # gradcheck: the fp64 torch composition is the reference
        return kda_chunk.impls["torch"](q, k, v, g, beta, cu_seqlens, initial_state, scale, output_chunk_states)
    t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:2] != (t, h) or beta.shape != (t, h):
        raise ValueError(f"kda_chunk: bad shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"g{tuple(g.shape)} beta{tuple(beta.shape)}")
    n = cu_seqlens.numel() - 1
    dev = q.device
    scale = dk**-0.5 if scale is None else float(scale)
    tab = _tables(cu_seqlens, t, dev)
    if initial_state is not None and initial_state.shape != (n, h, dk, dv):
        raise ValueError(f"kda_chunk: initial_state {tuple(initial_state.shape)} != {(n, h, dk, dv)}")
    final = torch.empty(n, h, dk, dv, dtype=torch.float32, device=dev)
    o = torch.empty(t, h, dv, dtype=v.dtype, device=dev)
    chunk_states = (torch.empty(tab.n_complete, h, dk, dv, dtype=torch.float32, device=dev)
                    if output_chunk_states else None)
    if tab.n_chunks == 0:
        if initial_state is None:
            final.zero_()
        else:
            final.copy_(initial_state)
        return o, final, chunk_states
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    _launch(q, k, v, g, beta, tab, h0, o, final, chunk_states, scale)
    return o, final, chunk_states


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            tab: _ChunkTables, h0: torch.Tensor | None, o: torch.Tensor, final: torch.Tensor,
            chunk_states: torch.Tensor | None, scale: float) -> None:
    """Both kernels over the chunks and sequences of ``tab`` (packed contiguous [T, H, d] inputs, fp32
    contiguous ``h0``); writes ``o`` (rows of real tokens only), ``final`` and ``chunk_states``. The
    grid and every launch parameter come from host shapes (N, chunk count, H, dk, dv) only."""
    h, dk = q.shape[1], q.shape[2]
    dv = v.shape[-1]
    n = final.shape[0]
    dev = q.device
    cfg = _launch_config(dk, dv)
    c = CHUNK_SIZE
    nc = tab.n_chunks
    qg = torch.empty(nc, h, c, dk, dtype=torch.float32, device=dev)
    kd = torch.empty(nc, h, c, dk, dtype=torch.float32, device=dev)
    a_qk = torch.empty(nc, h, c, c, dtype=torch.float32, device=dev)
    w = torch.empty(nc, h, c, dk, dtype=torch.float32, device=dev)
    u = torch.empty(nc, h, c, dv, dtype=torch.float32, device=dev)
    dec = torch.empty(nc, h, dk, dtype=torch.float32, device=dev)
    _kda_intra_kernel[(nc, h)](
        q, k, v, g, beta, tab.chunk_tok, tab.chunk_rows, qg, kd, a_qk, w, u, dec, scale, h,
        DK=dk, DV=dv, DKP=cfg["DKP"], DVP=cfg["DVP"], BK=cfg["BK"], BVI=cfg["BVI"], C=c, BC=_SUB,
        DOT_PREC=DOT_PRECISION, num_warps=cfg["intra_warps"], num_stages=1,
    )
    _kda_inter_kernel[(n, h, cdiv(dv, cfg["BV"]))](
        qg, kd, a_qk, w, u, dec,
        h0 if h0 is not None else final, o, final, chunk_states if chunk_states is not None else final,
        tab.seq_tok0, tab.seq_len, tab.seq_chunk0, tab.seq_complete0, h,
        DK=dk, DV=dv, BK=cfg["BK_STATE"], TWO=cfg["TWO"], BV=cfg["BV"], C=c, HAS_H0=h0 is not None,
        STORE_CS=chunk_states is not None, DOT_PREC=DOT_PRECISION,
        num_warps=cfg["inter_warps"], num_stages=1,
    )


@kda_chunk.register("triton")
@with_fla_backward(kda_chunk.impls["torch"])
def kda_chunk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_chunk_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``kda_chunk`` on the GPU: Triton forward, fla-core backward (``kda_chunk_bwd.py``)."""
    return kda_chunk_triton_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_chunk_states)


@kda_chunk_step.register("triton")
def kda_chunk_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_rows: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_chunk_step`` on the GPU (see its docstring; no autograd). CUDA-graph capturable: no host
    reads of device values, every table built on the device, the grid from N, H, dk, dv only."""
    n, h, dk, dv = _check_step_args(q, k, v, g, beta, num_rows, state)
    if q.dtype == torch.float64:  # the kernels are fp32; fp64 only comes from reference checks
        return kda_chunk_step.impls["torch"](q, k, v, g, beta, num_rows, state, scale)
    c = CHUNK_SIZE
    dev = q.device
    scale = dk**-0.5 if scale is None else float(scale)
    if n * c >= 2**31:
        raise ValueError("kda_chunk_step (triton): more than 2^31 rows")
    o = torch.zeros(n, c, h, dv, dtype=v.dtype, device=dev)  # the kernel writes rows < num_rows only
    final = torch.empty(n, h, dk, dv, dtype=torch.float32, device=dev)
    if n == 0:
        return o, final
    # Out-of-range counts would make the kernels read/write a neighbour's slot (or beyond the last);
    # clamping on the device costs no sync.
    rows = num_rows.clamp(0, c).to(torch.int32)
    seq = torch.arange(n, dtype=torch.int32, device=dev)
    tok0 = seq * c
    # n_chunks / n_complete only size the scratch (N chunks) and the unused chunk-state output.
    tab = _ChunkTables(chunk_tok=tok0, chunk_rows=rows, seq_chunk0=seq, seq_complete0=seq, seq_tok0=tok0,
                       seq_len=rows, n_chunks=n, n_complete=0)
    q2, k2, g2 = (x.reshape(n * c, h, dk).contiguous() for x in (q, k, g))
    v2 = v.reshape(n * c, h, dv).contiguous()
    b2 = beta.reshape(n * c, h).contiguous()
    h0 = state.to(torch.float32).contiguous()
    _launch(q2, k2, v2, g2, b2, tab, h0, o.view(n * c, h, dv), final, None, scale)
    return o, final
