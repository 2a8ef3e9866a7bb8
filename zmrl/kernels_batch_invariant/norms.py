"""Row-invariant normalisations over the last dim: RMSNorm, LayerNorm and the KDA gated RMSNorm.

Every statistic goes through ``tree_sum``/``tree_mean`` (a fixed binary tree of adds per row), so a
row's result never depends on how many rows share the tensor or on the thread count; torch's own
``mean``/``var`` pick their vectorisation and thread split from the tensor shape. The remaining
arithmetic is IEEE ``+ - * /`` and fp32 ``rsqrt``, which torch evaluates identically on its SIMD
and scalar paths (tests/kernels/test_pointwise.py). The sigmoid gate uses ``pointwise.sigmoid``.

Everything is computed in fp32 (bf16/fp16 inputs upcast; fp64 inputs stay fp64 so gradcheck can
run) and cast once at the end to ``out_dtype`` (default: the dtype of ``x``).
The fixed evaluation order, which a Triton backend must reproduce bit for bit, is::

    rms_norm:   r = rsqrt(tree_mean(x*x) + eps);  y = (x * r) * w
    layer_norm: mu = tree_mean(x); d = x - mu; r = rsqrt(tree_mean(d*d) + eps); y = ((d * r) * w) + b
    gated:      y = ((x * r) * w) * sigmoid(gate)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import invariant_op
from .pointwise import sigmoid
from .reduce import tree_mean


def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rms_norm_f32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in the compute dtype, not yet cast (shared by ``rms_norm`` and ``rms_norm_gated``)."""
    xf = x.to(_cdt(x.dtype))
    r = torch.rsqrt(tree_mean(xf * xf, dim=-1, keepdim=True) + eps)
    y = xf * r
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y


@invariant_op
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim.

    x: [..., D]; weight: [D] or None; returns [..., D] in ``out_dtype`` (default x.dtype).
    """
    return _rms_norm_f32(x, weight, eps).to(out_dtype or x.dtype)


@invariant_op
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (rounded to x.dtype, as torch's add) and ``rms_norm(h, weight, eps)``: a decoder
    layer's residual add and the next norm, one launch on the GPU (the Triton backend), bitwise the two ops.

    x, residual: [..., D] of one dtype; returns (h, normed), both x.dtype.
    """
    check_add_rms_norm(x, residual)
    h = x + residual
    return h, rms_norm(h, weight, eps)


def check_add_rms_norm(x: torch.Tensor, residual: torch.Tensor) -> None:
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} differ")


@invariant_op
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last dim (biased variance).

    x: [..., D]; weight, bias: [D] or None; returns [..., D] in ``out_dtype`` (default x.dtype).
    The variance is the two-pass ``mean((x - mean)^2)``, not ``E[x^2] - mean^2`` (which cancels).
    """
    xf = x.to(_cdt(x.dtype))
    d = xf - tree_mean(xf, dim=-1, keepdim=True)
    y = d * torch.rsqrt(tree_mean(d * d, dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype or x.dtype)


@invariant_op
def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """KDA output norm: ``rms_norm(x, weight, eps) * sigmoid(gate)``, all in fp32, one rounding.

    x, gate: [..., D] (D = head_dim; heads folded into the leading dims); weight: [D] shared by
    all heads; returns [..., D] in ``out_dtype`` (default x.dtype).
    """
    y = _rms_norm_f32(x, weight, eps)
    return (y * sigmoid(gate.to(y.dtype))).to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- fast mode (stock kernels)


@rms_norm.register("fast")
def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    cdt = _cdt(x.dtype)
    w = None if weight is None else weight.to(cdt)
    return F.rms_norm(x.to(cdt), (x.shape[-1],), w, eps).to(out_dtype or x.dtype)


@layer_norm.register("fast")
def layer_norm_fast(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    cdt = _cdt(x.dtype)
    w = None if weight is None else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    return F.layer_norm(x.to(cdt), (x.shape[-1],), w, b, eps).to(out_dtype or x.dtype)


@rms_norm_gated.register("fast")
def rms_norm_gated_fast(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    cdt = _cdt(x.dtype)
    y = F.rms_norm(x.to(cdt), (x.shape[-1],), weight.to(cdt), eps)
    return (y * torch.sigmoid(gate.to(cdt))).to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- float64 references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """float64 reference for ``rms_norm``."""
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """float64 reference for ``layer_norm``."""
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def rms_norm_gated_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 reference for ``rms_norm_gated``."""
    return rms_norm_ref(x, weight, eps) * torch.sigmoid(gate.double())
