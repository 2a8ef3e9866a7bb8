"""Triton backend of the DSA lightning indexer: FP8 index scores and the exact top-k selection.

Semantics are those of ``zmrl.kernels_batch_invariant.dsa_indexer`` (read its docstring).

``dsa_index_scores``: one program per (query, ``KEYS_PER_PROGRAM`` keys), walking blocks of 64 key
positions aligned to absolute positions. Per block the FP8 dot ``k8 [64, Di] @ q8^T [Di, Hi]`` runs on
the tensor cores with fp32 accumulation (e4m3 x e4m3 products are exact in fp32), then
``ReLU``, ``* (w * s_q)`` (one fp32 rounding per (token, head), as in the torch backend), the head sum
(``tl.sum`` over the Hi axis of a tile whose shape and layout are fixed per model, hence a fixed order),
``* s_k`` and -inf past ``query_pos``. Each score depends only on its query row and its key: no
program sees another query. Under the Triton interpreter the FP8 tiles are upcast to fp32 (exactly)
before the dot. If this Triton build cannot compile the FP8 dot, the kernel falls back, once per
process and with a warning, to an fp32 tf32 dot over the same exact values (the products are exact
either way; the choice is deterministic for a given GPU and Triton, hence the same in the rollout and
trainer processes).

Static width (CUDA-graph decode): with ``kv_len`` the output is ``[Q, kv_len]`` and the grid
``(Q, cdiv(kv_len, KEYS_PER_PROGRAM))`` follows from host shapes alone (no ``.item()``); programs
past a query's position store -inf, the others compute exactly what they compute without it.

``dsa_topk``: the kernel below, except for a few long rows (fewer than ``TOPK_MIN_ROWS`` rows of more than
``TOPK_SORT_WIDTH`` scores), which take torch's stable sort (both exact, hence identical). Kernel: one program per row. The fp32 scores are mapped to
order-preserving 32-bit keys (``-0.0`` folded onto ``+0.0`` first, because torch's sort treats them as
equal); a radix select, one byte per pass from the top (four passes, each a 256-bin histogram of the next
byte of the keys that match the bytes chosen so far), finds the exact k-th largest key T and how many keys
equal to T are kept. The row is then scanned in ascending position order keeping every key > T and the
first ``k - count(key > T)`` keys == T (lowest positions first: the (score desc, position asc) tie
rule), written in ascending order through a running prefix sum, -1 padded. Rows with at most k
candidates keep all of them. Exact by construction: five passes over the row.

Fast mode (in ``dsa_indexer.py``): a plain fp32 matmul for the scores and ``torch.topk`` (not tie-stable)
for the selection.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ..dsa_indexer import dsa_index_scores, dsa_topk
from ..mla_attention import KEY_BLOCK, key_width
from ._common import INTERPRET, await_previous_kernel, cdiv, pdl
from ._autograd import with_reference_backward

log = logging.getLogger(__name__)

_INTERPRET = INTERPRET
KEYS_PER_PROGRAM = 256  # score kernel: keys per program (4 blocks of 64); q is loaded once per program
TOPK_BLOCK = 1024  # top-k kernel: row elements per scan step
RADIX = tl.constexpr(256)  # top-k kernel: bins of one radix-select pass (one byte of the 32-bit keys)
# Fewer rows than TOPK_MIN_ROWS, each wider than TOPK_SORT_WIDTH: torch's stable sort (same result, exact either
# way); see dsa_topk_triton.
TOPK_MIN_ROWS = 64
TOPK_SORT_WIDTH = 16384
# Whether the score kernel uses the FP8 tensor-core dot; set to False on the first compile failure.
_fp8_dot_ok: bool = not _INTERPRET

assert KEYS_PER_PROGRAM % KEY_BLOCK == 0


# Batch- and layout-dependent integers are not specialised: one compiled kernel per model shape.
@triton.jit(do_not_specialize=["page_size", "bt_stride", "width"])
def _index_scores_kernel(
    q8_ptr, qs_ptr, w_ptr, k8_ptr, ks_ptr, bt_ptr, seq_ptr, qpos_ptr, out_ptr,
    page_size, bt_stride, width,
    HI: tl.constexpr, DI: tl.constexpr, HI_P: tl.constexpr, DI_P: tl.constexpr,
    BLOCK_N: tl.constexpr, PER_PROG: tl.constexpr, FP8_DOT: tl.constexpr,
):
    await_previous_kernel()
    qi = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    offs_h = tl.arange(0, HI_P)
    hmask = offs_h < HI
    offs_d = tl.arange(0, DI_P)
    dmask = offs_d < DI
    offs_n = tl.arange(0, BLOCK_N)

    qpos = tl.load(qpos_ptr + qi)
    seq = tl.load(seq_ptr + qi)
    # (w * s_q): one fp32 rounding per (token, head), exactly as the torch backend.
    wq = tl.load(w_ptr + qi * HI + offs_h, mask=hmask, other=0.0) * tl.load(qs_ptr + qi * HI + offs_h, mask=hmask, other=0.0)
    q8 = tl.load(q8_ptr + (qi * HI + offs_h)[:, None] * DI + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    if FP8_DOT:
        q8t = tl.trans(q8)
    else:
        q8t = tl.trans(q8.to(tl.float32))
    for blk in range(0, PER_PROG // BLOCK_N):
        pos = kb * PER_PROG + blk * BLOCK_N + offs_n  # int32: positions < 2^31
        in_out = pos < width
        valid = (pos <= qpos) & in_out
        score = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            pos_c = tl.where(valid, pos, 0)
            page = tl.load(bt_ptr + seq * bt_stride + pos_c // page_size, mask=valid, other=0)
            slot = page.to(tl.int64) * page_size + pos_c % page_size
            k8 = tl.load(k8_ptr + slot[:, None] * DI + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            ks = tl.load(ks_ptr + slot, mask=valid, other=0.0)
            if FP8_DOT:
                dot = tl.dot(k8, q8t)  # [BLOCK_N, HI_P] fp32 accumulate
            else:
                dot = tl.dot(k8.to(tl.float32), q8t, input_precision="tf32")  # fp8 values are exact in tf32
            per_head = tl.maximum(dot, 0.0) * wq[None, :]
            s = ks * tl.sum(per_head, axis=1)
            score = tl.where(valid, s, float("-inf"))
        tl.store(out_ptr + qi * width + pos, score, mask=in_out)


@triton.jit
def _order_key(x):
    """fp32 scores -> int64 keys in [0, 2^32) with the scores' order (-0.0 folded onto +0.0 first, as torch's
    sort treats them as equal): sign-magnitude bits flipped to two's-complement order, then offset by 2^31."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648


@triton.jit(do_not_specialize=["width", "score_stride", "K"])
def _topk_kernel(scores_ptr, qpos_ptr, out_ptr, width, score_stride, K, BLOCK: tl.constexpr):
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    qpos = tl.load(qpos_ptr + row)
    n = tl.minimum(qpos + 1, width)  # candidates are positions 0..n-1
    offs = tl.arange(0, BLOCK)
    base = scores_ptr + row * score_stride
    out_row = out_ptr + row * K
    if n <= K:
        # At most k candidates: all of them, already ascending, then -1 padding (the row is written whole: the
        # output needs no fill of its own).
        for k0 in range(0, K, BLOCK):  # (its own name: the other branch's j0 loops run to an int64 bound)
            pos = k0 + offs
            tl.store(out_row + pos, tl.where(pos < n, pos.to(tl.int64), -1), mask=pos < K)
    else:
        # Radix select of the K-th largest key T, one byte per pass from the top: a pass histograms the
        # next byte of the keys whose higher bytes equal T's so far and keeps the largest byte value d with
        # count(byte >= d) >= need; need drops by the count above d. After four passes ``prefix`` is T and
        # ``need`` the number of keys == T to keep.
        lanes = tl.arange(0, RADIX)
        prefix = tl.zeros([], tl.int64)
        need = K.to(tl.int32)
        for p in tl.static_range(4):
            shift = 24 - 8 * p  # a constexpr: p is
            hist = tl.zeros([RADIX], tl.int32)
            for j0 in range(0, n, BLOCK):
                pos = j0 + offs
                m = pos < n
                key = _order_key(tl.load(base + pos, mask=m, other=0.0))
                match = m & ((key >> (shift + 8)) == prefix)
                digit = tl.where(match, (key >> shift) & (RADIX - 1), 0).to(tl.int32)
                # keys that do not match land in bin 0 here and are taken out of it again
                hist += tl.histogram(digit, RADIX)
                hist -= tl.where(lanes == 0, tl.sum((~match).to(tl.int32), axis=0), 0)
            at_least = tl.sum(hist, axis=0) - (tl.cumsum(hist, axis=0) - hist)  # count(byte >= b), non-increasing
            d = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1
            need -= tl.sum(tl.where(lanes > d, hist, 0), axis=0)
            prefix = (prefix << 8) | d.to(tl.int64)
        # Keep every key > T and the first ``need`` keys == T (lowest positions first), ascending.
        eq_seen = tl.zeros([], tl.int32)
        sel_seen = tl.zeros([], tl.int32)
        for j0 in range(0, n, BLOCK):
            pos = j0 + offs
            m = pos < n
            key = _order_key(tl.load(base + pos, mask=m, other=0.0))
            eq = (key == prefix) & m
            gt = (key > prefix) & m
            eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) + eq_seen  # 1-based among ties so far
            sel = gt | (eq & (eq_rank <= need))
            sel_i = sel.to(tl.int32)
            idx = tl.cumsum(sel_i, axis=0) - 1 + sel_seen
            tl.store(out_row + idx, pos.to(tl.int64), mask=sel)
            eq_seen += tl.sum(eq.to(tl.int32), axis=0)
            sel_seen += tl.sum(sel_i, axis=0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dsa_index_scores.register("triton")
@with_reference_backward(dsa_index_scores.impls["torch"])
def dsa_index_scores_triton(q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor,
                            k8_cache: torch.Tensor, k_scale_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_idx: torch.Tensor, query_pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
    """Causal FP8 index scores ``[Q, max(query_pos) + 1]`` (``[Q, kv_len]`` when given) fp32 (see the
    module docstring)."""
    global _fp8_dot_ok
    nq, hi, di = q8.shape
    num_pages, page_size, dk = k8_cache.shape
    if dk != di:
        raise ValueError(f"dsa_index_scores: q8 head dim {di} != key cache dim {dk}")
    qp = query_pos.to(torch.int64).contiguous()
    width = key_width(qp, kv_len)
    out = torch.empty((nq, width), dtype=torch.float32, device=q8.device)
    if nq == 0 or width == 0:
        return out
    args = (q8.contiguous(), q_scale.to(torch.float32).contiguous(), weights.to(torch.float32).contiguous(),
            k8_cache.contiguous(), k_scale_cache.to(torch.float32).contiguous(),
            block_table.to(torch.int64).contiguous(), seq_idx.to(torch.int64).contiguous(), qp, out)
    grid = (nq, cdiv(width, KEYS_PER_PROGRAM))
    consts = dict(HI=hi, DI=di, HI_P=max(16, _next_pow2(hi)), DI_P=max(16, _next_pow2(di)),
                  BLOCK_N=KEY_BLOCK, PER_PROG=KEYS_PER_PROGRAM, num_warps=4)
    bt_stride = args[5].stride(0)
    if _fp8_dot_ok:
        try:
            _index_scores_kernel[grid](*args, page_size, bt_stride, width, FP8_DOT=True, **consts, **pdl())
            return out
        except Exception as e:  # noqa: BLE001 - a compile failure of the fp8 dot: use the tf32 path
            log.warning("dsa_index_scores: FP8 tl.dot unavailable (%s: %s); using exact tf32 dots",
                        type(e).__name__, e)
            _fp8_dot_ok = False
    _index_scores_kernel[grid](*args, page_size, bt_stride, width, FP8_DOT=False, **consts, **pdl())
    return out


@dsa_topk.register("triton")
def dsa_topk_triton(scores: torch.Tensor, query_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Exact top-k per row (score desc, position asc), ascending, -1 padded: ``[Q, topk]`` int64.

    Both implementations are exact, so their outputs are identical (the selection is a function of
    the row alone): the choice may depend on the batch without breaking invariance. A few long rows (fewer
    than ``TOPK_MIN_ROWS`` rows of more than ``TOPK_SORT_WIDTH`` scores: decode at long context and small batch)
    use the torch backend's stable sort, which spreads a row over the whole GPU; everything else the
    one-program-per-row kernel (the H200 measurements behind the two limits:
    benchmarks/results/2026-12-02_dsa_kernels_41cc49d_h200.json)."""
    if scores.shape[0] < TOPK_MIN_ROWS and scores.shape[-1] > TOPK_SORT_WIDTH:
        return dsa_topk.impls["torch"](scores, query_pos, topk)
    return dsa_topk_kernel(scores, query_pos, topk)


def dsa_topk_kernel(scores: torch.Tensor, query_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """The Triton top-k kernel itself (see ``dsa_topk_triton``)."""
    nq, width = scores.shape
    out = torch.empty((nq, topk), dtype=torch.int64, device=scores.device)  # every row written by the kernel
    if nq == 0 or topk == 0:
        return out
    s = scores.detach().to(torch.float32)
    if s.stride(-1) != 1:
        s = s.contiguous()
    _topk_kernel[(nq,)](s, query_pos.to(torch.int64).contiguous(), out, width, s.stride(0), topk,
                        BLOCK=TOPK_BLOCK, num_warps=4, **pdl())
    return out
