"""Rotary position embedding from a precomputed table.

cos/sin are computed once in float64 and rounded to fp32, then looked up by absolute position, so a
token's rotation never depends on how many other positions were computed with it.
"""
from __future__ import annotations

import torch

# Device copies of the (cos, sin) tables, shared by every layer with the same table (they are identical
# and can be large: max_positions x dim/2 fp32 each), made once per device.
_DEVICE_TABLES: dict[tuple[int, float, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


class RotaryTable:
    def __init__(self, dim: int, theta: float, max_positions: int):
        # Always on CPU (also when the model is built under a meta-device context).
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
        angles = torch.arange(max_positions, dtype=torch.float64, device="cpu")[:, None] * inv_freq[None, :]
        self.cos = angles.cos().float()  # [P, dim/2]
        self.sin = angles.sin().float()
        self.max_positions = max_positions
        self._key = (dim, float(theta), max_positions)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) on ``device`` (same values, so the same bits, as the CPU tables), copied once per
        device: a host->device copy per call would be a sync and, under CUDA-graph capture, a copy
        from a temporary host buffer."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.cos, self.sin
        key = (*self._key, device)
        hit = _DEVICE_TABLES.get(key)
        if hit is None:
            hit = _DEVICE_TABLES[key] = (self.cos.to(device), self.sin.to(device))
        return hit

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """x [T, ..., dim] rotated by its token's position; fp32 math, x.dtype out."""
        # The range check reads positions on the host, free on CPU only. On an accelerator it is
        # skipped (a host sync; forbidden under CUDA-graph capture): the engine checks positions
        # against max_position_embeddings on the host, and an out-of-range gather below still fails
        # (device-side index assert).
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} exceeds max_position_embeddings={self.max_positions}")
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos_t, sin_t = self.tables(x.device)
        cos = cos_t[positions].view(shape)
        sin = sin_t[positions].view(shape)
        xf = x.float()
        if interleaved:  # pairs (0,1), (2,3), ... as in DeepSeek MLA
            a, b = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        else:  # halves, as in the DSA indexer (non-interleaved)
            half = xf.shape[-1] // 2
            a, b = xf[..., :half], xf[..., half:]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        return out.to(x.dtype)
