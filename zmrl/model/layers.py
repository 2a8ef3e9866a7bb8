"""Parameter-holding building blocks shared by every layer: each calls the batch-invariant ops."""
from __future__ import annotations

import torch
from torch import nn

from zmrl.kernels_batch_invariant import linear


class Linear(nn.Module):
    """``y = x @ W.T`` through the invariant ``linear`` op.

    ``adapter`` is the hook the LoRA package uses: when set, its fp32 output is added to the fp32
    base output before the single rounding, unfused, so the engine and the trainer compute
    ``base(x) + adapter(x)`` identically. ``extra`` does the same for a per-call delta (batched
    expert LoRA, whose tensors live in the MoE layer).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.adapter: nn.Module | None = None

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                extra: torch.Tensor | None = None) -> torch.Tensor:
        if self.adapter is None and extra is None:
            return linear(x, self.weight, self.bias, out_dtype=out_dtype)
        y = linear(x, self.weight, self.bias, out_dtype=torch.float32)
        if self.adapter is not None:
            y = y + self.adapter(x)
        if extra is not None:
            y = y + extra
        return y.to(out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        from zmrl.kernels_batch_invariant.norms import rms_norm

        return rms_norm(x, self.weight, self.eps, out_dtype=out_dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        from zmrl.kernels_batch_invariant.norms import layer_norm

        return layer_norm(x, self.weight, self.bias, self.eps, out_dtype=out_dtype)


class Weight(nn.Module):
    """A bare named weight (e.g. ``q_conv1d.weight``, ``mlp.gate.weight``) so checkpoint names match HF."""

    def __init__(self, *shape: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype))
