"""Row-local L2 normalisation over the last dim (KDA normalises q and k per head with it).

``x / sqrt(sum(x^2) + eps)``: the sum is a ``tree_sum`` (fixed binary tree over the last dim), so
a row's result never depends on how many rows share the call; sqrt and division are IEEE-exact
elementwise ops on both of torch's CPU paths (SIMD bulk and scalar tail).
"""
from __future__ import annotations

import torch

from ._dispatch import invariant_op
from .reduce import tree_sum


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@invariant_op
def l2_norm(x: torch.Tensor, eps: float = 1e-6, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [..., D] -> [..., D] in ``out_dtype`` (default x.dtype); computed in fp32 (fp64 for fp64)."""
    xf = x.to(_compute_dtype(x.dtype))
    ss = tree_sum(xf * xf, dim=-1, keepdim=True)
    return (xf / torch.sqrt(ss + eps)).to(out_dtype or x.dtype)


def l2_norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """float64 reference."""
    xd = x.double()
    return xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- fast mode (stock kernels)


@l2_norm.register("fast")
def l2_norm_fast(x: torch.Tensor, eps: float = 1e-6, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(out_dtype or x.dtype)
