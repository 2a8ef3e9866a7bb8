"""Parameter-holding building blocks shared by every layer: each calls the batch-invariant ops."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zmrl.kernels_batch_invariant import linear, linear_concat
from zmrl.kernels_batch_invariant.matmul import LoraUpConcat, lora_concat_delta


class Linear(nn.Module):
    """``y = x @ W.T`` through the invariant ``linear`` op.

    ``adapter`` is the hook the LoRA package uses: when set, its fp32 output is added to the fp32
    base output before the single rounding (never merged into the weight), so the engine and the
    trainer compute ``base(x) + adapter(x)`` identically; the ``linear`` op joins it inside the GEMM
    (its ``delta``: the Triton GEMM's accumulator starts from it). An adapter with ``factors(x)`` (a ``LoraUp``:
    its delta as up factors) hands those instead, and the GEMM computes the delta in the same launch (its
    ``lora``: the same value, without writing and reading it). ``extra`` adds a per-call delta (the
    per-expert fallback of the MoE's batched expert LoRA).
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
        factors = getattr(self.adapter, "factors", None)
        if factors is not None and extra is None:
            return linear(x, self.weight, self.bias, out_dtype=out_dtype or x.dtype, lora=factors(x))
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
    """``[lin(x) for lin in linears]`` bitwise, in few GEMM launches: at decode a layer input's
    projections with LoRA adapters take two (all A factors in one ``linear_concat``, then all base
    weights in one ``linear_concat`` that computes every adapter's B product in its epilogue) instead of
    one to three per projection.

    Exactly ``Linear.forward``'s arithmetic: a projection without adapter is its base product rounded
    once to x.dtype (the fused GEMM's columns are the separate GEMMs' bits); with an adapter, the fp32
    base plus the adapter's fp32 delta, rounded once (the ``lora`` / ``delta`` of ``linear`` /
    ``linear_concat``). An adapter joins the A fusion when it exposes ``lora_A`` [r, in] and ``up(t)`` (its
    delta from ``t = x @ lora_A^T`` in fp32), and the B fusion when its class's ``factors_concat`` accepts
    the group (``LoraAdapter``s of one scale: a ``LoraUpConcat``); any other adapter is called as
    ``adapter(x)``. Projections without adapter get their own ``linear_concat`` without delta: a delta of
    +0.0 would turn a -0.0 result into +0.0, so they stay out of the fused epilogue. Anything else (a
    bias, a subclass such as a row-parallel piece) runs each projection on its own. The outputs are
    column views of one [.., sum N] tensor per group (with adapters / without)."""
    if len(linears) < 2 or any(type(lin) is not Linear or lin.bias is not None for lin in linears):
        return [lin(x) for lin in linears]
    weights = [lin.weight for lin in linears]
    widths = [w.shape[0] for w in weights]
    adapted = [i for i, lin in enumerate(linears) if lin.adapter is not None]
    if not adapted:
        return list(linear_concat(x, weights).split(widths, dim=-1))
    a_weights, a_widths = [weights[i] for i in adapted], [widths[i] for i in adapted]
    terms = _adapter_terms(x, [linears[i].adapter for i in adapted], a_widths)
    out: list[torch.Tensor | None] = [None] * len(linears)
    if isinstance(terms, LoraUpConcat):
        outs = linear_concat(x, a_weights, out_dtype=x.dtype, lora=terms).split(a_widths, dim=-1)
    elif all(d.dtype == torch.float32 for d in terms):
        delta = terms[0] if len(terms) == 1 else torch.cat(terms, dim=-1)
        outs = linear_concat(x, a_weights, out_dtype=x.dtype, delta=delta).split(a_widths, dim=-1)
    else:  # a delta of another dtype (one per adapter): the fp32 sum in torch, as Linear.forward does
        base = linear_concat(x, a_weights, out_dtype=torch.float32).split(a_widths, dim=-1)
        outs = [(y + d).to(x.dtype) for y, d in zip(base, terms, strict=True)]
    for i, y in zip(adapted, outs):
        out[i] = y
    plain = [i for i, lin in enumerate(linears) if lin.adapter is None]
    if plain:
        for i, y in zip(plain, linear_concat(x, [weights[i] for i in plain]).split([widths[i] for i in plain], -1)):
            out[i] = y
    return out


def joined_columns(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts, dim=-1)`` for 2-D parts; when they are adjacent column views of one tensor (as
    ``project``'s outputs are), that tensor's column slice instead: the same values, no copy (one launch
    fewer at decode). Autograd sees a slice of the tensor the parts were split from, so the slice is taken only
    where autograd tracks that tensor or no part needs a gradient: ``_base`` is the storage's root view, which
    for the output of an autograd Function that returns a view of its own buffer is that untracked buffer
    (a slice of it would silently cut the parts' gradients)."""
    base = parts[0]._base
    tracked = base is not None and (base.requires_grad or not any(p.requires_grad for p in parts))
    if (tracked and base.dim() == 2 and all(p.dim() == 2 and p._base is base for p in parts)
            and all(p.stride() == base.stride() for p in parts)):
        elt = base.element_size()
        offsets = [(p.data_ptr() - base.data_ptr()) // elt for p in parts]
        widths = [p.shape[1] for p in parts]
        if all(b == a + w for a, w, b in zip(offsets, widths, offsets[1:])) and 0 <= offsets[0] < base.shape[1]:
            return base.narrow(1, offsets[0], sum(widths))
    return torch.cat(list(parts), dim=-1)


def _adapter_terms(x: torch.Tensor, adapters: list[nn.Module],
                   widths: list[int]) -> LoraUpConcat | list[torch.Tensor]:
    """The adapters' terms for x: one ``LoraUpConcat`` (their deltas as up factors, for the GEMM's epilogue)
    when every adapter is fusable and its class's ``factors_concat`` takes them all at once, else one delta
    per adapter (fused A products, and a fused B product for the group that fuses, where possible)."""
    fusable = [j for j, a in enumerate(adapters) if hasattr(a, "lora_A") and hasattr(a, "up")]
    pieces: list[torch.Tensor | None] = [None] * len(adapters)
    if fusable:
        group = [adapters[j] for j in fusable]
        t_all = linear_concat(x, [a.lora_A for a in group], out_dtype=torch.float32)
        factors_concat = getattr(type(group[0]), "factors_concat", None)
        joint = None if factors_concat is None else factors_concat(group, t_all)
        if joint is not None and len(group) == len(adapters):
            return joint
        if joint is not None:
            ups = lora_concat_delta(joint).split([widths[j] for j in fusable], dim=-1)
        else:
            ts = t_all.split([a.lora_A.shape[0] for a in group], dim=-1)
            ups = [a.up(t) for a, t in zip(group, ts)]
        for j, d in zip(fusable, ups):
            pieces[j] = d
    return [adapters[j](x) if d is None else d for j, d in enumerate(pieces)]


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
