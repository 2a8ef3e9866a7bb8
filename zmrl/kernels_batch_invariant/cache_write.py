"""``write_cache_rows``: a decode step's new MLA cache entries stored at their flat cache slots.

Data movement only (no arithmetic: every backend stores the same bytes). The latent row is given as its parts
(``[c_kv | k_pe]`` side by side), so no concatenated copy is made; the Triton backend
(``triton/cache_write.py``) stores the latent parts, the FP8 index key bytes and the index scale of a token in
one launch instead of a concatenation and three scatters.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._dispatch import invariant_op


@invariant_op
def write_cache_rows(slots: torch.Tensor, kv: torch.Tensor, latent_parts: Sequence[torch.Tensor],
                     k8: torch.Tensor | None = None, index_k8: torch.Tensor | None = None,
                     kscale: torch.Tensor | None = None, index_scale: torch.Tensor | None = None) -> None:
    """Store token t's entries at flat slot ``slots[t]``, in place.

    kv: the latent page pool [P, page, D]; latent_parts: [T, D_i] pieces with sum D_i = D (converted to kv's
    dtype); k8 / index_k8: the index key pool [P, page, Dk] and the new keys [T, Dk] (any 1-byte dtype, stored
    as bytes); kscale / index_scale: the scale pool [P, page] and the new scales [T] (fp32). The index pieces
    come together or not at all.
    """
    _check(slots, kv, latent_parts, k8, index_k8, kscale, index_scale)
    kv.view(-1, kv.shape[-1])[slots] = torch.cat(list(latent_parts), dim=-1).to(kv.dtype)
    if k8 is not None:
        k8.view(torch.uint8).view(-1, k8.shape[-1] * k8.element_size())[slots] = index_k8.to(k8.dtype).view(torch.uint8)
        kscale.view(-1)[slots] = index_scale


def _check(slots, kv, latent_parts, k8, index_k8, kscale, index_scale) -> None:
    t = slots.shape[0]
    if sum(p.shape[-1] for p in latent_parts) != kv.shape[-1] or any(p.shape[0] != t for p in latent_parts):
        raise ValueError(f"write_cache_rows: latent parts {[tuple(p.shape) for p in latent_parts]} do not make "
                         f"{t} rows of {kv.shape[-1]}")
    if (k8 is None) != (index_k8 is None) or (k8 is None) != (kscale is None) or (k8 is None) != (index_scale is None):
        raise ValueError("write_cache_rows: the index key pool, keys, scale pool and scales come together")
