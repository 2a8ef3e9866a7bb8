"""Fixed-order reductions.

torch's CPU reductions pick a vectorisation and thread split from the tensor's shape, so the same
row can be summed in a different order inside a different batch. ``tree_sum`` instead pads the
reduced dim to a power of two with zeros and halves it with elementwise adds: every element of the
result is the same binary tree of IEEE additions, whatever the other rows or the batch size. Zero
padding is exact (x + 0 == x).

On CUDA no Triton kernel is needed: every step is an elementwise add of two halves (one torch
elementwise kernel per level), so each output element is the same tree of adds whatever the batch;
torch's CUDA elementwise kernels compute each element by the same scalar function on their
vectorised and unrolled paths (only the memory access differs). No torch reduction is used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    out = x  # [..., 1]
    if keepdim:
        return out.movedim(-1, dim)
    return out.squeeze(-1)


def tree_mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    return tree_sum(x, dim, keepdim) / x.shape[dim]
