"""Probe (2026-12-06): the keys form of the sparse MLA split kernel with the bf16 hi and lo halves stacked on the
MMA's N dimension, against the keys and heads forms of ``zmrl/kernels_batch_invariant/triton/mla_attention.py``.

Why: in the keys form (``k @ q^T``, ``c_kv^T @ p^T``, warpgroup MMAs) a program's 16 heads are the MMA's N, and
each operand pair (q_hi, q_lo), (p_hi, p_lo) costs two MMAs that read the same key tile from shared memory. With
the halves side by side on N (``[q_hi | q_lo]`` interleaved per head: N = 32) the key tile is read once per
product and each warpgroup MMA is twice as wide. The sums change: ``s = k.q_hi + k.q_lo`` is formed from two fp32
partial dots instead of one running accumulator, and ``p @ c_kv`` keeps a hi and a lo accumulator added after the
last key block, so this is another numerics (shared by engine and trainer if adopted), not the keys form's bits.

    python benchmarks/probes/mla_keys_stacked_probe.py [--out FILE.json]   # CUDA
    TRITON_INTERPRET=1 python benchmarks/probes/mla_keys_stacked_probe.py --smoke

Prints, per case (decode 256 x 8K, one 4096-token prefill; top-2048), ms and the max error against float64 for
heads, keys and the stacked variant under each launch of ``--launches``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from mla_dsa_kernels import bench, sparse_case, sweep_cases  # noqa: E402

from zmrl.kernels_batch_invariant import current_numerics, numerics_scope  # noqa: E402
from zmrl.kernels_batch_invariant.mla_attention import mla_attention  # noqa: E402
from zmrl.kernels_batch_invariant.triton import mla_attention as M  # noqa: E402
from zmrl.kernels_batch_invariant.triton import triton_impl  # noqa: E402


@triton.jit
def _interleave(a, b, W: tl.constexpr, N: tl.constexpr):
    """[W, N] and [W, N] -> [W, 2N] with column 2j = a[:, j], 2j + 1 = b[:, j]."""
    return tl.reshape(tl.join(a, b), (W, 2 * N))


@triton.jit
def _halves_sum(x, R: tl.constexpr, N: tl.constexpr):
    """[R, 2N] interleaved (column 2j, 2j + 1) -> their sum [R, N]."""
    a, b = tl.split(tl.reshape(x, (R, N, 2)))
    return a + b


@triton.jit
def _q_stacked(qh_ptr, ql_ptr, q_off, hmask, COL: tl.constexpr, W: tl.constexpr, LIM: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """The keys form's resident query columns ([W, heads] hi and lo, ``_q_cols_t``) interleaved on N."""
    hi, lo = M._q_cols_t(qh_ptr, qh_ptr, ql_ptr, q_off, hmask, COL, W, LIM, True)
    return _interleave(hi, lo, W, BLOCK_H)


@triton.jit
def _k_tile(row, valid, COL: tl.constexpr, W: tl.constexpr, LIM: tl.constexpr):
    offs = COL + tl.arange(0, W)
    return tl.load(row[:, None] + offs[None, :], mask=valid[:, None] & (offs < LIM)[None, :], other=0.0)


@triton.jit(do_not_specialize=["H", "page_size", "bt_stride", "kp_stride", "L", "num_splits"])
def _stacked_split_kernel(
    q_ptr, qh_ptr, ql_ptr, kv_ptr, bt_ptr, seq_ptr, kp_ptr, qpos_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
    scale, H, page_size, bt_stride, kp_stride, L, num_splits,
    DC: tl.constexpr, DR: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr, DR_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DENSE: tl.constexpr, DIRECT: tl.constexpr, SPLIT_BF16: tl.constexpr, N_HG: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
):
    tl.static_assert(SPLIT_BF16 and NCH == 4 and DR > 0, "the probe covers the bench preset's bf16 cache")
    qi, hg, sp = M._program_coords(num_splits, N_HG)
    D: tl.constexpr = DC + DR
    H2: tl.constexpr = 2 * BLOCK_H
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = qi * H + offs_h
    q_off = q_rows * D
    seq = tl.load(seq_ptr + qi)
    start, qpos, n_blocks = M._split_extent(qi, sp, kp_ptr, kp_stride, L, qpos_ptr, SPLIT, BLOCK_N, DENSE)
    q0 = _q_stacked(qh_ptr, ql_ptr, q_off, hmask, 0, KC, DC, BLOCK_H)
    q1 = _q_stacked(qh_ptr, ql_ptr, q_off, hmask, KC, KC, DC, BLOCK_H)
    q2 = _q_stacked(qh_ptr, ql_ptr, q_off, hmask, 2 * KC, KC, DC, BLOCK_H)
    q3 = _q_stacked(qh_ptr, ql_ptr, q_off, hmask, 3 * KC, KC, DC, BLOCK_H)
    qr = _q_stacked(qh_ptr, ql_ptr, q_off, hmask, DC, DR_P, D, BLOCK_H)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([KC, H2], tl.float32)
    acc1 = tl.zeros([KC, H2], tl.float32)
    acc2 = tl.zeros([KC, H2], tl.float32)
    acc3 = tl.zeros([KC, H2], tl.float32)
    valid, slot = M._block_slots(start, offs_n, kp_ptr, qi, kp_stride, L, start + SPLIT, bt_ptr, seq, bt_stride,
                                 page_size, qpos, DENSE, False)
    for blk in range(0, n_blocks):
        row = kv_ptr + slot * D
        valid_next, slot_next = M._block_slots(start + (blk + 1) * BLOCK_N, offs_n, kp_ptr, qi, kp_stride, L,
                                               start + SPLIT, bt_ptr, seq, bt_stride, page_size, qpos, DENSE,
                                               False)
        c0 = _k_tile(row, valid, 0, KC, DC)
        c1 = _k_tile(row, valid, KC, KC, DC)
        c2 = _k_tile(row, valid, 2 * KC, KC, DC)
        c3 = _k_tile(row, valid, 3 * KC, KC, DC)
        cr = _k_tile(row, valid, DC, DR_P, D)
        s2 = tl.dot(c0, q0)
        s2 = tl.dot(c1, q1, s2)
        s2 = tl.dot(c2, q2, s2)
        s2 = tl.dot(c3, q3, s2)
        s2 = tl.dot(cr, qr, s2)
        s_t = _halves_sum(s2, BLOCK_N, BLOCK_H)
        p_t, p_hi, p_lo, alpha, m_new, l_i = M._softmax_block(s_t, valid, m_i, l_i, scale, 0, True)
        p2 = _interleave(p_hi, p_lo, BLOCK_N, BLOCK_H)
        alpha2 = tl.reshape(tl.join(alpha, alpha), (H2,))
        acc0 = tl.dot(tl.trans(c0), p2, acc0 * alpha2[None, :])
        acc1 = tl.dot(tl.trans(c1), p2, acc1 * alpha2[None, :])
        acc2 = tl.dot(tl.trans(c2), p2, acc2 * alpha2[None, :])
        acc3 = tl.dot(tl.trans(c3), p2, acc3 * alpha2[None, :])
        m_i = m_new
        valid = valid_next
        slot = slot_next
    M._store_result(out_ptr, m_ptr, l_ptr, acc_ptr, q_rows, qi, sp, num_splits, H, offs_h, hmask, m_i, l_i,
                    _halves_sum(acc0, KC, BLOCK_H), _halves_sum(acc1, KC, BLOCK_H), _halves_sum(acc2, KC, BLOCK_H),
                    _halves_sum(acc3, KC, BLOCK_H), KC, NCH, DC, DIRECT, True)
    if FUSED_COMBINE:
        M._combine_if_last(m_ptr, l_ptr, acc_ptr, out_ptr, cnt_ptr, qi, hg, num_splits, H, offs_h, hmask,
                           DC, KC, NCH, BLOCK_H, N_HG)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--launches", default="32x8x2,16x8x2,16x4x2,32x4x2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--force-split", action="store_true", help="--smoke: run the bf16 hi / lo kernels anyway")
    a = ap.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    launches = [tuple(int(v) for v in x.split("x")) for x in a.launches.split(",") if x]
    if a.smoke and a.force_split:
        M._INTERPRET = False  # take the bf16 hi / lo path under the interpreter (runs; the interpreter's bf16 dot is wrong)
    sparse = triton_impl(mla_attention)
    production = M.split_kernel_for
    rows = []
    for kind, batch, ctx in sweep_cases(a.smoke)[:1 if a.smoke else 2]:
        args = sparse_case(kind, batch, ctx, device, a.smoke, dtype=torch.bfloat16)
        q_lat, q_pe, cache = args[:3]
        nq = q_lat.shape[0]
        exact = mla_attention.impls["torch"](q_lat.double(), q_pe.double(), cache.double(), *args[3:])
        for variant in ("heads", "stacked", "keys"):
            form = "heads" if variant == "heads" else "keys"
            for launch in (launches if variant != "heads" else [(32, 8, 2)]):
                row = {"case": kind, "queries": nq, "variant": variant, "launch": "x".join(map(str, launch))}
                if variant == "stacked":
                    M.split_kernel_for = lambda _form: _stacked_split_kernel
                try:
                    with numerics_scope(current_numerics().replace(mla_mma_rows=form)), M.launch_override(*launch):
                        out = sparse(*args)
                        row["ms"] = bench(lambda: sparse(*args), device)
                    row["max_err_vs_fp64"] = float((out.double() - exact).abs().max())
                except Exception as e:  # noqa: BLE001 - a launch that does not build is a row
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                finally:
                    M.split_kernel_for = production
                rows.append(row)
                print(row, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
