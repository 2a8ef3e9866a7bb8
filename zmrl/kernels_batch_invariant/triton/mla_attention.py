"""Triton backend of absorbed MLA attention (sparse key lists and the dense causal path).

Layout and semantics are those of ``zmrl.kernels_batch_invariant.mla_attention`` (read its docstring):
MQA over the paged latent cache ``[c_kv | k_pe]``, every head of a query sharing its keys.

Arithmetic (the GPU form of the contract; it need not equal the CPU backend bitwise, but every query's
bits depend on nothing but its q, its key list and the key values):

* One program per (query, head group of ``BLOCK_H`` heads, split). The key LIST (sparse) or the causal
  positions 0..t (dense) is cut into splits of ``SPLIT_KEYS`` entries, a fixed number of keys that is
  the same for prefill and decode, every batch and every context length. Inside a split, blocks of
  ``KEY_BLOCK`` (64) list entries / positions are merged by an online softmax in ascending order.
  Block j of a dense query covers positions [64j, 64j + 64), which is exactly block j of the sparse
  list 0..t, so both paths see the same blocks and run the same instructions (one kernel, a
  constexpr picks where positions come from).
* Per block: ``s = (q . [c_kv | k_pe]) * scale`` (masked -> -inf), ``m_new = max(m, max s)``,
  ``p = exp(s - m_new)`` (masked -> exactly 0), ``l = l * alpha + sum(p)``,
  ``acc = acc * alpha + p @ c_kv``. A sparse split's loop ends at its last valid list entry, so
  trailing -1 padding is never visited; a block without a valid entry before it (a hole in the list)
  is an exact no-op (``alpha = 1``, ``p = 0``). The loop body has no branch, which lets Triton's
  pipeliner prefetch the list entries, and each iteration looks up the next block's cache slots
  before it computes. The score dot runs over the latent in fixed
  column chunks (Dc = 512: 4 x 128, ascending) and then the rope columns, accumulating into one fp32
  tile; ``p @ c_kv`` keeps one fp32 accumulator per column chunk (``kernel_config``).
* Splits are combined, by the last of a (query, head group)'s split programs to finish in the split kernel's own
  launch (``FUSED_COMBINE``; or by a second kernel, ``_mla_combine_kernel``), in ascending split order: ``M = max_j m_j``, then
  ``l = sum_j l_j exp(m_j - M)``, ``acc = sum_j acc_j exp(m_j - M)`` (sequential, ascending), and
  ``o = acc / l``. With a single non-empty split this is the identity (``exp(0) = 1``, ``0 + x = x``),
  so a query whose keys fit one split gets the same bits whether the launch had one split (output
  written directly by the first kernel) or several (because another query of the batch is longer).
* Precision: scores and ``p @ c_kv`` accumulate in fp32. With a bf16 cache the fp32 operands (q, p)
  are split into ``hi + lo`` bf16 pairs (q on the host, p in the kernel; elementwise roundings) and multiplied by the exact bf16 keys with two tensor-core
  MMAs (about 16 significant bits for q and p, errors ~1e-5 relative, at bf16 MMA speed); with the numerics
  field ``mla_operands = "bf16"`` they are rounded to bf16 once instead (one MMA per product, the hi halves
  alone: half the tensor work, 8 significant bits, FlashMLA's practice; the row sums keep the fp32 p). Other cache
  dtypes use fp32 ``tf32x3`` dots (three tf32 MMAs, about fp32 accuracy; ``ieee`` fp32 dots of these
  tile sizes spill tens of KB of registers; "bf16" operands: q and p rounded to bf16 values first). Under the
  Triton interpreter every dot runs on fp32 tiles (its bf16 dot is wrong).

Two forms of the split kernel, chosen by the numerics field ``mla_mma_rows`` (docs/numerics.md): "heads"
(``_mla_split_kernel``, the heads on the MMA's rows: ``q @ k^T``, ``p @ c_kv``) and "keys"
(``_mla_split_kernel_keys_rows``: ``k @ q^T``, ``c_kv^T @ p^T``, which Hopper runs as warpgroup MMAs). The
same steps in the same order on the same operands; the MMA instructions differ, so the bits may.

Static key width (CUDA-graph decode, ``kv_len`` given): the wrappers read no device value on the host
and launch one grid over all queries whose shape follows from host shapes and ``kv_len`` only. The
sparse path's list width is static already; the dense path takes ``cdiv(kv_len, SPLIT_KEYS)`` splits
for every query instead of sizing them from max(query_pos). Splits past a query's position are empty
(m = -inf, l = 0; acc is not written and the combine gives them weight exactly 0), and a query's
non-empty splits are those it has without ``kv_len``; with one non-empty split the combine passes it
through bit for bit (see above), so the output bits equal the ``kv_len=None`` ones.

Launch configuration (BLOCK_H, num_warps, num_stages) depends only on the head count and the latent
dims, never on the number of queries or keys; there is no autotuning.

Autograd: a hand-written backward in torch ops (``mla_attention_grads.py``): per chunk of queries it
recomputes the softmax over the union of the chunk's keys as GEMMs (the per-query key lists become a
mask), applies the usual attention gradient and adds the key gradients onto unique cache slots, so it
is run-to-run deterministic; it is not batch-invariant (docs/numerics.md asks correctness of the backward,
and determinism).

Fast mode (in ``mla_attention.py``): stock ``F.scaled_dot_product_attention`` over gathered keys (not
invariant).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..mla_attention import KEY_BLOCK, _check_shapes, key_width, mla_attention, mla_attention_dense
from ..mla_attention_grads import mla_attention_grads
from ..numerics import mla_mma_rows, mla_operands
from ._common import INTERPRET, arrival_counters, await_previous_kernel, cdiv, last_to_arrive, pdl, reset_arrivals

log = logging.getLogger(__name__)

# Keys per split: fixed for every query (prefill and decode alike), a multiple of KEY_BLOCK. Decode at
# 32K context gets 32 splits x (heads / BLOCK_H) programs per query.
SPLIT_KEYS = 1024
# The splits of a (query, head group) are combined by the last of their programs to finish, in the split kernel's
# own launch (FUSED_COMBINE: one launch instead of two, the partials read back from L2), unless
# ZMRL_MLA_FUSED_COMBINE=0 (then by ``_mla_combine_kernel``). The same operations in the same order: the same bits.
FUSED_COMBINE = os.environ.get("ZMRL_MLA_FUSED_COMBINE", "1") != "0"
# ZMRL_MLA_SLOT_LIST=1: the sparse path first turns each key list into cache slots (``key_slots``, one small
# launch), so the split kernel's key loop loads a block's slots with one load instead of two dependent ones (list
# entry, then its page). The same key rows, the same bits; read at every launch (the probes flip it).
SLOT_LIST = os.environ.get("ZMRL_MLA_SLOT_LIST", "0") == "1"
# Bound on the fp32 partial (acc) buffer of one launch; queries are launched in chunks below it.
# Chunking never changes a query's arithmetic.
PARTIAL_BYTES = 512 * 1024 * 1024
# Queries per chunk in the torch backward (bounds the gathered keys and the [G, H, L] probabilities).
BACKWARD_ELEMS = 1 << 26

_INTERPRET = INTERPRET

assert SPLIT_KEYS % KEY_BLOCK == 0 and SPLIT_KEYS & (SPLIT_KEYS - 1) == 0  # the sparse pre-scan is tl.arange(SPLIT)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class MLAKernelConfig:
    """Launch configuration, a function of the model dims only."""

    block_h: int
    n_chunks: int  # the latent is processed in n_chunks column chunks of chunk width
    chunk: int
    num_warps: int
    num_stages: int


# A launch that replaces kernel_config's (BLOCK_H, num_warps, num_stages) inside ``launch_override``: launch sweeps
# and benchmarks only (benchmarks/mla_dsa_kernels.py --sweep, decode_throughput.py --mla-launch).
_LAUNCH_OVERRIDE: list[tuple[int, int, int]] = []


@contextlib.contextmanager
def launch_override(block_h: int, num_warps: int, num_stages: int) -> Iterator[None]:
    """Run the split kernel under this launch instead of ``kernel_config``'s, for a sweep. Scheduling only: in the
    heads form no launch has changed a bit in any sweep; the keys form's sweep rows check it."""
    _LAUNCH_OVERRIDE.append((block_h, num_warps, num_stages))
    try:
        yield
    finally:
        _LAUNCH_OVERRIDE.pop()


@contextlib.contextmanager
def slot_list_override(on: bool) -> Iterator[None]:
    """Launch with SLOT_LIST set to ``on`` inside the block (sweeps and benchmarks; the bits do not change)."""
    global SLOT_LIST
    before, SLOT_LIST = SLOT_LIST, on
    try:
        yield
    finally:
        SLOT_LIST = before


def kernel_config(num_heads: int, dc: int, dr: int, mma_rows: str = "heads") -> MLAKernelConfig:
    """The launch of the split kernel in form ``mma_rows`` (Numerics.mla_mma_rows), a function of the model
    dims only. The latent columns are processed in 4 chunks (Dc = 512: 128 columns) for the score dot and for
    ``p @ c_kv``, with one fp32 accumulator per chunk, so that no [64, Dc] tile is ever live (a whole 64 x 512
    tile plus the accumulators spills registers).

    heads: BLOCK_H = 32 heads per program (the MMA's M) when the model has that many (H = 64 gives 2 head
    groups that read the same keys, the second mostly from L2), else the head count rounded up to a power of
    two (at least 16, the MMA minimum); 8 warps, 3 pipeline stages. The launch sweeps behind it (H = 64,
    Dc = 512, bf16 cache; decode at batch 256 / 8K and a 4096-token prefill; every configuration gave the same
    bits): benchmarks/results/2026-12-01_mla_sweep_h200.json (32 heads x 8 warps fastest at both),
    2026-12-02_mla_split_loop_h200.json (two stages once the loop lost its branch), 2026-12-06_mla_sweep_heads_
    stages_df24418_h100.json (three stages: decode 0.959 -> 0.909 ms per layer, prefill 10.50 -> 10.46 ms, equal
    bits). Its sm_90 build (Triton 3.9) has no spill (`python benchmarks/kernel_resources.py --kernels mla`).

    keys: the key block (64) is the warpgroup MMA's M and the program's heads its N, the query's columns
    resident in shared memory. 32 heads x 4 warps x 2 stages, the fastest of the launch sweep on an H100
    (benchmarks/results/2026-12-06_h100_mla_keys_summary.md: 0.92 ms per decode layer at batch 256 x 8K, 9.7 ms
    for a 4096-token prefill, against 0.96 / 10.4 ms for the heads form; 16 heads took 1.33 / 14.0 ms) although
    its sm_90 build (Triton 3.9) spills 472 B per thread (16 heads x 4 warps: none)."""
    del dr  # fixed per latent width
    dc_p = max(16, _next_pow2(dc))
    small = dc_p <= 128
    block_h = min(32, max(16, _next_pow2(num_heads)))
    warps = 4 if small or mma_rows == "keys" else 8
    stages = 1 if small else 2 if mma_rows == "keys" else 3
    if _LAUNCH_OVERRIDE:
        block_h, warps, stages = _LAUNCH_OVERRIDE[-1]
    n_chunks = 1 if small else 4
    return MLAKernelConfig(block_h=block_h, n_chunks=n_chunks, chunk=dc_p // n_chunks, num_warps=warps,
                           num_stages=stages)


@triton.jit
def _qk_part(s, q_ptr, qh_ptr, ql_ptr, q_off, hmask, row, valid,
             COL: tl.constexpr, W: tl.constexpr, LIM: tl.constexpr, SPLIT_BF16: tl.constexpr, LO: tl.constexpr):
    """s += q[:, COL:COL+W] @ k[:, COL:COL+W]^T (columns >= LIM are padding: exact zeros); the lo half's product
    too with LO (``Numerics.mla_operands`` "hi_lo")."""
    offs = COL + tl.arange(0, W)
    cm = offs < LIM
    qm = hmask[:, None] & cm[None, :]
    # Masked keys load as exact zeros: uninitialised slots (inf/NaN) never reach a product.
    k = tl.load(row[:, None] + offs[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
    if SPLIT_BF16:
        kt = tl.trans(k)
        s = tl.dot(tl.load(qh_ptr + q_off[:, None] + offs[None, :], mask=qm, other=0.0), kt, s)
        if LO:
            s = tl.dot(tl.load(ql_ptr + q_off[:, None] + offs[None, :], mask=qm, other=0.0), kt, s)
    else:
        q = tl.load(q_ptr + q_off[:, None] + offs[None, :], mask=qm, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), s, input_precision="tf32x3")
    return s


@triton.jit
def _pv_part(acc, p_hi, p_lo, row, valid, COL: tl.constexpr, W: tl.constexpr, LIM: tl.constexpr,
             SPLIT_BF16: tl.constexpr, LO: tl.constexpr):
    """acc += p @ c_kv[:, COL:COL+W] (p as ``_softmax_block`` returns it: bf16 halves, or fp32 in p_hi)."""
    offs = COL + tl.arange(0, W)
    cm = offs < LIM
    c = tl.load(row[:, None] + offs[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
    if SPLIT_BF16:
        acc = tl.dot(p_hi, c, acc)
        if LO:
            acc = tl.dot(p_lo, c, acc)
    else:
        acc = tl.dot(p_hi, c.to(tl.float32), acc, input_precision="tf32x3")
    return acc


@triton.jit
def _store_part(ptr, rows, rmask, x, COL: tl.constexpr, W: tl.constexpr, LIM: tl.constexpr,
                KEYS_ROWS: tl.constexpr):
    """Columns COL..COL+W of ``rows`` (each LIM wide) from x: [rows, W], or [W, rows] for the keys-rows form."""
    offs = COL + tl.arange(0, W)
    if KEYS_ROWS:
        tl.store(ptr + rows[None, :] * LIM + offs[:, None], x, mask=rmask[None, :] & (offs < LIM)[:, None])
    else:
        tl.store(ptr + rows[:, None] * LIM + offs[None, :], x, mask=rmask[:, None] & (offs < LIM)[None, :])


@triton.jit
def _softmax_block(s, valid, m_i, l_i, scale, KEY_AXIS: tl.constexpr, SPLIT_BF16: tl.constexpr, LO: tl.constexpr):
    """One key block of the online softmax over scores ``s`` whose keys run along KEY_AXIS (1: [heads, keys],
    0: [keys, heads]); returns p as the value operand of ``p @ c_kv`` (hi, lo), the rescale alpha of the running
    sums, the new max and the new sum (of the fp32 p). The operand: with SPLIT_BF16 the bf16 halves of p (lo
    unused unless LO), else p in fp32 (rounded to bf16 values unless LO: ``Numerics.mla_operands`` "bf16")."""
    valid_s = tl.expand_dims(valid, 1 - KEY_AXIS)
    s = s * scale
    s = tl.where(valid_s, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=KEY_AXIS))
    # An unchanged maximum rescales by exactly 1 (whatever the approximate exp gives at 0), so a block
    # without a valid entry (a hole in a key list: m_new == m_i, p == 0) is an exact no-op.
    alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - m_new))
    p = tl.where(valid_s, tl.exp(s - tl.expand_dims(m_new, KEY_AXIS)), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=KEY_AXIS)
    if SPLIT_BF16:
        p_hi = p.to(tl.bfloat16)
        if LO:
            p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
        else:
            p_lo = p_hi
    elif LO:
        p_hi = p
        p_lo = p
    else:
        p_hi = p.to(tl.bfloat16).to(tl.float32)
        p_lo = p_hi
    return p_hi, p_lo, alpha, m_new, l_i


@triton.jit
def _store_result(out_ptr, m_ptr, l_ptr, acc_ptr, q_rows, qi, sp, num_splits, H, offs_h, hmask, m_i, l_i,
                  acc0, acc1, acc2, acc3, KC: tl.constexpr, NCH: tl.constexpr, DC: tl.constexpr,
                  DIRECT: tl.constexpr, KEYS_ROWS: tl.constexpr):
    """DIRECT: o = acc / l into the output rows (a query without a valid key gets zeros: acc == 0, l == 0 ->
    0 / 1). Else the split's partial: m, l and acc (acc not for an empty split: the combine never reads it)."""
    if DIRECT:
        l_safe = tl.expand_dims(tl.where(l_i > 0, l_i, 1.0), 0 if KEYS_ROWS else 1)
        _store_part(out_ptr, q_rows, hmask, acc0 / l_safe, 0, KC, DC, KEYS_ROWS)
        if NCH > 1:
            _store_part(out_ptr, q_rows, hmask, acc1 / l_safe, KC, KC, DC, KEYS_ROWS)
            _store_part(out_ptr, q_rows, hmask, acc2 / l_safe, 2 * KC, KC, DC, KEYS_ROWS)
            _store_part(out_ptr, q_rows, hmask, acc3 / l_safe, 3 * KC, KC, DC, KEYS_ROWS)
    else:
        part = (qi * num_splits + sp) * H + offs_h
        tl.store(m_ptr + part, m_i, mask=hmask)
        tl.store(l_ptr + part, l_i, mask=hmask)
        amask = hmask & (m_i > float("-inf"))
        _store_part(acc_ptr, part, amask, acc0, 0, KC, DC, KEYS_ROWS)
        if NCH > 1:
            _store_part(acc_ptr, part, amask, acc1, KC, KC, DC, KEYS_ROWS)
            _store_part(acc_ptr, part, amask, acc2, 2 * KC, KC, DC, KEYS_ROWS)
            _store_part(acc_ptr, part, amask, acc3, 3 * KC, KC, DC, KEYS_ROWS)


@triton.jit
def _block_slots(first, offs_n, kp_ptr, qi, kp_stride, L, end, bt_ptr, seq, bt_stride, page_size, qpos,
                 DENSE: tl.constexpr, SLOT_LIST: tl.constexpr):
    """The key block at list index ``first``: which entries are valid, and their cache slots (0 if not).
    SLOT_LIST: the list holds cache slots already (``key_slots``), one load instead of a list entry and then its
    page, the same slots."""
    j = first + offs_n  # list index (sparse) == absolute position (dense)
    if DENSE:
        pos = j.to(tl.int64)
        valid = pos <= qpos
    else:
        pos = tl.load(kp_ptr + qi * kp_stride + j, mask=(j < L) & (j < end), other=-1)
        valid = pos >= 0
    if SLOT_LIST:
        return valid, tl.where(valid, pos, 0).to(tl.int64)
    return valid, _slot_of(pos, valid, bt_ptr, seq, bt_stride, page_size)


@triton.jit
def _slot_of(pos, valid, bt_ptr, seq, bt_stride, page_size):
    """The cache slots of positions ``pos`` of sequence ``seq`` through its block table (0 where not valid)."""
    # Positions fit int32; a 32-bit division is far cheaper than a 64-bit one.
    pos_c = tl.where(valid, pos, 0).to(tl.int32)
    page = tl.load(bt_ptr + seq * bt_stride + pos_c // page_size, mask=valid, other=0)
    return page.to(tl.int64) * page_size + pos_c % page_size


@triton.jit(do_not_specialize=["L", "kp_stride", "bt_stride", "page_size"])
def _key_slots_kernel(kp_ptr, bt_ptr, seq_ptr, out_ptr, L, kp_stride, bt_stride, page_size, BLOCK: tl.constexpr):
    """out[q, j] = the cache slot of key list entry kp[q, j] (int32; -1 for a -1 entry)."""
    await_previous_kernel()
    qi = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = j < L
    pos = tl.load(kp_ptr + qi * kp_stride + j, mask=inside, other=-1)
    valid = pos >= 0
    slot = _slot_of(pos, valid, bt_ptr, tl.load(seq_ptr + qi), bt_stride, page_size)
    tl.store(out_ptr + qi * L + j, tl.where(valid, slot, -1).to(tl.int32), mask=inside)


def key_slots(key_positions: torch.Tensor, block_table: torch.Tensor, seq_idx: torch.Tensor,
              page_size: int) -> torch.Tensor:
    """The cache slot of every key list entry, ``[Q, L]`` int32 (-1 where the list has -1): what the split kernel
    computes per block from the list and the block table, once per launch (``SLOT_LIST``). int64 inputs."""
    nq, width = key_positions.shape
    out = torch.empty((nq, width), dtype=torch.int32, device=key_positions.device)
    if nq and width:
        block = min(1024, _next_pow2(width))
        _key_slots_kernel[(nq, cdiv(width, block))](
            key_positions, block_table, seq_idx, out, width, key_positions.stride(0), block_table.stride(0),
            page_size, BLOCK=block, num_warps=4, **pdl())
    return out


@triton.jit
def _split_extent(qi, sp, kp_ptr, kp_stride, L, qpos_ptr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                  DENSE: tl.constexpr):
    """Split ``sp`` of query ``qi``: its first list index (dense: position), the query's position (dense; 0
    otherwise, unused) and how many key blocks the loop visits (<= 0: an empty split). A sparse split's
    loop ends at its last valid entry: trailing -1 padding is never visited."""
    start = sp * SPLIT
    if DENSE:
        qpos = tl.load(qpos_ptr + qi)
        n_keys = tl.minimum(qpos + 1 - start, SPLIT)
    else:
        qpos = 0
        offs_s = tl.arange(0, SPLIT)
        jj = start + offs_s
        kp_split = tl.load(kp_ptr + qi * kp_stride + jj, mask=jj < L, other=-1)
        n_keys = tl.max(tl.where(kp_split >= 0, offs_s + 1, 0), axis=0)
    return start, qpos, tl.cdiv(n_keys, BLOCK_N)


@triton.jit
def _program_coords(num_splits, N_HG: tl.constexpr):
    """(query, head group, split) of a split-kernel program: program id ``(query * N_HG + head group) *
    num_splits + split``. A query's splits and head groups are adjacent programs, so they run side by side:
    the head groups gather the same key rows (the second reads them from L2 rather than HBM; with the head
    groups on their own grid dim, a query's second group ran a whole grid row after its first, long after its
    rows had left L2), and the last split to finish finds the others' partials in L2 when it combines them
    (FUSED_COMBINE). Scheduling only: every program computes what it computed before."""
    pid = tl.program_id(0).to(tl.int64)
    group = pid // num_splits
    return group // N_HG, (group % N_HG).to(tl.int32), (pid % num_splits).to(tl.int32)


# Integers that vary with the batch or the cache layout are not specialised (Triton would otherwise
# compile a variant per "divisible by 16" / "== 1" value): one compiled kernel per model shape.
@triton.jit(do_not_specialize=["H", "page_size", "bt_stride", "kp_stride", "L", "num_splits"])
def _mla_split_kernel(
    q_ptr, qh_ptr, ql_ptr, kv_ptr, bt_ptr, seq_ptr, kp_ptr, qpos_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
    scale, H, page_size, bt_stride, kp_stride, L, num_splits,
    DC: tl.constexpr, DR: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr, DR_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DENSE: tl.constexpr, DIRECT: tl.constexpr, SPLIT_BF16: tl.constexpr, N_HG: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, SLOT_LIST: tl.constexpr = False, LO: tl.constexpr = True,
):
    await_previous_kernel()
    qi, hg, sp = _program_coords(num_splits, N_HG)
    D: tl.constexpr = DC + DR

    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = qi * H + offs_h
    q_off = q_rows * D  # q = [q_lat | q_pe] rows of D values (fp32, or its bf16 hi/lo halves)

    seq = tl.load(seq_ptr + qi)
    start, qpos, n_blocks = _split_extent(qi, sp, kp_ptr, kp_stride, L, qpos_ptr, SPLIT, BLOCK_N, DENSE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, KC], tl.float32)
    acc1 = tl.zeros([BLOCK_H, KC], tl.float32)
    acc2 = tl.zeros([BLOCK_H, KC], tl.float32)
    acc3 = tl.zeros([BLOCK_H, KC], tl.float32)
    # The cache rows of block 0; each iteration looks up the next block's rows before it computes, so the
    # dependent index loads (list entry -> page -> slot) overlap the block's MMAs.
    valid, slot = _block_slots(start, offs_n, kp_ptr, qi, kp_stride, L, start + SPLIT, bt_ptr, seq, bt_stride,
                               page_size, qpos, DENSE, SLOT_LIST)
    for blk in range(0, n_blocks):
        row = kv_ptr + slot * D
        valid_next, slot_next = _block_slots(start + (blk + 1) * BLOCK_N, offs_n, kp_ptr, qi, kp_stride, L,
                                             start + SPLIT, bt_ptr, seq, bt_stride, page_size, qpos, DENSE,
                                             SLOT_LIST)
        # Scores: latent chunks in ascending column order, then the rope columns.
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        s = _qk_part(s, q_ptr, qh_ptr, ql_ptr, q_off, hmask, row, valid, 0, KC, DC, SPLIT_BF16, LO)
        if NCH > 1:
            s = _qk_part(s, q_ptr, qh_ptr, ql_ptr, q_off, hmask, row, valid, KC, KC, DC, SPLIT_BF16, LO)
            s = _qk_part(s, q_ptr, qh_ptr, ql_ptr, q_off, hmask, row, valid, 2 * KC, KC, DC, SPLIT_BF16, LO)
            s = _qk_part(s, q_ptr, qh_ptr, ql_ptr, q_off, hmask, row, valid, 3 * KC, KC, DC, SPLIT_BF16, LO)
        if DR > 0:
            s = _qk_part(s, q_ptr, qh_ptr, ql_ptr, q_off, hmask, row, valid, DC, DR_P, D, SPLIT_BF16, LO)
        p_hi, p_lo, alpha, m_new, l_i = _softmax_block(s, valid, m_i, l_i, scale, 1, SPLIT_BF16, LO)
        acc0 = _pv_part(acc0 * alpha[:, None], p_hi, p_lo, row, valid, 0, KC, DC, SPLIT_BF16, LO)
        if NCH > 1:
            acc1 = _pv_part(acc1 * alpha[:, None], p_hi, p_lo, row, valid, KC, KC, DC, SPLIT_BF16, LO)
            acc2 = _pv_part(acc2 * alpha[:, None], p_hi, p_lo, row, valid, 2 * KC, KC, DC, SPLIT_BF16, LO)
            acc3 = _pv_part(acc3 * alpha[:, None], p_hi, p_lo, row, valid, 3 * KC, KC, DC, SPLIT_BF16, LO)
        m_i = m_new
        valid = valid_next
        slot = slot_next

    _store_result(out_ptr, m_ptr, l_ptr, acc_ptr, q_rows, qi, sp, num_splits, H, offs_h, hmask, m_i, l_i,
                  acc0, acc1, acc2, acc3, KC, NCH, DC, DIRECT, False)
    if FUSED_COMBINE:
        _combine_if_last(m_ptr, l_ptr, acc_ptr, out_ptr, cnt_ptr, qi, hg, num_splits, H, offs_h, hmask,
                         DC, KC, NCH, BLOCK_H, N_HG)


@triton.jit
def _q_cols_t(q_ptr, qh_ptr, ql_ptr, q_off, hmask, COL: tl.constexpr, W: tl.constexpr, LIM: tl.constexpr,
              SPLIT_BF16: tl.constexpr, LO: tl.constexpr):
    """Columns COL..COL+W of the program's query rows, transposed ([W, heads]): the bf16 (hi, lo) halves (hi twice
    unless LO), or the fp32 query twice. Loaded once, before the key loop: the tiles stay in shared memory for
    every block's MMA."""
    offs = COL + tl.arange(0, W)
    qm = (offs < LIM)[:, None] & hmask[None, :]
    if SPLIT_BF16:
        hi = tl.load(qh_ptr + q_off[None, :] + offs[:, None], mask=qm, other=0.0)
        if LO:
            lo = tl.load(ql_ptr + q_off[None, :] + offs[:, None], mask=qm, other=0.0)
        else:
            lo = hi
    else:
        hi = tl.load(q_ptr + q_off[None, :] + offs[:, None], mask=qm, other=0.0)
        lo = hi
    return hi, lo


@triton.jit
def _qk_part_keys_rows(s_t, q_hi, q_lo, row, valid, COL: tl.constexpr, W: tl.constexpr, LIM: tl.constexpr,
                       SPLIT_BF16: tl.constexpr, LO: tl.constexpr):
    """s^T += k[:, COL:COL+W] @ q[:, COL:COL+W]^T: keys on the MMA's rows, heads on its columns, the query's
    columns (``_q_cols_t``) resident. Returns the key tile too (its latent columns are the values of
    ``p @ c_kv``)."""
    offs = COL + tl.arange(0, W)
    k = tl.load(row[:, None] + offs[None, :], mask=valid[:, None] & (offs < LIM)[None, :], other=0.0)
    if SPLIT_BF16:
        s_t = tl.dot(k, q_hi, s_t)
        if LO:
            s_t = tl.dot(k, q_lo, s_t)
    else:
        s_t = tl.dot(k.to(tl.float32), q_hi, s_t, input_precision="tf32x3")
    return s_t, k


@triton.jit
def _pv_part_keys_rows(acc_t, p_hi, p_lo, c, SPLIT_BF16: tl.constexpr, LO: tl.constexpr):
    """acc^T += c^T @ p^T: latent columns on the MMA's rows, heads on its columns (p as ``_pv_part`` takes it)."""
    c_t = tl.trans(c)
    if SPLIT_BF16:
        acc_t = tl.dot(c_t, p_hi, acc_t)
        if LO:
            acc_t = tl.dot(c_t, p_lo, acc_t)
    else:
        acc_t = tl.dot(c_t.to(tl.float32), p_hi, acc_t, input_precision="tf32x3")
    return acc_t


# The split kernel with the products transposed (Numerics.mla_mma_rows = "keys"): s^T = k @ q^T and
# acc^T = c_kv^T @ p^T, so the MMA's rows are the 64 keys of a block (scores) and the latent columns (values)
# and its columns the BLOCK_H heads. Hopper's warpgroup MMA needs 64 rows per warpgroup, which the heads
# of a program (32) are not: this form runs wgmma where the other runs mma.sync, and the key tile each
# block loads is read by the hardware as it is (no per-warp copy of the query operand). The steps, their
# order and the softmax are those of ``_mla_split_kernel`` (read its comments), on transposed tiles.
@triton.jit(do_not_specialize=["H", "page_size", "bt_stride", "kp_stride", "L", "num_splits"])
def _mla_split_kernel_keys_rows(
    q_ptr, qh_ptr, ql_ptr, kv_ptr, bt_ptr, seq_ptr, kp_ptr, qpos_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
    scale, H, page_size, bt_stride, kp_stride, L, num_splits,
    DC: tl.constexpr, DR: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr, DR_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DENSE: tl.constexpr, DIRECT: tl.constexpr, SPLIT_BF16: tl.constexpr, N_HG: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, SLOT_LIST: tl.constexpr = False, LO: tl.constexpr = True,
):
    await_previous_kernel()
    qi, hg, sp = _program_coords(num_splits, N_HG)
    D: tl.constexpr = DC + DR
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = qi * H + offs_h
    q_off = q_rows * D
    seq = tl.load(seq_ptr + qi)
    start, qpos, n_blocks = _split_extent(qi, sp, kp_ptr, kp_stride, L, qpos_ptr, SPLIT, BLOCK_N, DENSE)
    # The query's columns, once: the MMA reads them from shared memory in every block (not reloaded per block).
    qh0, ql0 = _q_cols_t(q_ptr, qh_ptr, ql_ptr, q_off, hmask, 0, KC, DC, SPLIT_BF16, LO)
    qh1, ql1 = _q_cols_t(q_ptr, qh_ptr, ql_ptr, q_off, hmask, KC, KC, DC, SPLIT_BF16, LO)
    qh2, ql2 = _q_cols_t(q_ptr, qh_ptr, ql_ptr, q_off, hmask, 2 * KC, KC, DC, SPLIT_BF16, LO)
    qh3, ql3 = _q_cols_t(q_ptr, qh_ptr, ql_ptr, q_off, hmask, 3 * KC, KC, DC, SPLIT_BF16, LO)
    qhr, qlr = _q_cols_t(q_ptr, qh_ptr, ql_ptr, q_off, hmask, DC, DR_P, D, SPLIT_BF16, LO)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([KC, BLOCK_H], tl.float32)
    acc1 = tl.zeros([KC, BLOCK_H], tl.float32)
    acc2 = tl.zeros([KC, BLOCK_H], tl.float32)
    acc3 = tl.zeros([KC, BLOCK_H], tl.float32)
    valid, slot = _block_slots(start, offs_n, kp_ptr, qi, kp_stride, L, start + SPLIT, bt_ptr, seq, bt_stride,
                               page_size, qpos, DENSE, SLOT_LIST)
    for blk in range(0, n_blocks):
        row = kv_ptr + slot * D
        valid_next, slot_next = _block_slots(start + (blk + 1) * BLOCK_N, offs_n, kp_ptr, qi, kp_stride, L,
                                             start + SPLIT, bt_ptr, seq, bt_stride, page_size, qpos, DENSE,
                                             SLOT_LIST)
        s_t = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
        s_t, c0 = _qk_part_keys_rows(s_t, qh0, ql0, row, valid, 0, KC, DC, SPLIT_BF16, LO)
        if NCH > 1:
            s_t, c1 = _qk_part_keys_rows(s_t, qh1, ql1, row, valid, KC, KC, DC, SPLIT_BF16, LO)
            s_t, c2 = _qk_part_keys_rows(s_t, qh2, ql2, row, valid, 2 * KC, KC, DC, SPLIT_BF16, LO)
            s_t, c3 = _qk_part_keys_rows(s_t, qh3, ql3, row, valid, 3 * KC, KC, DC, SPLIT_BF16, LO)
        if DR > 0:
            s_t, _ = _qk_part_keys_rows(s_t, qhr, qlr, row, valid, DC, DR_P, D, SPLIT_BF16, LO)
        p_hi, p_lo, alpha, m_new, l_i = _softmax_block(s_t, valid, m_i, l_i, scale, 0, SPLIT_BF16, LO)
        acc0 = _pv_part_keys_rows(acc0 * alpha[None, :], p_hi, p_lo, c0, SPLIT_BF16, LO)
        if NCH > 1:
            acc1 = _pv_part_keys_rows(acc1 * alpha[None, :], p_hi, p_lo, c1, SPLIT_BF16, LO)
            acc2 = _pv_part_keys_rows(acc2 * alpha[None, :], p_hi, p_lo, c2, SPLIT_BF16, LO)
            acc3 = _pv_part_keys_rows(acc3 * alpha[None, :], p_hi, p_lo, c3, SPLIT_BF16, LO)
        m_i = m_new
        valid = valid_next
        slot = slot_next

    _store_result(out_ptr, m_ptr, l_ptr, acc_ptr, q_rows, qi, sp, num_splits, H, offs_h, hmask, m_i, l_i,
                  acc0, acc1, acc2, acc3, KC, NCH, DC, DIRECT, True)
    if FUSED_COMBINE:
        _combine_if_last(m_ptr, l_ptr, acc_ptr, out_ptr, cnt_ptr, qi, hg, num_splits, H, offs_h, hmask,
                         DC, KC, NCH, BLOCK_H, N_HG)


def split_kernel_for(mma_rows: str):
    """The split kernel of a form of ``Numerics.mla_mma_rows``."""
    return {"heads": _mla_split_kernel, "keys": _mla_split_kernel_keys_rows}[mma_rows]


@triton.jit
def _split_weight(m_j, m):
    """A split's weight in the combine, exp(m_j - M): exactly 1 for the split holding the maximum (not whatever the
    approximate exp gives at 0, so a single non-empty split passes through bit for bit, as the direct path), 0 for
    an empty split (m_j = -inf)."""
    has = m_j > float("-inf")
    return tl.where(m_j == m, 1.0, tl.where(has, tl.exp(m_j - tl.where(has, m, 0.0)), 0.0))


@triton.jit
def _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, qi, num_splits, H, offs_h, hmask,
                    DC: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr, BLOCK_H: tl.constexpr):
    """o = (sum_j acc_j w_j) / (sum_j l_j w_j) for the heads ``offs_h`` of query ``qi`` (``_split_weight``; splits in
    ascending order, each sum sequential from 0, a query without a valid key gets zeros), the latent columns in
    NCH chunks of KC: each element's arithmetic is its own, so the chunking changes no bit. Loads go through L2
    (``.cg``), never a stale L1 line: in the split kernel the partials were written by other programs."""
    base = qi * num_splits * H + offs_h  # partial (query, split, head) at (qi * num_splits + split) * H + head
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for sp in range(0, num_splits):
        m = tl.maximum(m, tl.load(m_ptr + base + sp * H, mask=hmask, other=float("-inf"), cache_modifier=".cg"))
    l = tl.zeros([BLOCK_H], tl.float32)
    for sp in range(0, num_splits):  # ascending split order
        w = _split_weight(tl.load(m_ptr + base + sp * H, mask=hmask, other=float("-inf"), cache_modifier=".cg"), m)
        l = l + tl.load(l_ptr + base + sp * H, mask=hmask, other=0.0, cache_modifier=".cg") * w
    l_safe = tl.where(l > 0, l, 1.0)
    for ch in tl.static_range(NCH):
        offs_c = ch * KC + tl.arange(0, KC)
        cmask = offs_c < DC
        acc = tl.zeros([BLOCK_H, KC], tl.float32)
        for sp in range(0, num_splits):  # ascending split order
            part = base + sp * H
            m_j = tl.load(m_ptr + part, mask=hmask, other=float("-inf"), cache_modifier=".cg")
            a_j = tl.load(acc_ptr + part[:, None] * DC + offs_c[None, :],
                          mask=(m_j > float("-inf"))[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg")
            acc = acc + a_j * _split_weight(m_j, m)[:, None]
        tl.store(out_ptr + (qi * H + offs_h)[:, None] * DC + offs_c[None, :], acc / l_safe[:, None],
                 mask=hmask[:, None] & cmask[None, :])


@triton.jit
def _combine_if_last(m_ptr, l_ptr, acc_ptr, out_ptr, cnt_ptr, qi, hg, num_splits, H, offs_h, hmask,
                     DC: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr, BLOCK_H: tl.constexpr,
                     N_HG: tl.constexpr):
    """FUSED_COMBINE: the last of a (query, head group)'s split programs to finish (``last_to_arrive``) combines
    the splits (``_combine_splits``, what ``_mla_combine_kernel`` computes). Which program combines depends on
    timing; what it computes does not."""
    group = qi * N_HG + hg
    if last_to_arrive(cnt_ptr, group, num_splits):
        _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, qi, num_splits, H, offs_h, hmask, DC, KC, NCH, BLOCK_H)
        reset_arrivals(cnt_ptr, group)


@triton.jit(do_not_specialize=["H", "num_splits"])
def _mla_combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, H, num_splits,
    DC: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The splits' combine as its own launch, one program per (query, head group): the two-launch form of
    FUSED_COMBINE (``ZMRL_MLA_FUSED_COMBINE=0``, or a launch captured before any eager one)."""
    await_previous_kernel()
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0).to(tl.int64), num_splits, H, offs_h, offs_h < H,
                    DC, KC, NCH, BLOCK_H)


@triton.jit
def _split_query_kernel(ql_ptr, qr_ptr, hi_ptr, lo_ptr, n_rows, H, sl_t, sl_h, sr_t, sr_h, scale,
                        DC: tl.constexpr, DR: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, ROWS: tl.constexpr,
                        LO: tl.constexpr):
    """Rows (t, h) of ``q = [q_lat | q_pe] * scale`` (any strides over t and h, unit stride over columns) as the
    bf16 pair hi = bf16(q), lo = bf16(q - hi) (``LO``; else hi alone), q in fp32: the same roundings as torch's
    ``to`` (round to nearest even; q - hi is exact in fp32). ``scale`` 1.0 leaves q as it is."""
    await_previous_kernel()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < n_rows
    t = (rows // H).to(tl.int64)
    hh = (rows % H).to(tl.int64)
    out_row = rows.to(tl.int64)[:, None] * (DC + DR)
    cc = tl.arange(0, BC)
    m = rm[:, None] & (cc < DC)[None, :]
    q = tl.load(ql_ptr + (t * sl_t + hh * sl_h)[:, None] + cc[None, :], mask=m, other=0.0).to(tl.float32) * scale
    hi = q.to(tl.bfloat16)
    tl.store(hi_ptr + out_row + cc[None, :], hi, mask=m)
    if LO:
        tl.store(lo_ptr + out_row + cc[None, :], (q - hi.to(tl.float32)).to(tl.bfloat16), mask=m)
    if DR > 0:
        cr = tl.arange(0, BR)
        m = rm[:, None] & (cr < DR)[None, :]
        q = tl.load(qr_ptr + (t * sr_t + hh * sr_h)[:, None] + cr[None, :], mask=m, other=0.0).to(tl.float32) * scale
        hi = q.to(tl.bfloat16)
        tl.store(hi_ptr + out_row + DC + cr[None, :], hi, mask=m)
        if LO:
            tl.store(lo_ptr + out_row + DC + cr[None, :], (q - hi.to(tl.float32)).to(tl.bfloat16), mask=m)


def split_query(q_lat: torch.Tensor, q_pe: torch.Tensor, scale: float = 1.0,
                lo: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q = [q_lat | q_pe] * scale`` in fp32 [T, H, Dc + Dr] as its bf16 halves ``(hi, lo)`` with hi = bf16(q),
    lo = bf16(q - hi) (None unless ``lo``): bitwise the torch composition ``q.to(bf16)``,
    ``(q - hi.float()).to(bf16)``, in one pass that reads q_lat and q_pe where they are (strided views) instead
    of materialising q in fp32. The forward takes both halves at scale 1 (q * 1.0 is q); the backward's bf16
    path takes the scaled hi half."""
    nq, h, dc = q_lat.shape
    dr = q_pe.shape[-1]
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    hi = torch.empty((nq, h, dc + dr), dtype=torch.bfloat16, device=q_lat.device)
    lo_t = torch.empty_like(hi) if lo else None
    n = nq * h
    if n:
        bc, br = max(16, _next_pow2(dc)), max(16, _next_pow2(dr))
        rows = max(1, 4096 // bc)
        _split_query_kernel[(cdiv(n, rows),)](
            q_lat, q_pe, hi, lo_t if lo_t is not None else hi, n, h, q_lat.stride(0), q_lat.stride(1),
            q_pe.stride(0), q_pe.stride(1), float(scale), DC=dc, DR=dr, BC=bc, BR=br, ROWS=rows, LO=lo, num_warps=4,
               **pdl(),
           )
    return hi, lo_t


def _mla_forward(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_idx: torch.Tensor, key_positions: torch.Tensor | None, query_pos: torch.Tensor | None,
                 softmax_scale: float, kv_lora_rank: int, kv_len: int | None = None) -> torch.Tensor:
    """Launch the split kernel (+ combine). Exactly one of key_positions (sparse) / query_pos (dense).

    Dense: the causal width is ``kv_len`` when given (no host read), else max(query_pos) + 1."""
    _check_shapes(q_lat, q_pe, kv_cache, kv_lora_rank)
    dense = key_positions is None
    nq, h, dc = q_lat.shape
    dr = q_pe.shape[-1]
    num_pages, page_size, d = kv_cache.shape
    dev = q_lat.device
    # Every element is written: by the split kernel (DIRECT) or by the combine, a query without a valid
    # key as zeros.
    out = torch.empty((nq, h, dc), dtype=torch.float32, device=dev)
    if nq == 0:
        return out
    kv = kv_cache.detach().contiguous().reshape(num_pages * page_size, d)
    if kv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"mla_attention (triton): unsupported cache dtype {kv.dtype}")
    split_bf16 = kv.dtype == torch.bfloat16 and not _INTERPRET
    lo = mla_operands() == "hi_lo"
    # q = [q_lat | q_pe] in rows of D values: for bf16 caches its bf16 hi + lo halves (hi alone unless lo;
    # elementwise roundings: each query's halves depend on that query alone), else fp32 (bf16 values unless lo).
    if split_bf16:
        q_hi, q_lo = split_query(q_lat.detach(), q_pe.detach(), lo=lo)
        q = q_hi  # unused by the kernel
        q_lo = q_hi if q_lo is None else q_lo
    else:
        q = torch.cat([q_lat.detach().to(torch.float32), q_pe.detach().to(torch.float32)], dim=-1).contiguous()
        if not lo:
            q = q.to(torch.bfloat16).to(torch.float32)
        q_hi = q_lo = q  # unused
    bt = block_table.to(torch.int64).contiguous()
    sidx = seq_idx.to(torch.int64).contiguous()
    slot_list = SLOT_LIST and not dense and num_pages * page_size < 2**31  # slots stored as int32
    if dense:
        qpos = query_pos.to(torch.int64).contiguous()
        width = key_width(qpos, kv_len)
        kp = qpos  # unused by the dense kernel; any int64 pointer
        kp_stride = 0
    else:
        kp = key_positions.to(torch.int64).contiguous()
        qpos = sidx  # unused by the sparse kernel
        width = kp.shape[1]
        if slot_list:
            kp = key_slots(kp, bt, sidx, page_size)
        kp_stride = kp.stride(0) if kp.dim() == 2 and kp.shape[0] else 0
    num_splits = max(1, cdiv(width, SPLIT_KEYS))
    form = mla_mma_rows()
    cfg = kernel_config(h, dc, dr, form)
    split_kernel = split_kernel_for(form)
    n_hg = cdiv(h, cfg.block_h)
    consts = dict(DC=dc, DR=dr, KC=cfg.chunk, NCH=cfg.n_chunks, DR_P=max(16, _next_pow2(dr)),
                  BLOCK_H=cfg.block_h, BLOCK_N=KEY_BLOCK, SPLIT=SPLIT_KEYS, DENSE=dense,
                  SPLIT_BF16=split_bf16, LO=lo, N_HG=n_hg, SLOT_LIST=slot_list, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    scale = float(softmax_scale)
    if num_splits == 1:
        # The one split is the whole list: write o directly (bitwise what the combine would give).
        split_kernel[(nq * n_hg,)](
            q, q_hi, q_lo, kv, bt, sidx, kp, qpos, out, out, out, out, bt,
            scale, h, page_size, bt.stride(0), kp_stride, width, 1, DIRECT=True, FUSED_COMBINE=False, **consts,
            **pdl())
        return out
    # Chunk the queries so the fp32 partials stay below PARTIAL_BYTES (never changes a query's bits).
    per_query = num_splits * h * dc * 4
    chunk = max(1, PARTIAL_BYTES // per_query)
    m_buf = torch.empty((min(chunk, nq), num_splits, h), dtype=torch.float32, device=dev)
    l_buf = torch.empty_like(m_buf)
    acc_buf = torch.empty((min(chunk, nq), num_splits, h, dc), dtype=torch.float32, device=dev)
    for c0 in range(0, nq, chunk):
        c1 = min(nq, c0 + chunk)
        n = c1 - c0
        qpos_c = qpos[c0:c1] if dense else qpos
        kp_c = kp[c0:c1] if not dense else kp
        counters = arrival_counters(dev, n * n_hg) if FUSED_COMBINE else None
        split_kernel[(n * n_hg * num_splits,)](
            q[c0:c1], q_hi[c0:c1], q_lo[c0:c1], kv, bt, sidx[c0:c1], kp_c, qpos_c, out[c0:c1], m_buf, l_buf, acc_buf,
            counters if counters is not None else bt, scale, h, page_size, bt.stride(0), kp_stride, width, num_splits,
            DIRECT=False, FUSED_COMBINE=counters is not None, **consts, **pdl())
        if counters is None:
            _mla_combine_kernel[(n, n_hg)](
                m_buf, l_buf, acc_buf, out[c0:c1], h, num_splits,
                DC=dc, KC=cfg.chunk, NCH=cfg.n_chunks, BLOCK_H=cfg.block_h,
                num_warps=8 if cfg.chunk * cfg.n_chunks >= 512 else 4, **pdl())
    return out


# ----------------------------------------------------------------------------- backward
# ``mla_attention_grads`` (kernels_batch_invariant/mla_attention_grads.py): dense GEMMs over each query
# chunk's unique keys, deterministic.


class _MLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_lat, q_pe, kv_cache, block_table, seq_idx, key_positions, query_pos,  # type: ignore[override]
                softmax_scale, kv_lora_rank, kv_len=None):
        out = _mla_forward(q_lat, q_pe, kv_cache, block_table, seq_idx, key_positions, query_pos,
                           softmax_scale, kv_lora_rank, kv_len)
        # the output too: the backward's delta = rowsum(dO * o) comes from it (the op after MLA keeps it for its
        # own backward when it has LoRA, so this holds no extra memory there)
        ctx.save_for_backward(q_lat, q_pe, kv_cache, block_table, seq_idx,
                              key_positions if key_positions is not None else query_pos, out)
        ctx.dense = key_positions is None
        ctx.softmax_scale, ctx.kv_lora_rank, ctx.kv_len = softmax_scale, kv_lora_rank, kv_len
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q_lat, q_pe, kv_cache, block_table, seq_idx, kp, out = ctx.saved_tensors
        if ctx.dense:
            kp = _dense_list(kp, ctx.kv_len)
        need = tuple(ctx.needs_input_grad[:3])
        g = mla_attention_grads(grad_out, q_lat, q_pe, kv_cache, block_table, seq_idx, kp,
                                ctx.softmax_scale, ctx.kv_lora_rank, need, out)  # type: ignore[arg-type]
        return (*g, None, None, None, None, None, None, None)


def _dense_list(query_pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
    qp = query_pos.to(torch.int64)
    width = key_width(qp, kv_len)
    cols = torch.arange(width, dtype=torch.int64, device=qp.device).unsqueeze(0)
    return torch.where(cols <= qp.unsqueeze(-1), cols, torch.full_like(cols, -1))


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


@mla_attention.register("triton")
def mla_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_idx: torch.Tensor, key_positions: torch.Tensor,
                         softmax_scale: float, kv_lora_rank: int, kv_len: int | None = None) -> torch.Tensor:
    """Sparse absorbed MLA over explicit key lists (see the module docstring). The list width is
    static, so the launch never reads a device value; ``kv_len`` changes nothing here."""
    if q_lat.dtype == torch.float64:  # float64 (gradchecks) keeps the torch backend's fp64 contract
        return mla_attention.impls["torch"](q_lat, q_pe, kv_cache, block_table, seq_idx, key_positions,
                                            softmax_scale, kv_lora_rank, kv_len=kv_len)
    if _needs_grad(q_lat, q_pe, kv_cache):
        return _MLAFunction.apply(q_lat, q_pe, kv_cache, block_table, seq_idx, key_positions, None,
                                  softmax_scale, kv_lora_rank, None)
    return _mla_forward(q_lat, q_pe, kv_cache, block_table, seq_idx, key_positions, None,
                        softmax_scale, kv_lora_rank)


@mla_attention_dense.register("triton")
def mla_attention_dense_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_idx: torch.Tensor, query_pos: torch.Tensor,
                               softmax_scale: float, kv_lora_rank: int, kv_len: int | None = None) -> torch.Tensor:
    """Causal absorbed MLA walking positions 0..query_pos directly; bitwise the sparse kernel with the
    key list 0..query_pos. With ``kv_len``: cdiv(kv_len, SPLIT_KEYS) splits, no host read, same bits."""
    if q_lat.dtype == torch.float64:
        return mla_attention_dense.impls["torch"](q_lat, q_pe, kv_cache, block_table, seq_idx, query_pos,
                                                  softmax_scale, kv_lora_rank, kv_len=kv_len)
    if _needs_grad(q_lat, q_pe, kv_cache):
        return _MLAFunction.apply(q_lat, q_pe, kv_cache, block_table, seq_idx, None, query_pos,
                                  softmax_scale, kv_lora_rank, kv_len)
    return _mla_forward(q_lat, q_pe, kv_cache, block_table, seq_idx, None, query_pos,
                        softmax_scale, kv_lora_rank, kv_len)
