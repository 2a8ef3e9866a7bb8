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

Dots run on fp32 operands with ``input_precision`` = the process's ``Numerics.kda_dot_precision``
(zmrl/kernels_batch_invariant/numerics.py; ``ZMRL_KDA_DOT_PRECISION`` sets its default): "tf32x3" (default:
three TF32 tensor-core passes, fp32-level accuracy, ~1e-6 relative), "ieee" (fp32 FMA, slowest) or
"tf32" (one pass, fastest, ~1e-3 relative: still 8x finer than the bf16 operands fla-core uses).
The precision changes the bits but not the invariance: it is a compile-time constant of the kernel,
read from the applied numerics contract at every launch; the rollout and trainer processes compare
their contracts (``numerics.fingerprint``) before the first step.

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..kda.chunk import CHUNK_SIZE, _check_step_args, kda_chunk, kda_chunk_step, packed_lengths
from ..kda.decode import KDADecodeCache, check_cache_form, check_decode_args, kda_decode_prime, kda_decode_step
from ..numerics import kda_dot_precision, kda_form
from ._common import await_previous_kernel, cdiv, next_pow2, pdl
from .kda_chunk_bwd import with_fla_backward
from .kda_recurrent import (recurrent_chunk_step, recurrent_decode_prime, recurrent_decode_step, recurrent_forward,
                            rows_in_place, stage_new_row)

_SUB = 16  # sub-block rows of the intra-chunk A products (the off-diagonal factorisation)


# --------------------------------------------------------------------------------------- kernels
# Addressing: every tile address is a scalar base pointer (int64 arithmetic, once per tile) plus
# int32 in-tile offsets; int64 offset tiles would cost two registers per element.


@triton.jit
def _kda_intra_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # [T, H, d] / [T, H] inputs (q addressed through QTOK)
    info_ptr,  # [NC, 6] int32 chunk table: TOK, ROWS, QTOK, ROW0, OUT0, KEEP (see _chunk_info)
    qg_ptr, kd_ptr, aqk_ptr, w_ptr, u_ptr,  # fp32 scratch [NC, H, 64, dk | dk | 64 | dk | dv]
    dec_ptr,  # fp32 scratch [NC, H, dk]: exp(gc of row 63), the state decay of a complete chunk
    tt_ptr,  # fp32 [*, H, 64, 64] at KEEP: T^T, the solved rows of T = (I + A_kk)^-1 (read for rows < ROW0)
    scale, H,
    DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BK: tl.constexpr,
    BVI: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr, DECODE: tl.constexpr = False,
):
    # DECODE: every chunk of the launch solves exactly one new row, its last (ROW0 == OUT0 == ROWS - 1, the
    # decode step's contract); the row's values are computed as in the general path, see the diagonal block.
    await_previous_kernel()
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    info = info_ptr + cid * 6
    tok0 = tl.load(info + 0).to(tl.int64)
    nr = tl.load(info + 1)
    qtok0 = tl.load(info + 2).to(tl.int64)
    row0 = tl.load(info + 3)  # rows < row0 of T are already solved (held at KEEP)
    out0 = tl.load(info + 4)  # rows < out0 have no query (their outputs are not wanted)
    keep = tl.load(info + 5).to(tl.int64)
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    dks = tl.arange(0, DKP)
    rmask = rows < nr
    kmask = dks < DK
    all_rows = rows >= 0  # full-shape masks for the scratch loads
    new_rows = rows >= row0  # the rows this call solves and stores
    if DECODE:
        new_rows = new_rows & (rows < nr)  # the one new row (the rows past it hold nothing to keep)
    sk = H * DK  # token stride of q, k, g
    sv = H * DV  # token stride of v
    q_base = q_ptr + (qtok0 * H + h) * DK
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
    tt_base = tt_ptr + (keep * H + h) * C * C

    # In-chunk cumulative log-decay; pad rows carry g = 0, so they repeat the last real row. It is
    # parked in the qg scratch (overwritten with q * exp(gc) at the end); the loads below read rows
    # that other threads of this program wrote, hence the barrier.
    gc_base = qg_base
    g = tl.load(g_base + rows[:, None] * sk + dks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    gc = tl.cumsum(g.to(tl.float32), axis=0)
    tl.store(gc_base + rows[:, None] * DK + dks[None, :], gc, mask=all_rows[:, None] & kmask[None, :])
    tl.debug_barrier()

    # T^T, built column by column (column i = row i of T); the columns < row0 were solved by an earlier
    # call on the same chunk (decode) and are read back, the rest start at zero.
    tt = tl.load(tt_base + rows[:, None] * C + cols[None, :], mask=all_rows[:, None] & (cols < row0)[None, :],
                 other=0.0)
    # Blocks before row0's block hold no unsolved row; blocks from nr's on hold no real row.
    for blk in range(row0 // BC, (nr + BC - 1) // BC):  # a run-time loop: 4x less code than unrolled
        lo = blk * BC
        r16 = lo + tl.arange(0, BC)
        qrow = (r16 < nr) & (r16 >= out0)
        a_qk = tl.zeros([BC, C], dtype=tl.float32)
        a_kk = tl.zeros([BC, C], dtype=tl.float32)
        if blk > 0:
            # Columns j < lo in one product, factored through the decay at row lo: both exponents
            # are <= 0 (the other columns are masked to -inf before the exp), nothing overflows.
            # The reduction over dk runs in BK-wide column blocks (bounded registers), ascending.
            for kb in tl.static_range(DKP // BK):
                kc = kb * BK + tl.arange(0, BK)
                kcm = kc < DK
                q_b = tl.load(q_base + r16[:, None] * sk + kc[None, :], mask=qrow[:, None] & kcm[None, :],
                              other=0.0).to(tl.float32) * scale
                k_b = tl.load(k_base + r16[:, None] * sk + kc[None, :], mask=(r16 < nr)[:, None] & kcm[None, :],
                              other=0.0).to(tl.float32)
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
        # Only the chunk's real rows (rows >= nr stay exact zeros either way); a run-time trip
        # count also keeps the compiler from unrolling these loops into a register-hungry block.
        n_real = tl.minimum(tl.maximum(nr - lo, 0), BC)
        if DECODE:
            # Only row r = nr - 1 is new: all its diagonal columns j in one [16, dk] tile whose row j - lo
            # holds what the loop's column j holds in row r, q_r * (k_j * exp(gc_r - gc_j)), the same
            # elementwise ops on the same values; one reduction over dk (same tile shape and layout, and
            # a blocked layout reduces every row along the same tree) instead of n_real of them.
            r_new = nr - 1
            jm = r16 <= r_new
            q_r = tl.load(q_base + r_new * sk + dks, mask=kmask, other=0.0).to(tl.float32) * scale
            k_r = tl.load(k_base + r_new * sk + dks, mask=kmask, other=0.0).to(tl.float32)
            gc_rr = tl.load(gc_base + r_new * DK + dks, mask=kmask, other=0.0)
            k_js = tl.load(k_base + r16[:, None] * sk + dks[None, :], mask=jm[:, None] & kmask[None, :],
                           other=0.0).to(tl.float32)
            gc_js = tl.load(gc_base + r16[:, None] * DK + dks[None, :], mask=(r16 >= 0)[:, None] & kmask[None, :],
                            other=0.0)
            kj_dec = k_js * tl.exp(tl.where(jm[:, None], gc_rr[None, :] - gc_js, float("-inf")))
            col_qk = tl.sum(q_r[None, :] * kj_dec, axis=1)  # [16]: column lo + jj of row r
            col_kk = tl.sum(k_r[None, :] * kj_dec, axis=1)
            # Spread over the row's columns exactly: one value per column, -0.0 elsewhere (x + -0.0 == x).
            at_col = cols[None, :] == r16[:, None]
            row_qk = tl.sum(tl.where(at_col, col_qk[:, None], -0.0), axis=0)
            row_kk = tl.sum(tl.where(at_col, col_kk[:, None], -0.0), axis=0)
            diag = (r16[:, None] == r_new) & (cols[None, :] >= lo) & (cols[None, :] <= r_new)
            a_qk = tl.where(diag, row_qk[None, :], a_qk)
            a_kk = tl.where(diag, row_kk[None, :], a_kk)
        else:
            m16 = (r16 < nr)[:, None] & kmask[None, :]
            q_i = tl.load(q_base + r16[:, None] * sk + dks[None, :], mask=qrow[:, None] & kmask[None, :],
                          other=0.0).to(tl.float32) * scale
            k_i = tl.load(k_base + r16[:, None] * sk + dks[None, :], mask=m16, other=0.0).to(tl.float32)
            gc_i = tl.load(gc_base + r16[:, None] * DK + dks[None, :], mask=(r16 >= 0)[:, None] & kmask[None, :],
                           other=0.0)
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
        # Forward substitution for this block's unsolved rows of T (row i reads rows < i of T only).
        for ii in range(tl.maximum(row0 - lo, 0), n_real):
            i = lo + ii
            a_row = tl.sum(tl.where(r16[:, None] == i, a_kk, 0.0), axis=0)  # A_kk[i, :], exact
            t_row = -tl.sum(tt * a_row[None, :], axis=1)  # T[i, c] for every c
            t_row = tl.where(rows == i, 1.0, t_row)
            tt = tl.where(cols[None, :] == i, t_row[:, None], tt)
    tl.store(tt_base + rows[:, None] * C + cols[None, :], tt, mask=all_rows[:, None] & new_rows[None, :])

    # W = T diag(beta) exp(gc) K, U = T diag(beta) V and the recurrence factors, BK / BVI columns at
    # a time (columns are independent: the blocking changes no arithmetic, only the registers held).
    # W and U are computed for the 16-row blocks holding rows >= row0 only, as [16, 64] @ [64, cols]
    # products whose left rows are T's rows read back from the tt buffer (an MMA computes each output
    # row from its own left row: row i's bits do not depend on the block height, which the decode
    # kernels rely on too); only rows >= row0 are stored (the recurrence reads the earlier ones from
    # the v_e it kept), except kd (elementwise), which a complete chunk's state update needs for every row.
    tl.debug_barrier()  # the tt columns stored above are read back below by other threads
    kd_row0 = tl.where(nr == C, 0, row0)
    if DECODE:
        kd_row0 = tl.where(nr == C, 0, C)  # the decode recurrence reads kd only to close a complete chunk
    blk0 = row0 // BC
    blk1 = (nr + BC - 1) // BC
    b_all = tl.load(b_base + rows * H, mask=rmask, other=0.0).to(tl.float32)
    for vb in range(0, DVP // BVI):
        vc = vb * BVI + tl.arange(0, BVI)
        vcm = vc < DV
        v_t = tl.load(v_base + rows[:, None] * sv + vc[None, :], mask=rmask[:, None] & vcm[None, :],
                      other=0.0).to(tl.float32)
        x_v = v_t * b_all[:, None]
        for blk in range(blk0, blk1):
            r16 = blk * BC + tl.arange(0, BC)
            t_b = tl.load(tt_base + cols[None, :] * C + r16[:, None])  # rows r16 of T
            u = tl.dot(t_b, x_v, input_precision=DOT_PREC)
            tl.store(u_base + r16[:, None] * DV + vc[None, :], u, mask=(r16 >= row0)[:, None] & vcm[None, :])
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
        x_k = k_t * tl.exp(gc_t) * b_all[:, None]
        for blk in range(blk0, blk1):
            r16 = blk * BC + tl.arange(0, BC)
            t_b = tl.load(tt_base + cols[None, :] * C + r16[:, None])
            w = tl.dot(t_b, x_k, input_precision=DOT_PREC)
            tl.store(w_base + r16[:, None] * DK + kt_c[None, :], w, mask=(r16 >= row0)[:, None] & kt_cm[None, :])
        # The state-independent factors of the recurrence, so that the sequential kernel runs no
        # exp: kd = exp(g_last - gc) * K (state update), qg = scale * q * exp(gc) (read-out).
        tl.store(kd_base + sc_t, k_t * tl.exp(g_last[None, :] - gc_t), mask=(rows >= kd_row0)[:, None] & kt_cm[None, :])
        tl.store(dec_base + kt_c, tl.exp(g_last), mask=kt_cm)
        qg = tl.load(q_base + in_t, mask=(rmask & (rows >= out0))[:, None] & kt_cm[None, :],
                     other=0.0).to(tl.float32) * scale * tl.exp(gc_t)
        tl.debug_barrier()  # every thread is done reading these gc columns before qg overwrites them
        tl.store(qg_base + sc_t, qg, mask=new_rows[:, None] & kt_cm[None, :])


@triton.jit
def _kda_inter_kernel(
    qg_ptr, kd_ptr, aqk_ptr, w_ptr, u_ptr, dec_ptr,  # scratch written by _kda_intra_kernel
    ve_ptr,  # fp32 [*, H, 64, dv] at KEEP: v_e = U - W S of each chunk row (read for rows < ROW0)
    h0_ptr, o_ptr, ht_ptr, cs_ptr,  # states [*, H, dk, dv] at STATE in and out, o [T, H, dv], [NCC, H, dk, dv]
    cinfo_ptr, sinfo_ptr,  # [NC, 6] chunk table (as the intra kernel), [N, 6] sequence table (_seq_info)
    H,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_H0: tl.constexpr, STORE_CS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # The state [dk, BV] is held as one or two [BK, BV] row blocks (TWO: dk > BK) so that no
    # [64, dk] fp32 tile has to sit in registers whole; products over dk run block 0 then block 1.
    await_previous_kernel()
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    sinfo = sinfo_ptr + s.to(tl.int64) * 6
    # Output rows, lengths, chunk ids and state rows come from tables (not cu_seqlens): the decode
    # step's sequences read their chunks from cache slots and write one output row each.
    bos = tl.load(sinfo + 0).to(tl.int64)
    n = tl.load(sinfo + 1).to(tl.int64)
    n_chunks = ((n + C - 1) // C).to(tl.int32)
    chunk0 = tl.load(sinfo + 2).to(tl.int64)
    comp0 = tl.load(sinfo + 3).to(tl.int64)
    st_row = tl.load(sinfo + 4).to(tl.int64)
    always_store = tl.load(sinfo + 5) != 0
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    k0 = tl.arange(0, BK)
    k1 = BK + tl.arange(0, BK)
    vs = vb * BV + tl.arange(0, BV)
    k0m = k0 < DK
    k1m = k1 < DK
    vmask = vs < DV
    st_base = (st_row * H + h) * DK
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
    for c in range(0, n_chunks):
        cid = chunk0 + c
        cinfo = cinfo_ptr + cid * 6
        row0 = tl.load(cinfo + 3)
        out0 = tl.load(cinfo + 4)
        keep = tl.load(cinfo + 5).to(tl.int64)
        tok0 = bos + c * C
        nr = tl.minimum(n - c * C, C)
        new = (rows >= row0) & (rows < nr)  # W / U rows past the chunk's end are not written: read as 0
        qrow = rows >= out0
        sc_base = (cid * H + h) * C
        sc0 = (sc_base + rows[:, None]) * DK + k0[None, :]
        sc1 = (sc_base + rows[:, None]) * DK + k1[None, :]
        u = tl.load(u_ptr + (sc_base + rows[:, None]) * DV + vs[None, :], mask=new[:, None] & vmask[None, :], other=0.0)
        ws = tl.dot(tl.load(w_ptr + sc0, mask=new[:, None] & k0m[None, :], other=0.0), s0, input_precision=DOT_PREC)
        if TWO:
            ws = tl.dot(tl.load(w_ptr + sc1, mask=new[:, None] & k1m[None, :], other=0.0), s1, acc=ws,
                        input_precision=DOT_PREC)
        # v_e of the rows solved by an earlier call on this chunk (the same values, computed then).
        ve_off = ((keep * H + h) * C + rows[:, None]) * DV + vs[None, :]
        ve_old = tl.load(ve_ptr + ve_off, mask=(rows < row0)[:, None] & vmask[None, :], other=0.0)
        v_e = tl.where(new[:, None], u - ws, ve_old)
        tl.store(ve_ptr + ve_off, v_e, mask=(new & (rows < nr))[:, None] & vmask[None, :])
        o = tl.dot(tl.load(qg_ptr + sc0, mask=qrow[:, None] & k0m[None, :], other=0.0), s0, input_precision=DOT_PREC)
        if TWO:
            o = tl.dot(tl.load(qg_ptr + sc1, mask=qrow[:, None] & k1m[None, :], other=0.0), s1, acc=o,
                       input_precision=DOT_PREC)
        a_qk = tl.load(aqk_ptr + (sc_base + rows[:, None]) * C + cols[None, :],
                       mask=(qrow & (rows < nr))[:, None] & (cols >= 0)[None, :], other=0.0)
        o = o + tl.dot(a_qk, v_e, input_precision=DOT_PREC)
        o_off = ((tok0 + rows[:, None]) * H + h) * DV + vs[None, :]
        tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=(qrow & (rows < nr))[:, None] & vmask[None, :])
        if nr == C:  # only complete chunks advance the state
            sc0m = (rows >= 0)[:, None] & k0m[None, :]
            dec_base = (cid * H + h) * DK
            kd0 = tl.load(kd_ptr + sc0, mask=sc0m, other=0.0)
            dec0 = tl.load(dec_ptr + dec_base + k0, mask=k0m, other=0.0)
            s0 = dec0[:, None] * s0 + tl.dot(tl.trans(kd0), v_e, input_precision=DOT_PREC)
            cs_base = ((comp0 + c) * H + h) * DK
            if STORE_CS:
                tl.store(cs_ptr + (cs_base + k0[:, None]) * DV + vs[None, :], s0, mask=st0m)
            if TWO:
                sc1m = (rows >= 0)[:, None] & k1m[None, :]
                kd1 = tl.load(kd_ptr + sc1, mask=sc1m, other=0.0)
                dec1 = tl.load(dec_ptr + dec_base + k1, mask=k1m, other=0.0)
                s1 = dec1[:, None] * s1 + tl.dot(tl.trans(kd1), v_e, input_precision=DOT_PREC)
                if STORE_CS:
                    tl.store(cs_ptr + (cs_base + k1[:, None]) * DV + vs[None, :], s1, mask=st1m)
    # A decode step whose chunk stays partial leaves its state as it was: no write.
    if always_store | (n >= C):
        tl.store(ht_ptr + st0, s0, mask=st0m)
        if TWO:
            tl.store(ht_ptr + st1, s1, mask=st1m)


# --------------------------------------------------------------------------------------- host side
# Both kernels read their work from int32 tables, one row per chunk and one per sequence, so that the
# prefill/trainer path (chunks of packed sequences) and the decode step (one row of a cached chunk per
# sequence) run the same compiled kernels:
#   chunk table [NC, 6]: TOK (token of the chunk's row 0 in k/v/g/beta), ROWS (real rows), QTOK (token
#     of row 0 in q), ROW0 (first row to solve: earlier rows of T and v_e are read back from KEEP), OUT0
#     (first row with a query / an output), KEEP (row of the tt / v_e buffers);
#   sequence table [N, 6]: OTOK (output token of row 0 of the first chunk), LEN (tokens), CHUNK0 (first
#     chunk id), COMPLETE0 (first complete-chunk id), STATE (row of the state buffers), FLAGS (1: always
#     write the final state; 0: only when a chunk completed).
_INFO_COLS = 6


@dataclass
class _Tables:
    chunk_info: torch.Tensor  # [NC, 6] int32, on the compute device
    seq_info: torch.Tensor  # [N, 6] int32
    n_chunks: int
    n_complete: int


def _tables(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> _Tables:
    """Tables of the packed varlen path: every chunk solved from its row 0, outputs for every row."""
    c = CHUNK_SIZE
    cu, lens = packed_lengths(cu_seqlens, total)
    if total >= 2**31:
        raise ValueError("kda_chunk (triton): more than 2^31 tokens")
    chunks: list[int] = []
    seqs: list[int] = []
    n_complete = 0
    for s, (a, n) in enumerate(zip(cu[:-1], lens)):
        seqs += [a, n, len(chunks) // _INFO_COLS, n_complete, s, 1]
        n_complete += n // c
        for start in range(0, n, c):
            cid = len(chunks) // _INFO_COLS
            chunks += [a + start, min(c, n - start), a + start, 0, 0, cid]
    info = torch.tensor(chunks + seqs, dtype=torch.int32).to(device, non_blocking=True)
    nc = len(chunks) // _INFO_COLS
    return _Tables(info[: len(chunks)].view(nc, _INFO_COLS), info[len(chunks):].view(-1, _INFO_COLS), nc, n_complete)


def _pow2(n: int) -> int:
    return max(16, next_pow2(n))  # tl.dot needs every dim >= 16


def _launch_config(dk: int, dv: int) -> dict[str, int]:
    """Tile sizes and warps from the head dims only (never from T, N or the chunk count)."""
    dkp, dvp = _pow2(dk), _pow2(dv)
    big = dkp >= 128 or dvp >= 128
    # The recurrence's warps and BV were first picked by the register spills of the sm_90 build (Triton 3.9;
    # benchmarks/kernel_resources.py reports registers and spills): both kernels sit at the 255-register cap.
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
        # The intra kernel's warps are shared numerics (its reductions' layouts follow them): prefill, trainer and
        # decode change bits together. At dk = dv = 128, 4 warps spill more than 8 but run faster on the H200:
        # decode step at batch 256 1073 -> 861 us, chunk forward at 16K tokens 6.43 -> 5.90 ms, decoded rows
        # still kda_chunk's (benchmarks/kda_decode_vs_fla.py --sweep,
        # benchmarks/results/2026-12-01_kda_decode_sweep_5e4be1c_h200.json). Other head dims are not measured
        # at 4 warps and keep the earlier rule.
        "intra_warps": 4 if (dkp, dvp) == (128, 128) else 8 if big or dkp >= 64 else 4,
        "inter_warps": 8 if big else 4,
        # the decode step's new-row recurrence (16-row products, one [dk, BV] state tile per program)
        "decode_inter_warps": 4,
        # fastest of 16 / 32 / 64 / 128 at batch 256 (benchmarks/results/2026-12-01_kda_decode_sweep_fef595f_h200.json)
        "decode_BV": min(dvp, 64),
        # register cap of the decode step's intra kernel (None: the compiler's choice). Launch options like
        # this one and the two above change no arithmetic: benchmarks/kda_decode_vs_fla.py --sweep times
        # alternatives and checks their outputs are the default's bits.
        "decode_intra_maxnreg": None,
        "decode_inter_maxnreg": None,  # the same for the decode step's recurrence kernel
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
    """The Triton forward (no autograd) in the applied ``Numerics.kda_form``; see ``kda_chunk`` for shapes and
    semantics."""
    if q.dtype == torch.float64:  # gradcheck: the fp64 torch composition is the reference
        return kda_chunk.impls["torch"](q, k, v, g, beta, cu_seqlens, initial_state, scale, output_chunk_states)
    t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:2] != (t, h) or beta.shape != (t, h):
        raise ValueError(f"kda_chunk: bad shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"g{tuple(g.shape)} beta{tuple(beta.shape)}")
    n = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n, h, dk, dv):
        raise ValueError(f"kda_chunk: initial_state {tuple(initial_state.shape)} != {(n, h, dk, dv)}")
    if kda_form() == "recurrent":
        return recurrent_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_chunk_states)
    dev = q.device
    scale = dk**-0.5 if scale is None else float(scale)
    tab = _tables(cu_seqlens, t, dev)
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
    # Every chunk is solved from row 0 here: the kept T / v_e rows are written, never read back.
    tt = torch.empty(tab.n_chunks, h, CHUNK_SIZE, CHUNK_SIZE, dtype=torch.float32, device=dev)
    ve = torch.empty(tab.n_chunks, h, CHUNK_SIZE, dv, dtype=torch.float32, device=dev)
    _launch(q, k, v, g, beta, tab, h0, final, o, chunk_states, tt, ve, scale)
    return o, final, chunk_states


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            tab: _Tables, h0: torch.Tensor | None, ht: torch.Tensor, o: torch.Tensor,
            chunk_states: torch.Tensor | None, tt: torch.Tensor, ve: torch.Tensor, scale: float) -> None:
    """Both kernels over the chunks and sequences of ``tab`` (contiguous [*, H, d] inputs, fp32 states
    ``h0`` / ``ht`` addressed by the STATE column, which may be one buffer updated in place); writes
    ``o`` (the rows >= OUT0 of real tokens), ``ht``, ``chunk_states`` and the kept ``tt`` / ``ve`` rows.
    The grid and every launch parameter come from host shapes (N, chunk count, H, dk, dv) only."""
    h, dk = q.shape[1], q.shape[2]
    dv = v.shape[-1]
    n = tab.seq_info.shape[0]
    dev = q.device
    cfg = _launch_config(dk, dv)
    dot_prec = kda_dot_precision()
    c = CHUNK_SIZE
    nc = tab.n_chunks
    qg = torch.empty(nc, h, c, dk, dtype=torch.float32, device=dev)
    kd = torch.empty(nc, h, c, dk, dtype=torch.float32, device=dev)
    a_qk = torch.empty(nc, h, c, c, dtype=torch.float32, device=dev)
    w = torch.empty(nc, h, c, dk, dtype=torch.float32, device=dev)
    u = torch.empty(nc, h, c, dv, dtype=torch.float32, device=dev)
    dec = torch.empty(nc, h, dk, dtype=torch.float32, device=dev)
    _kda_intra_kernel[(nc, h)](
        q, k, v, g, beta, tab.chunk_info, qg, kd, a_qk, w, u, dec, tt, scale, h,
        DK=dk, DV=dv, DKP=cfg["DKP"], DVP=cfg["DVP"], BK=cfg["BK"], BVI=cfg["BVI"], C=c, BC=_SUB,
        DOT_PREC=dot_prec, num_warps=cfg["intra_warps"], num_stages=1,
        **pdl(),
    )
    _kda_inter_kernel[(n, h, cdiv(dv, cfg["BV"]))](
        qg, kd, a_qk, w, u, dec, ve,
        h0 if h0 is not None else ht, o, ht, chunk_states if chunk_states is not None else ht,
        tab.chunk_info, tab.seq_info, h,
        DK=dk, DV=dv, BK=cfg["BK_STATE"], TWO=cfg["TWO"], BV=cfg["BV"], C=c, HAS_H0=h0 is not None,
        STORE_CS=chunk_states is not None, DOT_PREC=dot_prec,
        num_warps=cfg["inter_warps"], num_stages=1,
        **pdl(),
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
    """``kda_chunk`` on the GPU: Triton forward (the applied ``Numerics.kda_form``), fla-core backward
    (``kda_chunk_bwd.py``)."""
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
    """``kda_chunk_step`` on the GPU (see its docstring; no autograd): every chunk re-solved from row 0.
    CUDA-graph capturable: no host reads of device values, the tables built on the device, the grid from
    N, H, dk, dv only."""
    n, h, dk, dv = _check_step_args(q, k, v, g, beta, num_rows, state)
    if q.dtype == torch.float64:  # the kernels are fp32; fp64 only comes from reference checks
        return kda_chunk_step.impls["torch"](q, k, v, g, beta, num_rows, state, scale)
    if kda_form() == "recurrent":
        return recurrent_chunk_step(q, k, v, g, beta, num_rows, state, scale)
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
    zero, one = torch.zeros_like(seq), torch.ones_like(seq)
    tok0 = seq * c
    # n_chunks only sizes the scratch (N chunks); n_complete the unused chunk-state output.
    tab = _Tables(chunk_info=torch.stack([tok0, rows, tok0, zero, zero, seq], dim=1).contiguous(),
                  seq_info=torch.stack([tok0, rows, seq, seq, seq, one], dim=1).contiguous(), n_chunks=n, n_complete=0)
    q2, k2, g2 = (x.reshape(n * c, h, dk).contiguous() for x in (q, k, g))
    v2 = v.reshape(n * c, h, dv).contiguous()
    b2 = beta.reshape(n * c, h).contiguous()
    h0 = state.to(torch.float32).contiguous()
    tt = torch.empty(n, h, c, c, dtype=torch.float32, device=dev)
    ve = torch.empty(n, h, c, dv, dtype=torch.float32, device=dev)
    _launch(q2, k2, v2, g2, b2, tab, h0, final, o.view(n * c, h, dv), None, tt, ve, scale)
    return o, final


# --------------------------------------------------------------------------------------- decode step


@triton.jit
def _decode_prep_kernel(
    pos_ptr, slot_ptr, solved_ptr,  # [N] positions, [N] int64 slots, [S] int32 rows kept per slot
    k_ptr, v_ptr, g_ptr, beta_ptr,  # the new rows [N, H, dk | dv | dk], [N, H]
    ck_ptr, cv_ptr, cg_ptr, cbeta_ptr,  # the cache's chunk rows [S, 64, H, ...]
    cinfo_ptr, sinfo_ptr,  # out: [N, 6] chunk and sequence tables
    v_stride,  # elements between v's rows
    HK: tl.constexpr, HV: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr, C: tl.constexpr,
):
    """Per sequence: store the new row at its chunk row in the cache and write the kernels' tables."""
    await_previous_kernel()
    i = tl.program_id(0)
    slot, r, _ = stage_new_row(i, pos_ptr, slot_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ck_ptr, cv_ptr, cg_ptr, cbeta_ptr,
                               v_stride, HK, HV, H, BLOCK, C)
    row0 = tl.minimum(tl.load(solved_ptr + slot), r)
    tl.store(solved_ptr + slot, r + 1)
    s32 = slot.to(tl.int32)
    # chunk: TOK, ROWS, QTOK, ROW0, OUT0, KEEP
    ci = cinfo_ptr + i * 6
    tl.store(ci + 0, s32 * C)
    tl.store(ci + 1, r + 1)
    tl.store(ci + 2, i - r)
    tl.store(ci + 3, row0)
    tl.store(ci + 4, r)
    tl.store(ci + 5, s32)
    # sequence: OTOK, LEN, CHUNK0, COMPLETE0, STATE, FLAGS
    si = sinfo_ptr + i * 6
    tl.store(si + 0, i - r)
    tl.store(si + 1, r + 1)
    tl.store(si + 2, i)
    tl.store(si + 3, i)
    tl.store(si + 4, s32)
    tl.store(si + 5, 0)


@kda_decode_step.register("triton")
def kda_decode_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cache: KDADecodeCache,
    scale: float | None = None,
) -> torch.Tensor:
    """``kda_decode_step`` on the GPU (see its docstring). The rows before the new one are kept in the
    cache (``kda_decode_prime`` when a slot is loaded, then every step), so each step runs the chunk
    kernel's intra-chunk code from the new row on and the recurrence's products for that row only.
    Three launches, no host reads: CUDA-graph capturable."""
    n, h, dk, dv = check_decode_args(q, k, v, g, beta, positions, slots, cache)
    if q.dtype == torch.float64 or cache.g.dtype == torch.float64:
        return kda_decode_step.impls["torch"](q, k, v, g, beta, positions, slots, cache, scale)
    check_cache_form(cache)
    if kda_form() == "recurrent":
        return recurrent_decode_step(q, k, v, g, beta, positions, slots, cache, scale)
    dev = q.device
    scale = dk**-0.5 if scale is None else float(scale)
    o = torch.empty(n, h, dv, dtype=v.dtype, device=dev)
    if n == 0:
        return o
    c = CHUNK_SIZE
    cfg = _launch_config(dk, dv)
    info = torch.empty(2, n, _INFO_COLS, dtype=torch.int32, device=dev)
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    v = rows_in_place(v)
    block = max(next_pow2(h), 1024)
    _decode_prep_kernel[(n,)](positions, slots, cache.solved, k, v, g, beta, cache.k, cache.v, cache.g, cache.beta,
                              info[0], info[1], v.stride(0), HK=h * dk, HV=h * dv, H=h, BLOCK=block, C=c, num_warps=4,
                                 **pdl(),
                             )
    qg = torch.empty(n, h, c, dk, dtype=torch.float32, device=dev)
    kd = torch.empty(n, h, c, dk, dtype=torch.float32, device=dev)
    a_qk = torch.empty(n, h, c, c, dtype=torch.float32, device=dev)
    w = torch.empty(n, h, c, dk, dtype=torch.float32, device=dev)
    u = torch.empty(n, h, c, dv, dtype=torch.float32, device=dev)
    dec = torch.empty(n, h, dk, dtype=torch.float32, device=dev)
    _kda_intra_kernel[(n, h)](
        q, cache.k, cache.v, cache.g, cache.beta, info[0], qg, kd, a_qk, w, u, dec, cache.solved_t, scale, h,
        DK=dk, DV=dv, DKP=cfg["DKP"], DVP=cfg["DVP"], BK=cfg["BK"], BVI=cfg["BVI"], C=c, BC=_SUB,
        DOT_PREC=kda_dot_precision(), DECODE=True, num_warps=cfg["intra_warps"], num_stages=1,
        **({} if cfg["decode_intra_maxnreg"] is None else {"maxnreg": cfg["decode_intra_maxnreg"]}),
        **pdl(),
    )
    _kda_decode_inter_kernel[(n, h, cdiv(dv, cfg["decode_BV"]))](
        qg, kd, a_qk, w, u, dec, cache.v_e, cache.state, o, info[0], h,
        DK=dk, DV=dv, BK=cfg["BK_STATE"], TWO=cfg["TWO"], BV=cfg["decode_BV"], C=c, BC=_SUB, DOT_PREC=kda_dot_precision(),
        num_warps=cfg["decode_inter_warps"], num_stages=1,
        **({} if cfg["decode_inter_maxnreg"] is None else {"maxnreg": cfg["decode_inter_maxnreg"]}),
        **pdl(),
    )
    return o


@kda_decode_prime.register("triton")
def kda_decode_prime_triton(slots: torch.Tensor, num_rows: torch.Tensor, cache: KDADecodeCache,
                            scale: float | None = None) -> None:
    """``kda_decode_prime`` on the GPU: the chunk kernels over each slot's ``num_rows`` cached rows with no
    query (OUT0 = ROWS: no output), keeping their rows of T and v_e; the state is left as it is."""
    m = slots.numel()
    if m == 0 or cache.g.dtype == torch.float64:
        cache.solved[slots] = num_rows.to(torch.int32)
        return
    check_cache_form(cache)
    if kda_form() == "recurrent":
        recurrent_decode_prime(slots, num_rows, cache, scale)
        return
    h, dk, dv = cache.state.shape[1:]
    dev = cache.state.device
    c = CHUNK_SIZE
    scale = dk**-0.5 if scale is None else float(scale)
    s32, r32 = slots.to(torch.int32), num_rows.to(torch.int32)
    zero = torch.zeros_like(s32)
    tab = _Tables(chunk_info=torch.stack([s32 * c, r32, zero, zero, r32, s32], dim=1).contiguous(),
                  seq_info=torch.stack([zero, r32, torch.arange(m, dtype=torch.int32, device=dev), zero, s32, zero],
                                       dim=1).contiguous(), n_chunks=m, n_complete=0)
    rows = cache.flat_rows()
    no_output = torch.empty(0, h, dv, dtype=cache.v.dtype, device=dev)
    _launch(rows[0], *rows, tab, cache.state, cache.state, no_output, None, cache.solved_t, cache.v_e, scale)
    cache.solved[slots] = r32


@triton.jit
def _kda_decode_inter_kernel(
    qg_ptr, kd_ptr, aqk_ptr, w_ptr, u_ptr, dec_ptr,  # scratch written by _kda_intra_kernel (chunk id = i)
    ve_ptr, st_ptr, o_ptr,  # [S, H, 64, dv] kept v_e, [S, H, dk, dv] states (in place), o [N, H, dv]
    cinfo_ptr,  # [N, 6] chunk table of the step (_decode_prep_kernel)
    H,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The recurrence kernel's arithmetic for the one new row r of each sequence, whose earlier rows
    are kept (ROW0 == OUT0 == r, what ``kda_decode_prime`` guarantees). Every product that gives row r
    is the recurrence kernel's ``tl.dot`` with the same K blocking and accumulation chain, cut to the
    16-row block holding r (the other rows of the left operand exact zeros): an MMA computes each
    output row from its own row of the left operand, so row r gets the bits the 64-row tile gives it.
    The state update of a completed chunk is the recurrence kernel's own 64-row product."""
    await_previous_kernel()
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    ci = cinfo_ptr + i * 6
    r = tl.load(ci + 4)
    keep = tl.load(ci + 5).to(tl.int64)  # the slot
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    r16 = (r // BC) * BC + tl.arange(0, BC)
    is_r = r16 == r
    k0 = tl.arange(0, BK)
    k1 = BK + tl.arange(0, BK)
    vs = vb * BV + tl.arange(0, BV)
    k0m = k0 < DK
    k1m = k1 < DK
    vmask = vs < DV
    st_base = (keep * H + h) * DK
    st0 = (st_base + k0[:, None]) * DV + vs[None, :]
    st1 = (st_base + k1[:, None]) * DV + vs[None, :]
    st0m = k0m[:, None] & vmask[None, :]
    st1m = k1m[:, None] & vmask[None, :]
    s0 = tl.load(st_ptr + st0, mask=st0m, other=0.0)
    if TWO:
        s1 = tl.load(st_ptr + st1, mask=st1m, other=0.0)
    sc_base = (i * H + h) * C
    m0 = is_r[:, None] & k0m[None, :]
    m1 = is_r[:, None] & k1m[None, :]
    u = tl.load(u_ptr + (sc_base + r16[:, None]) * DV + vs[None, :], mask=is_r[:, None] & vmask[None, :], other=0.0)
    ws = tl.dot(tl.load(w_ptr + (sc_base + r16[:, None]) * DK + k0[None, :], mask=m0, other=0.0), s0,
                input_precision=DOT_PREC)
    if TWO:
        ws = tl.dot(tl.load(w_ptr + (sc_base + r16[:, None]) * DK + k1[None, :], mask=m1, other=0.0), s1, acc=ws,
                    input_precision=DOT_PREC)
    # Row r alone, exactly: x + (-0.0) == x for every x, signed zeros included.
    ve_row = tl.sum(tl.where(is_r[:, None], u - ws, -0.0), axis=0)
    ve_off = ((keep * H + h) * C + rows[:, None]) * DV + vs[None, :]
    v_e = tl.load(ve_ptr + ve_off, mask=(rows < r)[:, None] & vmask[None, :], other=0.0)
    v_e = tl.where((rows == r)[:, None], ve_row[None, :], v_e)
    tl.store(ve_ptr + ((keep * H + h) * C + r) * DV + vs, ve_row, mask=vmask)
    o = tl.dot(tl.load(qg_ptr + (sc_base + r16[:, None]) * DK + k0[None, :], mask=m0, other=0.0), s0,
               input_precision=DOT_PREC)
    if TWO:
        o = tl.dot(tl.load(qg_ptr + (sc_base + r16[:, None]) * DK + k1[None, :], mask=m1, other=0.0), s1, acc=o,
                   input_precision=DOT_PREC)
    a_qk = tl.load(aqk_ptr + (sc_base + r16[:, None]) * C + cols[None, :], mask=is_r[:, None] & (cols >= 0)[None, :],
                   other=0.0)
    o = o + tl.dot(a_qk, v_e, input_precision=DOT_PREC)
    o_row = tl.sum(tl.where(is_r[:, None], o, -0.0), axis=0)
    tl.store(o_ptr + (i * H + h) * DV + vs, o_row.to(o_ptr.dtype.element_ty), mask=vmask)
    if r == C - 1:  # the chunk is complete: advance the state (the recurrence kernel's 64-row product)
        sc0 = (sc_base + rows[:, None]) * DK + k0[None, :]
        dec_base = (i * H + h) * DK
        kd0 = tl.load(kd_ptr + sc0, mask=(rows >= 0)[:, None] & k0m[None, :], other=0.0)
        dec0 = tl.load(dec_ptr + dec_base + k0, mask=k0m, other=0.0)
        s0 = dec0[:, None] * s0 + tl.dot(tl.trans(kd0), v_e, input_precision=DOT_PREC)
        tl.store(st_ptr + st0, s0, mask=st0m)
        if TWO:
            sc1 = (sc_base + rows[:, None]) * DK + k1[None, :]
            kd1 = tl.load(kd_ptr + sc1, mask=(rows >= 0)[:, None] & k1m[None, :], other=0.0)
            dec1 = tl.load(dec_ptr + dec_base + k1, mask=k1m, other=0.0)
            s1 = dec1[:, None] * s1 + tl.dot(tl.trans(kd1), v_e, input_precision=DOT_PREC)
            tl.store(st_ptr + st1, s1, mask=st1m)
