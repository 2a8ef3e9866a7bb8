"""Block attention-residuals (K3 AttnRes): each sub-layer's input is a softmax-weighted mix over depth.

Reading used here (the public sources are third-party dumps): the residual stream is split into
blocks of ``attn_res_block_size`` decoder layers. ``b_0`` is the embedding; each completed block
contributes the sum of its sub-layer outputs; the block in progress contributes its partial sum.
Before every sub-layer (attention, MLP) and before the final norm, a learned per-site pseudo-query
``w = norm.weight ⊙ proj.weight`` scores ``RMSNorm(v_i)`` of each candidate and the input is
``Σ softmax(score)_i v_i``. All of it is per token, fp32, fixed order: batch-invariant.
"""
from __future__ import annotations

import torch
from zmrl.kernels_batch_invariant.norms import rms_norm
from zmrl.kernels_batch_invariant.reduce import tree_sum


def depth_attention(values: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """``Σ_i softmax_i(RMSNorm(v_i; norm_weight) · proj_weight) v_i`` over the depth candidates."""
    v = torch.stack([t.float() for t in values])  # [n, T, D]
    keys = rms_norm(v, norm_weight, eps, out_dtype=torch.float32)
    scores = tree_sum(keys * proj_weight.float(), dim=-1)  # [n, T]
    m = scores.amax(dim=0, keepdim=True)
    p = torch.exp(scores - m)
    alpha = p / tree_sum(p, dim=0, keepdim=True)
    out = alpha[0, :, None] * v[0]
    for i in range(1, v.shape[0]):  # fixed depth order
        out = out + alpha[i, :, None] * v[i]
    return out.to(values[0].dtype)


class AttnResState:
    """The residual stream under block AttnRes."""

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.blocks: list[torch.Tensor] = [embedding]
        self.partial: torch.Tensor | None = None
        self.block_size = block_size

    def candidates(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def end_layer(self, layer_idx: int) -> None:
        if (layer_idx + 1) % self.block_size == 0 and self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None
