"""Chunked KDA (Kimi Delta Attention) forward, batch-invariant, torch backend.

Math: the token recurrence of docs/model.md (KDA) in chunked WY form, chunk C = 64; contract:
docs/numerics.md (KDA).

Sequences are packed varlen (``cu_seqlens``); every sequence segment starts at an absolute chunk
boundary, so its chunks are rows [0, 64), [64, 128), ... of the segment. All chunks of all
sequences and heads are laid out as one batch ``[C*H, 64, d]`` (pad rows = 0) and processed at
once; only the state recurrence runs chunk index by chunk index (vectorised over sequences).

Why row r of a chunk is bitwise the same whether rows > r are real (training/prefill) or zero
padding (decode re-running the current chunk):

* the within-chunk cumsum of g is an explicit scan, row by row;
* A_kk / A_qk are built per 16-row sub-block: off-diagonal blocks as one fixed-shape product
  factored through the decay at the block's first row (both exponents <= 0, so no overflow: the
  naive exp(gc_i) * exp(-gc_j) overflows once the in-chunk decay passes ~88), diagonal blocks
  from masked exponent differences reduced with ``tree_sum``: entry (i, j) depends on rows
  <= i only;
* the triangular solve ``(I + A_kk) X = diag(beta) [exp(gc) * K | V]`` is blocked the same way
  (one fixed-shape product with the solved rows before the block, then row-by-row substitution
  inside it), so row i never sees rows > i;
* the remaining products are ``bmm_fixed`` with per-(chunk, head) shapes fixed by the model
  ([64, dk] @ [dk, dv], [64, 64] @ [64, dv], [dk, 64] @ [64, dv]); row r of such a product reads
  row r of the left operand and, through exact zeros, nothing of rows > r.

The state advances only through complete chunks; a trailing partial chunk is evaluated (its rows
are returned) but the returned state is the one at its start. Everything is fp32 (fp64 when the
inputs are fp64, for gradcheck).

``kda_chunk_step`` (end of this file) is the fixed-shape decode entry for CUDA graphs: every sequence
brings exactly one 64-row chunk with a device tensor of real-row counts, and gets kda_chunk's bits
for that partial chunk (the argument above) with no host reads.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from .._dispatch import invariant_op
from ..matmul import bmm_fixed
from ..reduce import tree_sum

log = logging.getLogger(__name__)

CHUNK_SIZE = 64
# Under autograd, recompute the intra-chunk part in backward instead of keeping its per-row
# intermediates (about 64 * T * H * (3*dk + dv) floats: ~0.5-1 GB for 2048 tokens at H=4,
# dk=dv=64). The recomputation is the same deterministic code, so values are unchanged.
CHECKPOINT_INTRA = True


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Layout:
    """Where each sequence's chunks sit in the chunk batch (all index tensors on CPU)."""

    lens: list[int]
    n_chunks: list[int]  # ceil(len / 64)
    n_complete: list[int]  # len // 64
    chunk_start: list[int]  # first chunk id of each sequence (packed order)
    complete_start: list[int]  # first complete-chunk id of each sequence (packed order)
    tok_idx: torch.Tensor  # [C, 64] token feeding (chunk, row); T for pad rows
    tok_pos: torch.Tensor  # [T] flat (chunk * 64 + row) position of each token
    n_rows: int  # most real rows in any chunk (row loops may stop there)

    @property
    def total_chunks(self) -> int:
        return sum(self.n_chunks)


def packed_lengths(cu_seqlens: torch.Tensor, total: int) -> tuple[list[int], list[int]]:
    """(cu_seqlens as a list, the sequence lengths) after checking they describe ``total`` packed tokens (a host
    read: every backend's packed forward needs the lengths on the host)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lens) or (cu and cu[-1] != total) or (cu and cu[0] != 0):
        raise ValueError(f"kda_chunk: cu_seqlens {cu} does not describe {total} packed tokens")
    return cu, lens


def _layout(cu_seqlens: torch.Tensor, total: int) -> _Layout:
    c = CHUNK_SIZE
    cu, lens = packed_lengths(cu_seqlens, total)
    n_chunks = [(n + c - 1) // c for n in lens]
    n_complete = [n // c for n in lens]
    chunk_start, complete_start, acc, acc_c = [], [], 0, 0
    for nc, ncc in zip(n_chunks, n_complete):
        chunk_start.append(acc)
        complete_start.append(acc_c)
        acc += nc
        acc_c += ncc
    seq_of_chunk = torch.tensor([s for s, nc in enumerate(n_chunks) for _ in range(nc)], dtype=torch.int64)
    local_chunk = torch.tensor([j for nc in n_chunks for j in range(nc)], dtype=torch.int64)
    pos = local_chunk[:, None] * c + torch.arange(c)[None, :]  # position inside the sequence
    lens_t = torch.tensor(lens, dtype=torch.int64)
    starts_t = torch.tensor(cu[:-1], dtype=torch.int64)
    valid = pos < lens_t[seq_of_chunk][:, None]
    tok_idx = torch.where(valid, starts_t[seq_of_chunk][:, None] + pos, total)
    # Chunks are in packed order and rows ascend, so the valid slots in row-major order are the
    # tokens 0..T-1 in order.
    tok_pos = valid.reshape(-1).nonzero().squeeze(1)
    n_rows = max([min(c, n - j * c) for n, nc in zip(lens, n_chunks) for j in range(nc)], default=0)
    return _Layout(lens, n_chunks, n_complete, chunk_start, complete_start, tok_idx, tok_pos, n_rows)


def _to_chunks(x: torch.Tensor, lay: _Layout, cdt: torch.dtype) -> torch.Tensor:
    """[T, H, d] -> [C*H, 64, d] (chunk-major, head-minor), pad rows exactly 0."""
    t, h, d = x.shape
    xz = torch.cat([x.to(cdt), x.new_zeros(1, h, d, dtype=cdt)], dim=0)
    xc = xz[lay.tok_idx.to(x.device)]  # [C, 64, H, d]
    return xc.permute(0, 2, 1, 3).reshape(-1, CHUNK_SIZE, d)


def _scan_rows(g: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum over dim 1 as an explicit left-to-right scan (row r = rows 0..r only)."""
    acc = g[:, 0]
    rows = [acc]
    for r in range(1, g.shape[1]):
        acc = acc + g[:, r]
        rows.append(acc)
    return torch.stack(rows, dim=1)


SUB = 8  # sub-block size of the intra-chunk products


def _intra_chunk(
    qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """State-independent part of every chunk.

    qc (already scaled), kc, gc (cumulative log-decay): [CH, 64, dk]; vc: [CH, 64, dv];
    bc: [CH, 64, 1]. Returns (A_qk [CH, 64, 64] lower incl. diagonal, W [CH, 64, dk],
    U [CH, 64, dv]) with X = [W | U] = (I + A_kk)^-1 diag(beta) [exp(gc) * K | V].

    The chunk is cut into 16-row sub-blocks. Entries of an off-diagonal block (I, J < I) factor
    through the decay at the first row ``r`` of block I: exp(gc_i - gc_j) = exp(gc_i - gc_r) *
    exp(gc_r - gc_j), both exponents <= 0 (no overflow), and the block is one fixed-shape
    ``bmm_fixed`` product, so entry (i, j) is a function of rows i, j and r <= i alone. Diagonal
    blocks use masked exponent differences reduced with ``tree_sum``. The solve is blocked the same
    way: a block's right-hand side subtracts one fixed-shape product with the already solved rows
    before it, then rows are substituted one by one inside the block. Row i therefore never reads
    rows > i, which is what lets decode re-run a partial chunk and get the full chunk's bits.
    Rows >= n_rows (padding in every chunk) are returned as zeros.
    """
    c, dk = CHUNK_SIZE, kc.shape[-1]
    ch = qc.shape[0]
    rhs = bc * torch.cat([torch.exp(gc) * kc, vc], dim=-1)  # [CH, 64, dk+dv]
    tri_incl = torch.ones(SUB, SUB, dtype=torch.bool, device=kc.device).tril()
    tri_strict = tri_incl.tril(-1)
    n_blocks = -(-n_rows // SUB)
    a_qk_blocks: list[torch.Tensor] = []
    x_blocks: list[torch.Tensor] = []
    for blk in range(n_blocks):
        lo, hi = blk * SUB, (blk + 1) * SUB
        g_i, q_i, k_i, b_i = gc[:, lo:hi], qc[:, lo:hi], kc[:, lo:hi], bc[:, lo:hi]
        # Diagonal block: exp(gc_i - gc_j) masked before exp (exact zeros above the diagonal).
        diff = g_i[:, :, None, :] - g_i[:, None, :, :]  # [CH, 16(i), 16(j), dk]
        dec = torch.exp(torch.where(tri_incl[:, :, None], diff, float("-inf")))
        kj_dec = k_i[:, None, :, :] * dec
        qk_diag = tree_sum(q_i[:, :, None, :] * kj_dec, dim=-1)  # [CH, 16, 16]
        kk_diag = torch.where(tri_strict, tree_sum(k_i[:, :, None, :] * kj_dec, dim=-1), 0.0) * b_i
        rhs_blk = rhs[:, lo:hi]
        if blk:
            g_ref = g_i[:, :1]  # decay at the block's first row
            left = torch.exp(g_i - g_ref)  # <= 1
            right = kc[:, :lo] * torch.exp(g_ref - gc[:, :lo])  # <= 1
            right_t = right.transpose(1, 2)
            qk_off = bmm_fixed(q_i * left, right_t)  # [CH, 16, lo]
            kk_off = bmm_fixed(k_i * left, right_t) * b_i
            a_qk_blocks.append(torch.cat([qk_off, qk_diag, qk_diag.new_zeros(ch, SUB, c - hi)], dim=-1))
            rhs_blk = rhs_blk - bmm_fixed(kk_off, torch.cat(x_blocks, dim=1))
        else:
            a_qk_blocks.append(torch.cat([qk_diag, qk_diag.new_zeros(ch, SUB, c - hi)], dim=-1))
        rows: list[torch.Tensor] = [rhs_blk[:, 0]]
        for r in range(1, min(SUB, n_rows - lo)):
            solved = torch.stack(rows, dim=1)  # [CH, r, E]
            rows.append(rhs_blk[:, r] - bmm_fixed(kk_diag[:, r : r + 1, :r], solved).squeeze(1))
        x_blk = torch.stack(rows, dim=1)
        if x_blk.shape[1] < SUB:
            x_blk = torch.cat([x_blk, x_blk.new_zeros(ch, SUB - x_blk.shape[1], x_blk.shape[-1])], dim=1)
        x_blocks.append(x_blk)
    a_qk = torch.cat(a_qk_blocks, dim=1)
    x = torch.cat(x_blocks, dim=1)
    if a_qk.shape[1] < c:
        a_qk = torch.cat([a_qk, a_qk.new_zeros(ch, c - a_qk.shape[1], c)], dim=1)
        x = torch.cat([x, x.new_zeros(ch, c - x.shape[1], x.shape[-1])], dim=1)
    return a_qk, x[..., :dk], x[..., dk:]


def _permute_back(parts: list[torch.Tensor], ids: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-step results and put row k at position ids[k] (ids are a permutation)."""
    cat = torch.cat(parts, dim=0)
    order = torch.argsort(torch.cat(ids))
    return cat[order.to(cat.device)]


@invariant_op
def kda_chunk(
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
    """Chunked KDA over packed varlen sequences.

    q, k: [T, H, dk] (already L2-normalised); v: [T, H, dv]; g: [T, H, dk] per-token log-decay;
    beta: [T, H]; cu_seqlens: [N+1] int64; initial_state: [N, H, dk, dv] (None = zeros);
    scale: multiplies q (default dk^-0.5).

    Returns (o [T, H, dv] in v.dtype,
             final_state [N, H, dk, dv] fp32: state after each sequence's last COMPLETE chunk,
             chunk_states [complete chunks, H, dk, dv] fp32 in packed order, or None).
    """
    cdt = _compute_dtype(q.dtype)
    t, h, dk = q.shape
    dv = v.shape[-1]
    n = cu_seqlens.numel() - 1
    scale = dk**-0.5 if scale is None else scale
    dev = q.device
    lay = _layout(cu_seqlens, t)
    if initial_state is None:
        s_cur = torch.zeros(n, h, dk, dv, dtype=cdt, device=dev)
    else:
        s_cur = initial_state.to(cdt)
    n_complete_total = sum(lay.n_complete)
    if lay.total_chunks == 0:
        empty = s_cur.new_zeros(0, h, dk, dv)
        return v.new_zeros(0, h, dv), s_cur, (empty if output_chunk_states else None)

    qc = _to_chunks(q, lay, cdt) * scale
    kc = _to_chunks(k, lay, cdt)
    vc = _to_chunks(v, lay, cdt)
    gc = _scan_rows(_to_chunks(g, lay, cdt))
    bc = _to_chunks(beta.unsqueeze(-1), lay, cdt)

    if CHECKPOINT_INTRA and torch.is_grad_enabled() and any(x.requires_grad for x in (qc, kc, vc, gc, bc)):
        a_qk, w, u = checkpoint(_intra_chunk, qc, kc, vc, gc, bc, lay.n_rows, use_reentrant=False)
    else:
        a_qk, w, u = _intra_chunk(qc, kc, vc, gc, bc, lay.n_rows)
    q_dec = qc * torch.exp(gc)  # inter-chunk read-out weights
    g_last = gc[:, -1]  # [CH, dk]
    k_decT = (torch.exp(g_last[:, None, :] - gc) * kc).transpose(1, 2).contiguous()  # [CH, dk, 64]
    s_decay = torch.exp(g_last).unsqueeze(-1)  # [CH, dk, 1]

    def per_chunk(x: torch.Tensor, cid: torch.Tensor) -> torch.Tensor:
        """[CH, ...] -> the rows of chunks ``cid``: [len(cid)*H, ...]."""
        return x.view(-1, h, *x.shape[1:])[cid].reshape(-1, *x.shape[1:])

    o_parts, o_ids, st_parts, st_ids = [], [], [], []
    for c in range(max(lay.n_chunks)):
        act = [s for s in range(n) if lay.n_chunks[s] > c]
        cid = torch.tensor([lay.chunk_start[s] + c for s in act], dtype=torch.int64, device=dev)
        s_in = s_cur[torch.tensor(act, dtype=torch.int64, device=dev)].reshape(-1, dk, dv)
        v_e = per_chunk(u, cid) - bmm_fixed(per_chunk(w, cid), s_in)  # [A*H, 64, dv]
        o_c = bmm_fixed(per_chunk(q_dec, cid), s_in) + bmm_fixed(per_chunk(a_qk, cid), v_e)
        o_parts.append(o_c.view(len(act), h, CHUNK_SIZE, dv))
        o_ids.append(cid.cpu())
        done = [i for i, s in enumerate(act) if lay.n_complete[s] > c]
        if not done:
            continue
        # Only complete chunks advance the state; a trailing partial chunk leaves it at its start.
        sel = torch.tensor(done, dtype=torch.int64, device=dev)
        cid_done = cid[sel]
        s_prev = s_in.view(len(act), h, dk, dv)[sel].reshape(-1, dk, dv)
        v_e_done = v_e.view(len(act), h, CHUNK_SIZE, dv)[sel].reshape(-1, CHUNK_SIZE, dv)
        s_next = per_chunk(s_decay, cid_done) * s_prev + bmm_fixed(per_chunk(k_decT, cid_done), v_e_done)
        s_next = s_next.view(len(done), h, dk, dv)
        seqs_done = [act[i] for i in done]
        s_cur = s_cur.index_copy(0, torch.tensor(seqs_done, dtype=torch.int64, device=dev), s_next)
        if output_chunk_states:
            st_parts.append(s_next)
            st_ids.append(torch.tensor([lay.complete_start[s] + c for s in seqs_done], dtype=torch.int64))

    o_all = _permute_back(o_parts, o_ids)  # [C, H, 64, dv]
    o = o_all.permute(0, 2, 1, 3).reshape(-1, h, dv)[lay.tok_pos.to(dev)]
    chunk_states = None
    if output_chunk_states:
        chunk_states = _permute_back(st_parts, st_ids) if st_parts else s_cur.new_zeros(0, h, dk, dv)
        assert chunk_states.shape[0] == n_complete_total
    return o.to(v.dtype), s_cur, chunk_states


# --------------------------------------------------------------------------------------- fast backend


@functools.lru_cache(maxsize=1)
def _fla_chunk_kda() -> Callable[..., Any] | None:
    """fla-core's ``chunk_kda`` when importable (imported lazily: importing fla is slow and needs
    a GPU-capable triton)."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # ImportError, or fla failing to initialise its backends
        log.info("fla-core chunk_kda unavailable (%s): kda_chunk 'fast' falls back to the bitwise path", exc)
        return None
    return chunk_kda


def _fallback(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The bitwise path for what the fast path cannot do: Triton on CUDA, else the torch composition."""
    q = args[0]
    # The Triton impl registers itself only where triton is importable (kernels_batch_invariant/triton).
    impl = kda_chunk.impls.get("triton") if q.device.type == "cuda" else None
    return (impl or kda_chunk.impls["torch"])(*args, **kwargs)


@kda_chunk.register("fast")
def kda_chunk_fast(
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
    """fla-core ``chunk_kda`` (not batch-invariant; for measuring what bitwise mode costs).

    Semantics kept: outputs for every token, and ``final_state`` = the state after each sequence's
    last COMPLETE chunk (what the engine stores; it re-feeds the trailing partial chunk as pending
    rows on the next call). fla's own final state runs through the partial chunk too, so each
    sequence is split in two fla calls: its complete-chunk prefix (giving the boundary state in
    fp32), then its tail (< 64 rows) started from that state. Differences from the bitwise path:

    * the arithmetic differs (fla stores A and per-chunk states in bf16, and its intra-chunk
      solve is not row-invariant), so a decode re-run of a partial chunk does not reproduce the
      prefill rows bitwise — fast mode gives up the zero-mismatch contract by design;
    * ``output_chunk_states=True`` (prefix-cache snapshots) is delegated to the bitwise path: fla
      exposes per-chunk states only in bf16 and only under ``inference_mode``;
    * q, k, v, beta are cast to one dtype (v's when bf16/fp16, else fp32) for fla's tl.dot; g
      stays fp32.

    Falls back to the bitwise path (Triton on CUDA, torch elsewhere) when fla-core is missing, on
    CPU tensors, and for fp64 inputs.
    """
    args = (q, k, v, g, beta, cu_seqlens, initial_state, scale, output_chunk_states)
    if q.device.type != "cuda" or q.dtype == torch.float64 or output_chunk_states:
        return _fallback(*args)
    chunk_kda = _fla_chunk_kda()
    if chunk_kda is None:
        return _fallback(*args)
    t, h, dk = q.shape
    dv = v.shape[-1]
    n = cu_seqlens.numel() - 1
    dev = q.device
    c = CHUNK_SIZE
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    full = [n_ // c * c for n_ in lens]
    dt = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    qx, kx, vx, bx = (x.to(dt) for x in (q, k, v, beta))
    gx = g.to(torch.float32)
    h0 = (torch.zeros(n, h, dk, dv, dtype=torch.float32, device=dev) if initial_state is None
          else initial_state.to(torch.float32))
    o = v.new_empty(t, h, dv)

    def run(seqs: list[int], spans: list[tuple[int, int]], init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(dev)
        seg_cu = torch.tensor([0] + [b - a for a, b in spans], dtype=torch.int64).cumsum(0)
        out, st = chunk_kda(qx[idx][None], kx[idx][None], vx[idx][None], gx[idx][None], bx[idx][None],
                            scale=scale, initial_state=init.contiguous(), output_final_state=True,
                            cu_seqlens=seg_cu.to(dev), cu_seqlens_cpu=seg_cu)
        return idx, out[0], st

    final = h0
    pre = [s for s in range(n) if full[s] > 0]
    if pre:
        idx, out, st = run(pre, [(cu[s], cu[s] + full[s]) for s in pre], h0[pre])
        o = o.index_copy(0, idx, out.to(o.dtype))
        final = final.index_copy(0, torch.tensor(pre, device=dev), st)
    tail = [s for s in range(n) if lens[s] > full[s]]
    if tail:
        idx, out, _ = run(tail, [(cu[s] + full[s], cu[s + 1]) for s in tail], final[tail])
        o = o.index_copy(0, idx, out.to(o.dtype))
    return o, final, None


# --------------------------------------------------------------------------------------- decode step


def _check_step_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     num_rows: torch.Tensor, state: torch.Tensor) -> tuple[int, int, int, int]:
    """Shape / dtype / device checks of ``kda_chunk_step`` from host metadata only (no device reads);
    returns (N, H, dk, dv)."""
    c = CHUNK_SIZE
    if q.dim() != 4 or q.shape[1] != c:
        raise ValueError(f"kda_chunk_step: q must be [N, {c}, H, dk], got {tuple(q.shape)}")
    n, _, h, dk = q.shape
    if (k.shape != q.shape or g.shape != q.shape or v.dim() != 4 or v.shape[:3] != (n, c, h)
            or beta.shape != (n, c, h)):
        raise ValueError(f"kda_chunk_step: bad shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"g{tuple(g.shape)} beta{tuple(beta.shape)}")
    dv = v.shape[-1]
    if state.shape != (n, h, dk, dv):
        raise ValueError(f"kda_chunk_step: state {tuple(state.shape)} != {(n, h, dk, dv)}")
    if num_rows.shape != (n,) or num_rows.dtype.is_floating_point or num_rows.dtype.is_complex \
            or num_rows.dtype == torch.bool:
        raise ValueError(f"kda_chunk_step: num_rows must be an integer [N={n}] tensor, got "
                         f"{num_rows.dtype} {tuple(num_rows.shape)}")
    if num_rows.device != q.device:
        # A host tensor here would be a per-call host->device copy (not capturable in a CUDA graph).
        raise ValueError(f"kda_chunk_step: num_rows is on {num_rows.device}, q on {q.device}")
    if num_rows.device.type == "cpu" and n and not bool(((num_rows >= 1) & (num_rows <= c)).all()):
        # Checked on CPU only: on a GPU this would be a host sync.
        raise ValueError(f"kda_chunk_step: num_rows must be in 1..{c}, got {num_rows.tolist()}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, state)):
        raise RuntimeError("kda_chunk_step is a decode-only forward without autograd: call it under "
                           "torch.no_grad() / torch.inference_mode() (the trainer uses kda_chunk)")
    return n, h, dk, dv


@invariant_op
def kda_chunk_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_rows: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-shape decode entry: each sequence's current chunk, re-run from its boundary state.

    q, k, g: [N, 64, H, dk]; v: [N, 64, H, dv]; beta: [N, 64, H]; num_rows: [N] integer tensor on
    the inputs' device, values in 1..64 (the real rows of each chunk); state: [N, H, dk, dv], the
    state at each chunk's start; scale as in ``kda_chunk`` (default dk^-0.5).

    Returns (o [N, 64, H, dv] in v.dtype, next_state [N, H, dk, dv] fp32). Row r < num_rows[i] of
    o[i] is bitwise the row ``kda_chunk`` returns for sequence i's num_rows[i]-row segment
    (``cu_seqlens = [0, num_rows[i]]``, ``initial_state = state[i]``) on the same backend; rows
    >= num_rows[i] are exact zeros. next_state[i] is bitwise ``kda_chunk``'s final state of that
    segment: the state advanced through the chunk when num_rows[i] == 64, else ``state[i]``.

    Input rows >= num_rows[i] are ignored (masked to zero here, masked loads in the Triton kernel),
    so the caller's pad rows may hold anything. Shapes are fixed by (N, H, dk, dv) and nothing is
    read back to the host (on the GPU: no sync, every table built on the device), so the Triton
    backend can be captured in a CUDA graph. Values of num_rows outside 0..64 are clamped there
    (unchecked on the GPU, where a check would sync; 0 = an empty chunk: zeros, state unchanged).

    Why the bits equal ``kda_chunk``'s, which builds the same [H, 64, d] zero-padded chunk batch
    (see the module docstring): the intra-chunk part here always runs all 64 rows (``n_rows = 64``)
    where ``kda_chunk`` stops at the segment's ``r`` real rows, but entry (i, j) of A_qk, A_kk and
    row i of the solve X depend on rows <= i only (explicit scan for gc, per-16-row-block products
    of fixed shape, row-by-row substitution), so rows < r are the same arithmetic on the same
    values; the extra rows >= r computed here are built from all-zero inputs, so they (and their
    rows of U, W, v_e) are (signed) zeros, exactly what ``kda_chunk`` pads with. Every remaining
    product is a ``bmm_fixed`` of per-(chunk, head) shape fixed by the model dims, whose row i
    reads row i of the left operand and, through exact zeros (A_qk[i, j > i] = 0), nothing from the
    right operand's rows > i that could change a nonzero sum. The batch is N*H (chunk, head) pairs
    instead of H; ``bmm_fixed`` and the elementwise ops are batch-invariant (docs/numerics.md), and the
    operands are laid out contiguously exactly as ``kda_chunk``'s per-chunk gathers lay them out.
    The state advance is computed for every sequence and selected with ``torch.where(num_rows ==
    64, next, state)``: for a partial chunk the returned state is ``state``'s bits.

    No autograd (decode runs under no_grad); raises if an input requires grad while grad is on.
    """
    n, h, dk, dv = _check_step_args(q, k, v, g, beta, num_rows, state)
    c = CHUNK_SIZE
    cdt = _compute_dtype(q.dtype)
    scale = dk**-0.5 if scale is None else scale
    dev = q.device
    s_in = state.to(cdt).contiguous()
    if n == 0:
        return v.new_zeros(0, c, h, dv), s_in.clone()
    rows_n = num_rows.clamp(0, c)
    live = (torch.arange(c, device=dev)[None, :] < rows_n[:, None])[:, :, None, None]  # [N, 64, 1, 1]

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """[N, 64, H, d] -> [N*H, 64, d] (sequence-major, head-minor), rows >= num_rows exactly 0:
        the layout and values ``_to_chunks`` gives one sequence, for all sequences at once."""
        x = torch.where(live, x.to(cdt), 0.0)
        return x.permute(0, 2, 1, 3).reshape(-1, c, x.shape[-1])

    qc = chunks(q) * scale
    kc = chunks(k)
    vc = chunks(v)
    gc = _scan_rows(chunks(g))
    bc = chunks(beta.unsqueeze(-1))
    a_qk, w, u = _intra_chunk(qc, kc, vc, gc, bc, c)
    # kda_chunk reads these through per-chunk gathers (contiguous copies); the same layout here.
    w, u = w.contiguous(), u.contiguous()
    q_dec = qc * torch.exp(gc)
    g_last = gc[:, -1]
    k_decT = (torch.exp(g_last[:, None, :] - gc) * kc).transpose(1, 2).contiguous()
    s_decay = torch.exp(g_last).unsqueeze(-1)
    s_flat = s_in.reshape(-1, dk, dv)
    v_e = u - bmm_fixed(w, s_flat)
    o_c = bmm_fixed(q_dec, s_flat) + bmm_fixed(a_qk, v_e)
    s_next = s_decay * s_flat + bmm_fixed(k_decT, v_e)
    full = (rows_n == c).view(n, 1, 1, 1)
    next_state = torch.where(full, s_next.view(n, h, dk, dv), s_in)
    o = torch.where(live, o_c.view(n, h, c, dv).permute(0, 2, 1, 3), 0.0)
    return o.to(v.dtype).contiguous(), next_state


@kda_chunk_step.register("fast")
def kda_chunk_step_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_rows: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """'fast' mode has no stock kernel for the fixed-shape step: it runs the bitwise path (Triton on
    CUDA where registered, the torch composition elsewhere), which is capturable either way."""
    impl = kda_chunk_step.impls.get("triton") if q.device.type == "cuda" else None
    return (impl or kda_chunk_step.impls["torch"])(q, k, v, g, beta, num_rows, state, scale)
