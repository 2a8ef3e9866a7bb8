"""Parameter-holding building blocks shared by every layer: each calls the batch-invariant ops."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zmrl.kernels_batch_invariant import linear, linear_concat


class Linear(nn.Module):
    """``y = x @ W.T`` through the invariant ``linear`` op.

    ``adapter`` is the hook the LoRA package uses: when set, its fp32 output is added to the fp32
    base output before the single rounding (never merged into the weight), so the engine and the
    trainer compute ``base(x) + adapter(x)`` identically; the ``linear`` op adds it in the GEMM's
    epilogue (its ``delta``), bitwise the unfused sum. ``extra`` does the same for a per-call delta
    (batched expert LoRA, whose tensors live in the MoE layer).
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
        deltas = [d for d in (None if self.adapter is None else self.adapter(x), extra) if d is not None]
        if len(deltas) == 1 and deltas[0].dtype == torch.float32:
            # the GEMM adds the fp32 delta before its one rounding: the bits of the sum below
            return linear(x, self.weight, self.bias, out_dtype=out_dtype or x.dtype, delta=deltas[0])
        y = linear(x, self.weight, self.bias, out_dtype=torch.float32)
        for d in deltas:  # adapter first, then extra
            y = y + d
        return y.to(out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def project(x: torch.Tensor, linears: Sequence[Linear]) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]`` bitwise, with their base weights in one ``linear_concat`` and the
    A factors of their LoRA adapters in a second: at decode two GEMM launches per layer input instead
    of one or three per projection.

    Exactly ``Linear.forward``'s arithmetic: a projection without adapter is its base product rounded
    once to x.dtype (the fused GEMM's columns are the separate GEMMs' bits); with an adapter, the fp32
    base plus the adapter's fp32 delta, rounded once. An adapter joins the A fusion when it exposes
    ``lora_A`` [r, in] and ``up(t)`` (its delta from ``t = x @ lora_A^T`` in fp32); any other adapter is
    called as ``adapter(x)``. Anything else (a bias, a subclass such as a row-parallel piece) runs each
    projection on its own. Without adapters the outputs are column views of one [.., sum N] tensor."""
    if len(linears) < 2 or any(type(lin) is not Linear or lin.bias is not None for lin in linears):
        return [lin(x) for lin in linears]
    weights = [lin.weight for lin in linears]
    widths = [w.shape[0] for w in weights]
    if all(lin.adapter is None for lin in linears):
        return list(linear_concat(x, weights).split(widths, dim=-1))
    base = linear_concat(x, weights, out_dtype=torch.float32).split(widths, dim=-1)
    fusable = [i for i, lin in enumerate(linears)
               if lin.adapter is not None and hasattr(lin.adapter, "lora_A") and hasattr(lin.adapter, "up")]
    deltas: dict[int, torch.Tensor] = {}
    if fusable:
        a_factors = [linears[i].adapter.lora_A for i in fusable]
        t_all = linear_concat(x, a_factors, out_dtype=torch.float32).split([a.shape[0] for a in a_factors], dim=-1)
        deltas = {i: linears[i].adapter.up(t) for i, t in zip(fusable, t_all)}
    out = []
    for i, (lin, y) in enumerate(zip(linears, base)):
        if lin.adapter is not None:
            y = y + (deltas[i] if i in deltas else lin.adapter(x))
        out.append(y.to(x.dtype))
    return out


def scaled(scale: float, t: torch.Tensor) -> torch.Tensor:
    """``scale * t``, skipping the multiply at scale 1 (LoRA alpha = r): ``1.0 * v == v`` bit for bit in IEEE
    arithmetic, so the values are the same and the forward and backward each save one elementwise pass
    over the [T, out] fp32 delta."""
    return t if scale == 1.0 else scale * t


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
