"""Backward of the absorbed MLA attention (sparse key lists or causal), as dense GEMMs over the keys a
query chunk touches.

The forward (``mla_attention`` / ``mla_attention_dense``) gives every query its own key list. The
straightforward backward gathers those keys per query ([G, L, D]: 2048 x 576 values per query at the
bench shape) and scatters the key gradients back with a sort-based deterministic ``index_add``,
which is memory-bound and runs its products on fp32 CUDA cores. Here a chunk of G consecutive
queries works on the union of their keys instead (``u``: the sorted unique cache slots, at most the
chunk's sequence length for trainer batches): scores ``q @ K_u^T`` [G*H, U] are one GEMM, the
per-query key lists become a boolean mask over U, and every other product (``o``, ``dP``, ``dQ``,
``dK_u``) is one GEMM too. The key gradient lands on unique slots, so a plain ``index_add_`` is
exact and deterministic. The dense products do at most ~2x the sparse FLOPs (U <= 2 L for
sequences up to twice the top-k) but on tensor cores: the fp32 products run at the numerics
contract's ``backward_matmul_precision`` on CUDA (TF32 by default: bf16 operands are exact in TF32, fp32
ones, such as the absorbed queries, are rounded to 2^-11 relative; the bf16 weights the gradients flow to
round to 2^-8).

The chunks' unions are found together (``chunk_unions``: one sort of every entry keyed by its chunk, one host
sync for up to ``UNION_ENTRIES`` entries) rather than by a ``torch.unique`` per chunk, whose host sync drained
the GPU's queue once per 512 queries.

Everything is deterministic run to run: a sort of distinct integer keys' runs, constant-value ``scatter_``,
fixed-shape GEMMs, ``index_add_`` onto distinct rows, chunks in ascending order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backward_gemms import fp32_out_gemms, mm_f32
from .mla_attention import cache_slots
from .numerics import backward_matmuls, current_numerics

# Elements of one [G, H, U] fp32 buffer per chunk. ``_chunk_grads`` holds at most three of them at a
# time (scores/probabilities and their gradient, updated in place), so chunks are as large as memory
# allows: each chunk costs a fixed set of launches.
CHUNK_ELEMS = 1 << 27
# Key-list entries whose unions one ``chunk_unions`` call finds (one sort, one host sync for all of their
# chunks; ~40 bytes of transient buffers per entry). The union sizes must reach the host (they shape the
# chunk's GEMMs): found chunk by chunk (``torch.unique``) that was a sync per 512 queries, 128 per bench
# trainer step, each one draining the GPU's queue.
UNION_ENTRIES = 1 << 24
# A chunk's key count is padded to a multiple of this (16-byte-aligned bf16 and fp32 rows: _chunk_keys).
KEY_PAD = 8


def mla_attention_grads(grad_out: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_idx: torch.Tensor, key_positions: torch.Tensor,
                        softmax_scale: float, kv_lora_rank: int, need: tuple[bool, bool, bool],
                        out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``o = softmax(scale * q . k) @ c`` w.r.t. q_lat [T, H, Dc], q_pe [T, H, Dr] and
    kv_cache [pages, page_size, Dc + Dr], given grad_out [T, H, Dc] and each query's key positions
    [T, L] (-1 = no key; positions index the query's sequence ``seq_idx`` through ``block_table``).
    ``need`` says which of the three are wanted; the others come back as None. ``out``: the forward's output o
    [T, H, Dc], if the caller kept it: delta = rowsum(dO * o) is taken from it; without it each chunk forms o from
    its probabilities, one [G*H, U] x [U, Dc] GEMM more."""
    nq, h, dc = q_lat.shape
    num_pages, page_size, d = kv_cache.shape
    dev = q_lat.device
    cdt = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    if out is not None and out.dtype != cdt:
        out = None  # an fp32 output is coarser than a float64 backward's own P C
    flat = kv_cache.detach().reshape(num_pages * page_size, d)
    kp = key_positions.to(torch.int64)
    width = max(1, kp.shape[1])
    # Every chunk writes its rows of the query gradients (a chunk without keys zeroes them), so they
    # are not zero-filled here; the key gradient is accumulated into, so it is.
    # the bf16 path (backward_matmul_precision="bf16") and its stages, decided once per call
    bf16_stages = (_bf16_stages(dev) if cdt == torch.float32 and current_numerics().backward_matmul_precision == "bf16"
                   and fp32_out_gemms(dev) else None)
    if bf16_stages is not None and (need[0] or need[1]):
        # one [T, H, Dc + Dr] buffer that dQ's single GEMM writes; the two query gradients are its column views
        g_q = torch.empty((nq, h, d), dtype=cdt, device=dev)
        g_ql, g_qr = (g_q[..., :dc] if need[0] else None), (g_q[..., dc:] if need[1] else None)
    else:
        g_q = None
        g_ql = torch.empty((nq, h, dc), dtype=cdt, device=dev) if need[0] else None
        g_qr = torch.empty((nq, h, d - dc), dtype=cdt, device=dev) if need[1] else None
    g_kv = torch.zeros((num_pages * page_size, d), dtype=cdt, device=dev) if need[2] else None
    # U is typically <= 2 L for trainer batches (a chunk's keys come from one or two sequences).
    chunk = max(1, CHUNK_ELEMS // (h * 2 * width))
    # Invalid entries get a sentinel slot past every real one: a chunk's union then ends with it, and each
    # entry's index into the union is its key column, U for "no key".
    sentinel = num_pages * page_size
    with backward_matmuls(dev):
        c0 = 0
        while c0 < nq:
            # the chunks of one union call: whole chunks, at least one
            c_end = min(nq, c0 + max(chunk, (UNION_ENTRIES // width) // chunk * chunk))
            slots, valid = cache_slots(block_table, seq_idx[c0:c_end], kp[c0:c_end], page_size)
            unions = chunk_unions(torch.where(valid, slots, sentinel), chunk, sentinel)
            if any(n > 1 and n * h * (u.numel() - 1) > 2 * CHUNK_ELEMS
                   for n, (u, _) in zip(_chunk_sizes(c_end - c0, chunk), unions)):
                chunk = max(1, chunk // 2)  # keys spread wider than expected: smaller chunks
                continue
            for i, (u, inv) in enumerate(unions):
                a, b = c0 + i * chunk, min(c_end, c0 + (i + 1) * chunk)
                n_u = u.numel() - 1
                q_rows = [None if t is None else t[a:b] for t in (g_ql, g_qr, g_q)]
                if n_u == 0:  # no query of the chunk has a key: output 0, gradients 0
                    _zero(*(q_rows[2:] if g_q is not None else q_rows[:2]))  # (g_ql, g_qr are views of g_q)
                    continue
                args = (grad_out[a:b], q_lat[a:b], q_pe[a:b], flat, u[:n_u], inv, softmax_scale, dc)
                o = None if out is None else out[a:b]
                if bf16_stages is None:
                    _chunk_grads(*args, *q_rows[:2], g_kv, cdt, o)
                else:
                    _chunk_grads_bf16(*args, q_rows[2], g_kv, bf16_stages, o)
            c0 = c_end
    return (None if g_ql is None else g_ql.to(q_lat.dtype),
            None if g_qr is None else g_qr.to(q_pe.dtype),
            None if g_kv is None else g_kv.view(num_pages, page_size, d).to(kv_cache.dtype))


def _chunk_sizes(rows: int, chunk: int) -> list[int]:
    return [min(chunk, rows - c) for c in range(0, rows, chunk)]


def chunk_unions(keyed: torch.Tensor, chunk: int, sentinel: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For consecutive chunks of ``chunk`` rows of ``keyed`` [G, L] (cache slots in [0, sentinel), ``sentinel``
    for "no key"): per chunk ``(u, inv)`` as ``torch.unique(cat([chunk's entries, [sentinel]]), sorted=True,
    return_inverse=True)`` gives them, ``inv`` without the appended entry's and shaped [rows, L]: the chunk's
    sorted distinct slots with ``sentinel`` last, and each entry's index into them.

    One sort over all the chunks (each entry keyed by its chunk first), so the union sizes reach the host in one
    sync for all of them instead of one per chunk."""
    rows, width = keyed.shape
    n_chunks = max(1, -(-rows // chunk))
    dev = keyed.device
    span = sentinel + 1
    # 32-bit keys where they fit: half the bytes, and half the radix passes of the sort
    kdt = torch.int32 if n_chunks * span < 2**31 else torch.int64
    chunk_of_row = torch.arange(rows, device=dev, dtype=kdt) // chunk
    ends = torch.arange(n_chunks, device=dev, dtype=kdt)
    # every chunk's entries and one sentinel, keyed chunk-major: sorted, the chunks follow each other
    keys = torch.cat([(chunk_of_row[:, None] * span + keyed.to(kdt)).reshape(-1), ends * span + sentinel])
    ordered, order = torch.sort(keys)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    rank = torch.cumsum(first, 0) - 1  # each sorted entry's index among all chunks' distinct values
    chunk_of = torch.div(ordered, span, rounding_mode="floor")
    counts = torch.zeros(n_chunks, dtype=torch.int64, device=dev).index_add_(0, chunk_of, first.to(torch.int64))
    starts = torch.cumsum(counts, 0) - counts
    inv = torch.empty_like(rank)
    inv[order] = rank - starts[chunk_of]
    values = torch.empty_like(rank)
    values[rank] = (ordered - chunk_of * span).to(torch.int64)  # duplicates write the same value
    sizes = counts.tolist()  # the one host sync
    out, begin = [], 0
    for i, (n, n_rows) in enumerate(zip(sizes, _chunk_sizes(rows, chunk))):
        entries = inv[i * chunk * width: i * chunk * width + n_rows * width]
        out.append((values[begin:begin + n], entries.view(n_rows, width)))
        begin += n
    return out


def _chunk_grads(go: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, flat: torch.Tensor, u: torch.Tensor,
                 loc: torch.Tensor, scale: float, dc: int,
                 g_ql: torch.Tensor | None, g_qr: torch.Tensor | None, g_kv: torch.Tensor | None, cdt: torch.dtype,
                 o: torch.Tensor | None) -> None:
    """One chunk of G queries over its U >= 1 unique key slots ``u`` (``loc`` [G, L]: each key-list entry's
    column in ``u``, U for an entry without key); writes into the gradient buffers.

    The [G*H, U] buffers dominate the traffic, so each is made once and then updated in place: the
    softmax scale rides in the GEMMs' alpha (``addmm``), the latent and rope halves of q and k stay
    separate operands (two accumulating GEMMs instead of a concatenated copy of q), and the query
    gradients are written by their GEMMs straight into the output rows; delta = rowsum(dO * O) takes O from the
    forward's output ``o`` when given (``_row_delta``). With the contract's
    ``backward_matmul_precision="bf16"`` the products take bf16 operands instead (``_chunk_grads_bf16``)."""
    g, h, _ = q_lat.shape
    n_u = u.numel()
    k, listed = _chunk_keys(flat, u, loc, cdt)
    n_pad = k.shape[0]
    masked = ~listed.unsqueeze(1)  # [G, 1, U]
    c, kr = k[:, :dc], k[:, dc:]  # [U, Dc] latents (also the values), [U, Dr] rope keys
    ql = q_lat.detach().to(cdt).reshape(g * h, dc)
    qr = q_pe.detach().to(cdt).reshape(g * h, -1)
    s = torch.mm(ql, c.t()).addmm_(qr, kr.t(), beta=scale, alpha=scale).view(g, h, n_pad)  # scale * (q . k)
    p = _probabilities(s, masked).view(g * h, n_pad)
    gof = go.to(cdt).reshape(g * h, dc)
    delta = _row_delta(gof, o, lambda: p @ c)
    ds = torch.mm(gof, c.t()).sub_(delta.unsqueeze(1)).mul_(p)  # dS / scale, [G*H, U]
    # beta=0: the (unfilled) output rows are ignored, not read.
    for buf, kpart in ((g_ql, c), (g_qr, kr)):
        if buf is not None:
            rows = buf.view(g * h, -1)
            torch.addmm(rows, ds, kpart, beta=0, alpha=scale, out=rows)
    if g_kv is not None:
        dk = torch.empty(n_pad, k.shape[1], dtype=cdt, device=k.device)
        torch.addmm(torch.mm(p.t(), gof), ds.t(), ql, alpha=scale, out=dk[:, :dc])  # dK_latent + dV
        torch.addmm(dk[:, dc:], ds.t(), qr, beta=0, alpha=scale, out=dk[:, dc:])  # dK_rope
        g_kv.index_add_(0, u, dk[:n_u])  # u is unique: one add per row


def _chunk_grads_bf16(go: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, flat: torch.Tensor, u: torch.Tensor,
                      loc: torch.Tensor, scale: float, dc: int, g_q: torch.Tensor | None, g_kv: torch.Tensor | None,
                      stages: "Bf16Stages", o: torch.Tensor | None) -> None:
    """``_chunk_grads`` with bf16 GEMM operands and fp32 accumulation: the practice of FlashAttention's
    backward (P and dS rounded to bf16 for the tensor cores). Twice the tensor-core rate of TF32 and half
    the bytes per operand read; each operand rounds to 2^-8 relative (TF32: 2^-11), the softmax, the
    row sums and every accumulation stay fp32. A bf16 cache's keys are exact. The scale is folded into
    the (small) query operand once (``query_bf16``), so the [G*H, U] buffers see no extra pass for it.
    ``delta = rowsum(dO * O)`` is a [G*H] vector known before dP, from the forward's output ``o`` [G, H, Dc] (fp32;
    else O = P C formed here from the bf16 P), so dS = P (dP - delta) is the epilogue of dP's GEMM (``dp_ds``):
    dP never exists in fp32 and no pass over [G*H, U] follows it. The query gradient ``g_q`` [G, H, Dc + Dr]
    (latent and rope columns) is one GEMM written into its rows, the scale in its alpha. On CUDA the stages
    (``stages``: softmax, dP GEMM with the dS epilogue, scaled query) are one kernel each (triton/mla_attention_bwd.py)."""
    g, h, _ = q_lat.shape
    n_u = u.numel()
    bf = torch.bfloat16
    k, listed = _chunk_keys(flat, u, loc, bf)
    c = k[:, :dc]
    qs = stages.query(q_lat.detach(), q_pe.detach(), scale)  # scale * [q_lat | q_pe], [G*H, D] bf16
    p16 = stages.softmax(mm_f32(qs, k.t()), listed, h)  # [G*H, U]
    go_rows = go.reshape(g * h, dc)
    delta = _row_delta(go_rows, o, lambda: mm_f32(p16, c))
    go16 = go_rows.to(bf)
    ds16 = stages.dp_ds(go16, c, p16, delta)  # dS / scale = P (dO C^T - delta), [G*H, U]
    if g_q is not None:
        mm_f32(ds16, k, scale, out=g_q.view(g * h, -1))  # dQ = scale * dS K, latent and rope columns at once
    if g_kv is not None:
        dk = mm_f32(ds16.t(), qs)  # scale * dS^T q: dK (latent and rope)
        dk[:, :dc] += mm_f32(p16.t(), go16)  # + dV (the latents are the values)
        g_kv.index_add_(0, u, dk[:n_u])  # u is unique: one add per row


def _row_delta(go_rows: torch.Tensor, o: torch.Tensor | None, form_o: Callable[[], torch.Tensor]) -> torch.Tensor:
    """delta = rowsum(dO * O) [R] in dO's dtype, for dO rows ``go_rows`` [R, Dc]: O from the forward's output rows
    ``o`` [G, H, Dc] when the caller kept them, else ``form_o()`` (P C, [R, Dc])."""
    o_rows = form_o() if o is None else o.reshape(go_rows.shape)
    return (go_rows * o_rows.to(go_rows.dtype)).sum(-1)


def _chunk_keys(flat: torch.Tensor, u: torch.Tensor, loc: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's keys K [U', D] in ``dtype`` and which of them each query lists [G, U'], U' = U rounded up to
    KEY_PAD with zero keys that no query lists (P = dS = 0 there, exactly; their key gradients are dropped).
    The [G*H, U'] operands' rows are then 16-byte aligned, which cuBLAS's sm90 kernels need: unaligned rows ran
    on its sm75 "align1" kernels, ~5x slower (benchmarks/mla_bwd_gemms.py)."""
    n_u = u.numel()
    k = flat.index_select(0, u).to(dtype)
    listed = _listed(loc, n_u)
    n_pad = -(-n_u // KEY_PAD) * KEY_PAD
    if n_pad != n_u:
        k = torch.cat([k, k.new_zeros(n_pad - n_u, k.shape[1])])
        listed = torch.nn.functional.pad(listed, (0, n_pad - n_u))
    return k, listed


def _softmax_bf16_torch(s: torch.Tensor, listed: torch.Tensor, heads: int) -> torch.Tensor:
    """P [G*H, U] bf16: softmax of the fp32 scores s [G*H, U] over each row's listed keys (listed [G, U])."""
    rows, n_u = s.shape
    return _probabilities(s.view(rows // heads, heads, n_u), ~listed.unsqueeze(1)).view(rows, n_u).to(torch.bfloat16)


def _dp_ds_bf16_torch(go16: torch.Tensor, c: torch.Tensor, p16: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dS = P (dO C^T - delta) in bf16 [R, U], from dO [R, Dc] and C [U, Dc] (bf16; any row strides), P [R, U]
    bf16 and delta [R] fp32: dP = dO C^T accumulated in fp32, then the subtract, the multiply, one rounding."""
    return mm_f32(go16, c.t()).sub_(delta.unsqueeze(1)).mul_(p16).to(torch.bfloat16)


def _query_bf16_torch(q_lat: torch.Tensor, q_pe: torch.Tensor, scale: float) -> torch.Tensor:
    """bf16(scale * [q_lat | q_pe]) as [G*H, Dc + Dr], the scale applied in fp32."""
    g, h, _ = q_lat.shape
    q = torch.cat([q_lat.to(torch.float32), q_pe.to(torch.float32)], dim=-1).reshape(g * h, -1)
    return q.mul_(scale).to(torch.bfloat16)


SoftmaxBf16 = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
DpDsBf16 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
QueryBf16 = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class Bf16Stages:
    """The bf16 path's stages around its plain GEMMs: ``softmax(s [G*H, U] fp32, listed [G, U], heads)`` -> P bf16;
    ``dp_ds(dO [G*H, Dc] bf16, C [U, Dc] bf16, P [G*H, U] bf16, delta [G*H] fp32)`` -> P (dO C^T - delta) bf16 (a
    GEMM with its elementwise epilogue); ``query(q_lat [G, H, Dc], q_pe [G, H, Dr], scale)`` -> bf16(scale *
    [q_lat | q_pe]) [G*H, Dc + Dr]."""

    softmax: SoftmaxBf16
    dp_ds: DpDsBf16
    query: QueryBf16


TORCH_STAGES = Bf16Stages(_softmax_bf16_torch, _dp_ds_bf16_torch, _query_bf16_torch)
_bf16_kernels: tuple[Bf16Stages, Callable[[torch.device], bool]] | None = None


def register_bf16_kernels(stages: Bf16Stages, runs_on: Callable[[torch.device], bool]) -> None:
    """Install fused kernels of the bf16 path's elementwise stages for devices where ``runs_on(device)``
    (triton/mla_attention_bwd.py); elsewhere the torch compositions above (``TORCH_STAGES``) run."""
    global _bf16_kernels
    _bf16_kernels = (stages, runs_on)


def _bf16_stages(device: torch.device) -> Bf16Stages:
    if _bf16_kernels is not None and _bf16_kernels[1](device):
        return _bf16_kernels[0]
    return TORCH_STAGES


def _zero(*bufs: torch.Tensor | None) -> None:
    for t in bufs:
        if t is not None:
            t.zero_()


def _listed(loc: torch.Tensor, n_u: int) -> torch.Tensor:
    """[G, U] True where a key column is in the query's list (column U of ``loc`` is "no key")."""
    g = loc.shape[0]
    return torch.zeros(g, n_u + 1, dtype=torch.bool, device=loc.device).scatter_(1, loc, True)[:, :n_u]


def _probabilities(s: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """softmax over the listed keys of scores s [G, H, U] (in place where it can): the unlisted get exact
    zeros. Rows without any key become all -inf, their softmax NaN: the second masked_fill zeroes them
    (every entry of such a row is masked)."""
    p = torch.softmax(s.masked_fill_(masked, float("-inf")), dim=-1)
    del s
    return p.masked_fill_(masked, 0.0)
