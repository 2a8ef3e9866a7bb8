"""Triton ``write_cache_rows`` (``kernels_batch_invariant/cache_write.py``): one program per token stores its latent
parts, index key bytes and index scale at its cache slot. Same-dtype copies only (a conversion would round: the
torch backend then does it)."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import cache_write as _ops
from ._common import await_previous_kernel, next_pow2, pdl

write_cache_rows = _ops.write_cache_rows


@triton.jit
def _write_rows_kernel(slot_ptr, kv_ptr, a_ptr, b_ptr, k8_ptr, ik_ptr, ks_ptr, is_ptr, sa, sb, sk,
                       DA: tl.constexpr, DB: tl.constexpr, DK: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_B: tl.constexpr, HAS_INDEX: tl.constexpr):
    await_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    c = tl.arange(0, BLOCK)
    for c0 in tl.static_range(0, DA, BLOCK):
        m = c0 + c < DA
        tl.store(kv_ptr + slot * (DA + DB) + c0 + c, tl.load(a_ptr + t * sa + c0 + c, mask=m), mask=m)
    if HAS_B:
        for c0 in tl.static_range(0, DB, BLOCK):
            m = c0 + c < DB
            tl.store(kv_ptr + slot * (DA + DB) + DA + c0 + c, tl.load(b_ptr + t * sb + c0 + c, mask=m), mask=m)
    if HAS_INDEX:
        for c0 in tl.static_range(0, DK, BLOCK):
            m = c0 + c < DK
            tl.store(k8_ptr + slot * DK + c0 + c, tl.load(ik_ptr + t * sk + c0 + c, mask=m), mask=m)
        tl.store(ks_ptr + slot, tl.load(is_ptr + t))


@write_cache_rows.register("triton")
def write_cache_rows_triton(slots: torch.Tensor, kv: torch.Tensor, latent_parts: Sequence[torch.Tensor],
                            k8: torch.Tensor | None = None, index_k8: torch.Tensor | None = None,
                            kscale: torch.Tensor | None = None, index_scale: torch.Tensor | None = None) -> None:
    _ops._check(slots, kv, latent_parts, k8, index_k8, kscale, index_scale)
    parts = list(latent_parts)
    simple = (1 <= len(parts) <= 2 and all(p.dtype == kv.dtype and p.dim() == 2 and p.stride(-1) == 1 for p in parts)
              and kv.is_contiguous())
    if k8 is not None:
        simple = (simple and index_k8.dtype == k8.dtype and index_k8.dim() == 2 and index_k8.stride(-1) == 1
                  and k8.is_contiguous() and kscale.is_contiguous() and index_scale.dtype == kscale.dtype == torch.float32)
    if not simple:
        return write_cache_rows.impls["torch"](slots, kv, latent_parts, k8, index_k8, kscale, index_scale)
    t = slots.shape[0]
    if t == 0:
        return None
    a, b = parts[0], parts[-1]
    has_b = len(parts) == 2
    db = b.shape[-1] if has_b else 0
    ik = index_k8.view(torch.uint8) if k8 is not None else a
    dk = ik.shape[-1] if k8 is not None else 0
    block = min(1024, next_pow2(max(a.shape[-1], db, dk, 1)))
    isc = index_scale.contiguous() if k8 is not None else a
    _write_rows_kernel[(t,)](
        slots.to(torch.int64).contiguous(), kv, a, b, k8.view(torch.uint8) if k8 is not None else kv, ik,
        kscale if k8 is not None else kv, isc, a.stride(0), b.stride(0), ik.stride(0),
        DA=a.shape[-1], DB=db, DK=dk, BLOCK=block, HAS_B=has_b, HAS_INDEX=k8 is not None, num_warps=4, **pdl())
    return None
