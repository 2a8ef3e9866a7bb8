"""Rotary position embedding from a precomputed table.

cos/sin are computed once in float64 and rounded to fp32, then looked up by absolute position, so a
token's rotation never depends on how many other positions were computed with it.
"""
from __future__ import annotations

import torch


class RotaryTable:
    def __init__(self, dim: int, theta: float, max_positions: int):
        # Always on CPU (also when the model is built under a meta-device context).
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
        angles = torch.arange(max_positions, dtype=torch.float64, device="cpu")[:, None] * inv_freq[None, :]
        self.cos = angles.cos().float()  # [P, dim/2]
        self.sin = angles.sin().float()
        self.max_positions = max_positions

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """x [T, ..., dim] rotated by its token's position; fp32 math, x.dtype out."""
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} exceeds max_position_embeddings={self.max_positions}")
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos = self.cos.to(x.device)[positions].view(shape)
        sin = self.sin.to(x.device)[positions].view(shape)
        xf = x.float()
        if interleaved:  # pairs (0,1), (2,3), ... as in DeepSeek MLA
            a, b = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        else:  # halves, as in the DSA indexer (non-interleaved)
            half = xf.shape[-1] // 2
            a, b = xf[..., :half], xf[..., half:]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        return out.to(x.dtype)
