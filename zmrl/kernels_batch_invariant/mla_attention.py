"""Absorbed MLA attention (MQA over the compressed latent) on a paged latent cache.

Cache layout: ``kv_cache [num_pages, page_size, Dc + Dr]`` holds ``[c_kv | k_pe]`` per token; the
token at absolute position p of sequence n lives at
``kv_cache[block_table[n, p // page_size], p % page_size]``. Queries are packed: query i belongs to
``block_table`` row ``seq_idx[i]`` and attends to the absolute key positions ``key_positions[i]``
(ascending, padded at the end with -1). The caller writes a token's own cache entry before the call.

Arithmetic order (the bitwise contract, which a GPU backend must reproduce): the key list is cut into
blocks of ``KEY_BLOCK`` entries, block 0 first, merged by an online softmax. Per block:

    s     = bmm_fixed([q_lat | q_pe] [H, Dc+Dr], [c_kv | k_pe]^T [Dc+Dr, 64]) * scale; masked -> -inf
    m_new = max(m, max(s));  alpha = exp(m - m_new)   (1 when m_new == -inf)
    p     = exp(s - m_new)   (masked -> exactly 0)
    l     = l * alpha + tree_sum(p);   acc = acc * alpha + bmm_fixed(p [H, 64], c_kv [64, Dc])

and ``o = acc / l`` at the end (a query with no valid key gets 0). ``scale`` is applied after the
dot as an fp32 number (torch rounds a Python-float multiplier to the tensor dtype). The last block
is padded to the full 64 entries (a narrower GEMM rounds differently). Each step is a fixed-shape
per-query GEMM, a fixed-order tree or an IEEE pointwise op, so a query's output depends only on its
q, its key list and the key values, not on the batch, the query grouping, the page size or which
physical pages hold the keys. A fully masked
block is an exact no-op (alpha == 1, p == 0, both updates add exact zeros), which is why trailing -1
padding, and hence sparse-vs-dense with identical key lists, cannot change any bit.

Static key width (``kv_len``, CUDA-graph decode): every op here takes ``kv_len: int | None``. With
``kv_len`` given, the op reads no device value on the host and all its shapes follow from host shapes
and ``kv_len`` alone (a captured graph bakes them in): the dense key list is ``[Q, kv_len]``, blocks are
never skipped by a host-side test (masked blocks are exact no-ops, so the bits equal the
``kv_len=None`` result). ``kv_len`` must be >= max(query_pos) + 1 (``key_width`` checks it on CPU; on CUDA
the decode runner, which passes ``block_table.shape[1] * page_size``, checks its positions on the host).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import invariant_op
from .matmul import bmm_fixed
from .reduce import tree_sum

KEY_BLOCK = 64
QUERY_GROUP = 256  # queries per inner pass; bounds the gathered-key memory, never changes results
DENSE_QUERY_CHUNK = 1024  # queries per dense key-list materialisation (bounds the [Q, L] list)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def key_width(query_pos: torch.Tensor, kv_len: int | None) -> int:
    """Width of a causal key range: ``kv_len`` when given (no host read), else max(query_pos) + 1.

    ``kv_len=None`` reads the maximum on the host (a sync on CUDA). A given ``kv_len`` is the caller's
    promise that every position is below it (a too small width would silently drop keys): on CPU it is
    checked (a RuntimeError at once); on CUDA it is not re-checked here, where a device-side assert would
    cost three launches per attention layer and step in a captured decode graph: the graph runner, the
    caller that passes it, checks its positions against the width on the host before each step
    (``DecodeGraphRunner.run``).
    """
    if kv_len is None:
        return int(query_pos.max().item()) + 1 if query_pos.numel() else 0
    kv_len = int(kv_len)
    if kv_len < 0:
        raise ValueError(f"kv_len must be >= 0, got {kv_len}")
    if query_pos.numel() and query_pos.device.type == "cpu":
        torch._assert_async(query_pos.max() < kv_len, f"kv_len={kv_len} must exceed every query position")
    return kv_len


def cache_slots(block_table: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots ``page * page_size + offset`` for ``positions [G, L]`` of rows ``seq_idx [G]``.

    Returns ``(slots [G, L] int64, valid [G, L] bool)``; entries with position < 0 are invalid and get
    slot 0 (always in range; their values must be masked by the caller).
    """
    valid = positions >= 0
    p = positions.clamp_min(0)
    pages = block_table[seq_idx.unsqueeze(-1), torch.div(p, page_size, rounding_mode="floor")]
    slots = pages.to(torch.int64) * page_size + p % page_size
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def _attend_group(q: torch.Tensor, key_positions: torch.Tensor, flat_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_idx: torch.Tensor, page_size: int,
                  softmax_scale: float, dc: int, cdt: torch.dtype, skip_empty: bool = True) -> torch.Tensor:
    """Online-softmax attention for one group: q [G, H, D], key_positions [G, L] -> [G, H, Dc].

    ``skip_empty`` skips blocks with no valid entry in the group (a host-side test: a sync on CUDA);
    without it they run as the exact no-ops they are, with the same result."""
    g, h, _ = q.shape
    m = torch.full((g, h), float("-inf"), dtype=cdt, device=q.device)
    l = torch.zeros((g, h), dtype=cdt, device=q.device)
    acc = torch.zeros((g, h, dc), dtype=cdt, device=q.device)
    any_valid = (key_positions >= 0).any(dim=0) if skip_empty else None
    for b0 in range(0, key_positions.shape[1], KEY_BLOCK):
        # A block with no valid entry in the whole group is an exact no-op for every query: skip it.
        if any_valid is not None and not bool(any_valid[b0:b0 + KEY_BLOCK].any()):
            continue
        pos = key_positions[:, b0:b0 + KEY_BLOCK]
        slots, valid = cache_slots(block_table, seq_idx, pos, page_size)
        # Zero the masked keys so uninitialised cache slots (possibly inf/NaN) never reach a product.
        # index_select, not flat_cache[slots]: the backward of advanced indexing with repeated slots
        # accumulates in a thread-dependent order; index_select's is deterministic.
        gathered = flat_cache.index_select(0, slots.reshape(-1)).view(*slots.shape, -1)
        kv = torch.where(valid.unsqueeze(-1), gathered.to(cdt), 0.0)  # [G, 64, D]
        s = bmm_fixed(q, kv.transpose(1, 2)) * softmax_scale  # [G, H, 64]
        vmask = valid.unsqueeze(1)  # [G, 1, 64]
        # The running max only stabilises the exponentials; the result does not depend on it
        # mathematically, so it is kept out of autograd (the gradient is still exact).
        bmax = s.detach().masked_fill(~vmask, float("-inf")).amax(dim=-1)
        m_new = torch.maximum(m, bmax)
        finite = m_new > float("-inf")
        m_safe = torch.where(finite, m_new, torch.zeros_like(m_new))
        alpha = torch.where(finite, torch.exp(m - m_safe), torch.ones_like(m_safe))
        m_b = m_safe.unsqueeze(-1)
        # Inner where keeps masked lanes at exp(0) so no inf appears on the discarded branch
        # (its gradient would be 0 * inf = NaN).
        p = torch.where(vmask, torch.exp(torch.where(vmask, s, m_b) - m_b), torch.zeros_like(s))
        l = l * alpha + tree_sum(p, dim=-1)
        acc = acc * alpha.unsqueeze(-1) + bmm_fixed(p, kv[..., :dc])
        m = m_new
    # A query without a single valid key returns zeros rather than 0/0.
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    return acc / l_safe.unsqueeze(-1)


def _check_shapes(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  kv_lora_rank: int) -> None:
    if q_lat.dim() != 3 or q_pe.dim() != 3 or q_lat.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"mla_attention: q_lat {tuple(q_lat.shape)} and q_pe {tuple(q_pe.shape)} "
                         "must be [Q, H, Dc] and [Q, H, Dr]")
    if q_lat.shape[-1] != kv_lora_rank:
        raise ValueError(f"mla_attention: q_lat last dim {q_lat.shape[-1]} != kv_lora_rank {kv_lora_rank}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != kv_lora_rank + q_pe.shape[-1]:
        raise ValueError(f"mla_attention: kv_cache {tuple(kv_cache.shape)} must be "
                         f"[num_pages, page_size, {kv_lora_rank} + {q_pe.shape[-1]}]")


@invariant_op
def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_idx: torch.Tensor, key_positions: torch.Tensor,
                  softmax_scale: float, kv_lora_rank: int, kv_len: int | None = None) -> torch.Tensor:
    """Absorbed MLA over an explicit key list.

    q_lat [Q, H, Dc] (q_nope @ W_UK), q_pe [Q, H, Dr], kv_cache [num_pages, page_size, Dc + Dr],
    block_table [N, max_pages] int64, seq_idx [Q] int64, key_positions [Q, L] int64 (ascending,
    -1 padded). Returns o_lat [Q, H, Dc] in fp32 (fp64 for fp64 inputs) = softmax(scores) @ c_kv.
    Differentiable w.r.t. q_lat, q_pe and kv_cache. The key list already has a static width; a given
    ``kv_len`` only turns off host-side reads (module docstring), with the same result.
    """
    _check_shapes(q_lat, q_pe, kv_cache, kv_lora_rank)
    cdt = _compute_dtype(q_lat.dtype)
    nq, h, dc = q_lat.shape
    num_pages, page_size, d = kv_cache.shape
    flat = kv_cache.reshape(num_pages * page_size, d)
    q = torch.cat([q_lat.to(cdt), q_pe.to(cdt)], dim=-1)
    kp = key_positions.to(torch.int64)
    # Every block must have exactly KEY_BLOCK entries (a narrower last block is a different GEMM
    # shape, hence different rounding): pad the list with masked entries.
    pad = -kp.shape[1] % KEY_BLOCK
    if pad:
        kp = torch.cat([kp, kp.new_full((kp.shape[0], pad), -1)], dim=1)
    outs = [
        _attend_group(q[g0:g0 + QUERY_GROUP], kp[g0:g0 + QUERY_GROUP], flat, block_table,
                      seq_idx[g0:g0 + QUERY_GROUP], page_size, softmax_scale, dc, cdt,
                      skip_empty=kv_len is None)
        for g0 in range(0, nq, QUERY_GROUP)
    ]
    if not outs:
        return q.new_zeros((0, h, dc))
    return torch.cat(outs, dim=0)


def dense_key_positions(query_pos: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Causal key list ``[Q, width]``: row i is 0..query_pos[i], then -1 (width >= max(query_pos)+1).

    ``width=None`` uses max(query_pos) + 1 (a host read); a given width (e.g. a static ``kv_len``)
    reads nothing on the host."""
    qp = query_pos.to(torch.int64)
    if width is None:
        width = key_width(qp, None)
    cols = torch.arange(width, dtype=torch.int64, device=qp.device).unsqueeze(0)
    return torch.where(cols <= qp.unsqueeze(-1), cols, torch.full_like(cols, -1))


@invariant_op
def mla_attention_dense(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_idx: torch.Tensor, query_pos: torch.Tensor,
                        softmax_scale: float, kv_lora_rank: int, kv_len: int | None = None) -> torch.Tensor:
    """Causal dense attention: each query attends to positions 0..query_pos[i].

    With ``kv_len`` the key lists are ``[Q, kv_len]`` (masked past each query's position) and nothing
    is read on the host; same bits as ``kv_len=None``.

    Same key list and blocks as ``mla_attention`` with a full selection, hence bitwise equal to the
    sparse path whenever the selection is all positions. The key lists are materialised
    ``DENSE_QUERY_CHUNK`` queries at a time (padding does not change results). An op of its own so
    that a GPU backend can walk the causal keys 0..query_pos directly instead of reading a key list
    (same 64-key blocks aligned to absolute positions, hence the same bits as the sparse path).
    """
    width = None if kv_len is None else key_width(query_pos, kv_len)
    outs = []
    for c0 in range(0, q_lat.shape[0], DENSE_QUERY_CHUNK):
        sl = slice(c0, c0 + DENSE_QUERY_CHUNK)
        outs.append(mla_attention(q_lat[sl], q_pe[sl], kv_cache, block_table, seq_idx[sl],
                                  dense_key_positions(query_pos[sl], width), softmax_scale, kv_lora_rank,
                                  kv_len=kv_len))
    if not outs:
        return mla_attention(q_lat, q_pe, kv_cache, block_table, seq_idx,
                             dense_key_positions(query_pos, 0), softmax_scale, kv_lora_rank, kv_len=kv_len)
    return torch.cat(outs, dim=0)


def mla_attention_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_idx: torch.Tensor, key_positions: torch.Tensor,
                      softmax_scale: float, kv_lora_rank: int) -> torch.Tensor:
    """float64 reference: plain softmax over the listed keys, ``[Q, H, Dc]`` float64."""
    num_pages, page_size, d = kv_cache.shape
    slots, valid = cache_slots(block_table, seq_idx, key_positions.to(torch.int64), page_size)
    kv = kv_cache.reshape(-1, d).double()[slots]  # [Q, L, D]
    kv = torch.where(valid.unsqueeze(-1), kv, torch.zeros_like(kv))
    c, kpe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    scores = (torch.einsum("qhc,qlc->qhl", q_lat.double(), c)
              + torch.einsum("qhr,qlr->qhl", q_pe.double(), kpe)) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    has_key = valid.any(dim=-1)[:, None, None]
    p = torch.softmax(torch.where(has_key, scores, torch.zeros_like(scores)), dim=-1)
    p = torch.where(valid.unsqueeze(1), p, torch.zeros_like(p))
    return torch.einsum("qhl,qlc->qhc", p, c)


# ----------------------------------------------------------------------------- fast (stock) kernels
# Stock ``F.scaled_dot_product_attention`` over gathered keys (not invariant).
FAST_QUERY_CHUNK = 256
# With a static kv_len (CUDA-graph decode) the dense fast path gathers [C, kv_len, D] per chunk of C
# queries: C is bounded by this many gathered elements (a function of host shapes only).
FAST_GATHER_ELEMS = 1 << 27


def _sdpa_dtype(kv: torch.Tensor) -> torch.dtype:
    return kv.dtype if kv.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, M, D], k [B, L, D], v [B, L, Dc], mask [B, M, L] bool -> fp32 [B, M, Dc]; rows without keys -> 0."""
    o = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                       attn_mask=mask.unsqueeze(1), scale=scale).squeeze(1)
    return torch.where(mask.any(dim=-1, keepdim=True), o.float(), 0.0)


@mla_attention.register("fast")
def mla_attention_fast(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_idx: torch.Tensor, key_positions: torch.Tensor,
                       softmax_scale: float, kv_lora_rank: int, kv_len: int | None = None) -> torch.Tensor:
    """Masked SDPA over each query's gathered key list (heads as the SDPA query rows: MQA). Reads
    nothing on the host (the list width is static), so ``kv_len`` changes nothing."""
    del kv_len
    _check_shapes(q_lat, q_pe, kv_cache, kv_lora_rank)
    num_pages, page_size, d = kv_cache.shape
    flat = kv_cache.reshape(num_pages * page_size, d)
    dt = _sdpa_dtype(kv_cache)
    outs = []
    for c0 in range(0, q_lat.shape[0], FAST_QUERY_CHUNK):
        sl = slice(c0, c0 + FAST_QUERY_CHUNK)
        slots, valid = cache_slots(block_table, seq_idx[sl], key_positions[sl].to(torch.int64), page_size)
        k = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, d).to(dt)
        k = torch.where(valid.unsqueeze(-1), k, torch.zeros((), dtype=dt, device=k.device))
        q = torch.cat([q_lat[sl], q_pe[sl]], dim=-1).to(dt)
        mask = valid.unsqueeze(1).expand(-1, q.shape[1], -1)
        outs.append(_sdpa(q, k, k[..., :kv_lora_rank], mask, softmax_scale))
    if not outs:
        return q_lat.new_zeros(q_lat.shape, dtype=torch.float32)
    return torch.cat(outs, dim=0)


@mla_attention_dense.register("fast")
def mla_attention_dense_fast(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, seq_idx: torch.Tensor, query_pos: torch.Tensor,
                             softmax_scale: float, kv_lora_rank: int, kv_len: int | None = None) -> torch.Tensor:
    """Per sequence: gather its latents 0..max(query_pos) once and run causal-masked SDPA with the
    (query, head) pairs as query rows. With ``kv_len``: no per-sequence host loop; each query's
    causal list of width kv_len goes through the sparse fast path (memory-bounded query chunks)."""
    _check_shapes(q_lat, q_pe, kv_cache, kv_lora_rank)
    if kv_len is not None:
        width = key_width(query_pos, kv_len)
        nq = q_lat.shape[0]
        chunk = max(1, FAST_GATHER_ELEMS // max(1, width * kv_cache.shape[-1]))
        outs = [mla_attention_fast(q_lat[c0:c0 + chunk], q_pe[c0:c0 + chunk], kv_cache, block_table,
                                   seq_idx[c0:c0 + chunk], dense_key_positions(query_pos[c0:c0 + chunk], width),
                                   softmax_scale, kv_lora_rank)
                for c0 in range(0, nq, chunk)]
        if not outs:
            return q_lat.new_zeros(q_lat.shape, dtype=torch.float32)
        return torch.cat(outs, dim=0)
    nq, h, dc = q_lat.shape
    num_pages, page_size, d = kv_cache.shape
    flat = kv_cache.reshape(num_pages * page_size, d)
    dt = _sdpa_dtype(kv_cache)
    out = torch.zeros((nq, h, dc), dtype=torch.float32, device=q_lat.device)
    qp = query_pos.to(torch.int64)
    for n in torch.unique(seq_idx).tolist():
        idx = (seq_idx == n).nonzero().flatten()
        qpn = qp[idx]
        width = int(qpn.max().item()) + 1
        pos = torch.arange(width, dtype=torch.int64, device=q_lat.device).unsqueeze(0)
        slots, _ = cache_slots(block_table, seq_idx[idx[:1]], pos, page_size)
        k = flat.index_select(0, slots.reshape(-1)).to(dt).unsqueeze(0)  # [1, L, D]
        for c0 in range(0, idx.numel(), FAST_QUERY_CHUNK):
            ci = idx[c0:c0 + FAST_QUERY_CHUNK]
            q = torch.cat([q_lat[ci], q_pe[ci]], dim=-1).to(dt).reshape(1, -1, d)  # [1, G*H, D]
            mask = (pos <= qp[ci].unsqueeze(-1)).repeat_interleave(h, dim=0).unsqueeze(0)  # [1, G*H, L]
            o = _sdpa(q, k, k[..., :dc], mask, softmax_scale)
            out[ci] = o.view(-1, h, dc)
    return out
