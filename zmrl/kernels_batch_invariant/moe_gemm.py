"""Grouped expert GEMM for the MoE: ``expert_linear``.

The routed tokens are sorted by expert; rows ``offsets[e]:offsets[e+1]`` of ``x`` go through expert
``e``'s weight. The contract is per expert and deliberately small (an expert-parallel caller passes
its local experts and local offsets):

    y[offsets[e]:offsets[e+1]] == linear(x[offsets[e]:offsets[e+1]], weights[e], out_dtype=out_dtype)

bitwise, on every backend that is invariant. The torch backend *is* that loop, so CPU numerics are
those of the per-expert ``linear`` calls the MoE made before this op existed. The backward of both
backends is grouped over experts, not a loop over experts (moe_gemm_grads.py: Triton kernels on the GPU,
batched GEMMs per size class on CPU). The Triton backend
(``triton/matmul.py``) runs all experts in one launch with the tiles and K loop of Triton ``linear``,
so a row's result again equals ``linear(row, weights[e])`` and does not depend on how many tokens
each expert received.

``weights`` is either a sequence of per-expert ``[N, K]`` tensors (the model's expert Linear
modules, whose checkpoint names are per expert) or one stacked ``[E, N, K]`` tensor (batched expert
LoRA factors).

``offsets`` is a host list (or a tensor read back once) or, for CUDA-graph capture, an int tensor
``[E+1]`` on x's device ("device offsets"). With device offsets the Triton backend never reads the
values on the host (no sync; the tile lookup happens in the kernel) and the "fast" backend hands them
to ``torch._grouped_mm`` directly; the torch backend (CPU) and the fast per-expert loop read them
back. Device offsets are trusted: only their shape is checked (checking the values would sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ._dispatch import invariant_op
from .matmul import LoraUp, check_delta, linear, lora_up_product, resolve_delta
from .moe_gemm_grads import ExpertLinearFn
from .moe_router import moe_combine_rows

Weights = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class RowGather:
    """The rows of a product taken from another tensor by index: row r is ``x[index[r] // div]`` (the MoE's
    dispatch: expert-sorted pair r is token ``order[r] // top_k``). ``expert_linear`` reads them in place on the
    Triton backend instead of a gathered copy; the values are the gathered rows', so are the bits."""

    index: torch.Tensor  # [M] integer
    div: int = 1
    # [T, div] integer, optional: where source row t's copies lie (copy j of row t is row slots[t, j]; index // div
    # is then onto, each source row taken div times). A backward that sums the copies' gradients into the source
    # rows needs it (``moe_combine_rows``): the MoE's ``ExpertOrder.slot_rows``.
    slots: torch.Tensor | None = None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The gathered rows [M, K]; under autograd with ``slots`` their backward sums each source row's copies'
        gradients where they lie (``_GatheredRows``)."""
        if self.slots is not None and torch.is_grad_enabled() and x.requires_grad:
            return _GatheredRows.apply(x, self.index, self.slots, self.div)
        return x[self.index // self.div] if self.div != 1 else x[self.index]


class _GatheredRows(torch.autograd.Function):
    """``x[index // div]`` whose backward adds each source row's ``div`` copy gradients, read where they lie
    (``slots[t, j]``): ``moe_combine_rows`` with unit weights, one pass (fp32 sums in copy order, one rounding).
    Autograd's gather backward is an accumulating ``index_put_`` (a zero fill, a sort of the M indices, a
    scatter-add); a permuting copy back to source order and a sum would write and read the [M, K] gradient once
    more. Deterministic run to run."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, slots: torch.Tensor,  # type: ignore[override]
                div: int) -> torch.Tensor:
        ctx.save_for_backward(slots)
        return x[index // div] if div != 1 else x[index]

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (slots,) = ctx.saved_tensors
        return sum_copies(g, slots, g.dtype), None, None, None


def sum_copies(g: torch.Tensor, slots: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, K]: row t is the sum of the rows ``g[slots[t, j]]`` over j in fp32, rounded once to ``out_dtype``: the
    gradient of a gather whose copies of source row t lie at ``slots[t]`` (``RowGather``)."""
    ones = torch.ones(slots.shape, dtype=torch.float32, device=g.device)
    return moe_combine_rows(g, slots, ones, out_dtype=out_dtype)


def check_gather(x: torch.Tensor, gather: RowGather) -> None:
    if x.dim() != 2 or gather.index.dim() != 1 or gather.index.dtype.is_floating_point or gather.div < 1:
        raise ValueError(f"expert_linear: gather needs x [T, K] and a 1-D integer index with div >= 1, got x "
                         f"{tuple(x.shape)}, index {gather.index.dtype} {tuple(gather.index.shape)}, div {gather.div}")


def as_offsets(offsets: Sequence[int] | torch.Tensor) -> list[int]:
    """Host list of E+1 row offsets (a tensor is read back once: a host sync for a CUDA tensor)."""
    return [int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]


def device_offsets(offsets: Sequence[int] | torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """``offsets`` if it is a 1-D integer tensor on x's device (the capture-safe form), else None
    (host offsets: lists, or tensors on another device, which are read back with ``as_offsets``)."""
    if not isinstance(offsets, torch.Tensor) or offsets.device != x.device:
        return None
    if offsets.dim() != 1 or offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
        raise ValueError(f"expert_linear: offsets must be a 1-D integer tensor, got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    return offsets


def check_expert_shapes(x: torch.Tensor, weights: Weights, n_offsets: int,
                        every_weight: bool = True) -> tuple[int, int, int]:
    """Validate shapes (host metadata only, no offset values); returns (E, N, K).

    ``every_weight=False`` checks only the first of a list of per-expert weights (a caller that
    validates the rest once per weight set, e.g. the Triton backend's cached weight table)."""
    if x.dim() != 2:
        raise ValueError(f"expert_linear: x must be [M, K], got {tuple(x.shape)}")
    e = len(weights)
    if e == 0:
        raise ValueError("expert_linear: no experts")
    if n_offsets != e + 1:
        raise ValueError(f"expert_linear: {e} experts need {e + 1} offsets, got {n_offsets}")
    if isinstance(weights, torch.Tensor):
        if weights.dim() != 3:
            raise ValueError(f"expert_linear: stacked weights must be [E, N, K], got {tuple(weights.shape)}")
        n, k = weights.shape[1:]  # (not weights[0]: a view per call costs microseconds)
    else:
        w0 = weights[0]
        if w0.dim() != 2:
            raise ValueError("expert_linear: every expert weight must be [N, K] with the same N, K")
        n, k = w0.shape
        if every_weight and any(w.dim() != 2 or w.shape != (n, k) for w in weights):
            raise ValueError("expert_linear: every expert weight must be [N, K] with the same N, K")
    if x.shape[1] != k:
        raise ValueError(f"expert_linear: x has {x.shape[1]} features but the weights are [{n}, {k}]")
    return e, n, k


def check_expert_args(x: torch.Tensor, weights: Weights, offsets: list[int],
                      every_weight: bool = True) -> tuple[int, int, int]:
    """Validate shapes and host offsets; returns (E, N, K)."""
    dims = check_expert_shapes(x, weights, len(offsets), every_weight)
    if offsets[0] != 0 or offsets[-1] != x.shape[0] or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"expert_linear: offsets must rise from 0 to {x.shape[0]}, got {offsets}")
    return dims


@invariant_op
def expert_linear(x: torch.Tensor, weights: Weights, offsets: Sequence[int] | torch.Tensor,
                  out_dtype: torch.dtype | None = None, delta: torch.Tensor | None = None,
                  lora: LoraUp | None = None, gather: RowGather | None = None) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ weights[e].T (+ delta[rows of e])`` for expert-sorted rows.

    x: [M, K] (rows sorted by expert); weights: E x [N, K] or [E, N, K]; offsets: E+1 ints (host list
    or tensor; see the module doc for device offsets), ``offsets[0] == 0``, ``offsets[E] == M``.
    Returns [M, N] in ``out_dtype`` (default x.dtype). Experts with no rows are skipped. ``delta``: an
    fp32 [M, N] tensor (the experts' LoRA delta) added before the single rounding, as ``linear``'s.
    ``lora`` (instead of ``delta``): the delta as its factors, t [M, r] and stacked b [E, N, r]:
    ``delta = expert_lora_delta(lora, offsets)``, which the Triton GEMM computes in its epilogue.
    ``gather``: the rows are ``gather.rows(x)`` (x is then the source, [T, K]); this backend gathers them.
    """
    if gather is not None:
        check_gather(x, gather)
        x = gather.rows(x)
    delta = resolve_delta(delta, lora, "expert_linear",
                          lambda up: expert_lora_delta(up, offsets, expert_linear.impls["torch"]))
    offs = as_offsets(offsets)
    check_expert_args(x, weights, offs)
    out_dtype = out_dtype or x.dtype
    if delta is not None:
        # the sum in fp32, or in fp64 when anything is fp64 (gradchecks), as linear's torch backend does
        w0 = weights if isinstance(weights, torch.Tensor) else weights[0]
        acc = torch.float64 if torch.float64 in (x.dtype, w0.dtype, delta.dtype) else torch.float32
        y = expert_linear(x, weights, offs, out_dtype=acc)
        return (y + check_delta(delta, tuple(y.shape)).to(acc)).to(out_dtype)
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *ws)):
        # The forward below, the backward grouped over experts (moe_gemm_grads.py), not autograd
        # through one linear per expert.
        return ExpertLinearFn.apply(_per_expert_linear, x, offs, out_dtype, isinstance(weights, torch.Tensor), *ws)
    return _per_expert_linear(x, weights, offs, out_dtype)


@dataclass(frozen=True)
class ExpertLoraFactors:
    """One expert projection's LoRA factors for all experts: a [E, r, K] (``lora_A``), b [E, N, r] (``lora_B``),
    scale (alpha / r). Its delta for expert e's rows is ``expert_lora_delta(LoraUp(x @ a[e]^T in fp32, b, scale))``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float = 1.0

    def up(self, x: torch.Tensor, offsets: Sequence[int] | torch.Tensor, gather: RowGather | None = None,
           expert_linear_fn=None) -> LoraUp:
        """The up half for the rows x (the A products in fp32; fp64 for fp64 operands: gradchecks), what
        ``expert_linear`` adds in its epilogue; ``expert_linear_fn``: a backend's own ``expert_linear`` (default the op)."""
        acc = torch.float64 if torch.float64 in (x.dtype, self.a.dtype) else torch.float32
        t = (expert_linear_fn or expert_linear)(x, self.a, offsets, out_dtype=acc, gather=gather)
        return LoraUp(t, self.b, self.scale)


@invariant_op
def expert_gate_up(x: torch.Tensor, gate_weights: Weights, up_weights: Weights, offsets: Sequence[int] | torch.Tensor,
                   gate_lora: ExpertLoraFactors | None = None, up_lora: ExpertLoraFactors | None = None,
                   gather: RowGather | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' GLU input products of the same expert-sorted rows, with their LoRA deltas: bitwise

        (expert_linear(x, gate_weights, offsets, lora=gate_lora.up(x, offsets)),
         expert_linear(x, up_weights, offsets, lora=up_lora.up(x, offsets)))

    (``gather`` passed to each; no LoRA where a factor set is None), which this backend computes. One op, so
    that a backend can give x a single gradient: four products read x, and autograd would leave four
    [M, K] gradients and three adds (at 16K tokens x top-8 each is 512 MiB); the Triton backend sums them in
    one kernel (triton/expert_gate_up.py)."""
    return gate_up_composition(x, gate_weights, up_weights, offsets, gate_lora, up_lora, gather)


def gate_up_composition(x: torch.Tensor, gate_weights: Weights, up_weights: Weights,
                        offsets: Sequence[int] | torch.Tensor, gate_lora: ExpertLoraFactors | None,
                        up_lora: ExpertLoraFactors | None, gather: RowGather | None,
                        expert_linear_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused calls that define ``expert_gate_up``, through ``expert_linear_fn`` (a backend's own
    ``expert_linear``; default the op)."""
    fn = expert_linear_fn or expert_linear

    def product(weights: Weights, lora: ExpertLoraFactors | None) -> torch.Tensor:
        up = None if lora is None else lora.up(x, offsets, gather, fn)
        return fn(x, weights, offsets, lora=up, gather=gather)

    return product(gate_weights, gate_lora), product(up_weights, up_lora)


expert_gate_up.register("fast")(expert_gate_up.impls["torch"])  # the composition of fast expert_linear calls


def expert_lora_delta(lora: LoraUp, offsets: Sequence[int] | torch.Tensor, expert_linear_fn=None) -> torch.Tensor:
    """The experts' LoRA delta from its factors (the unfused composition that defines it): expert e's rows
    ``scale * t[rows] @ b[e]^T`` in fp32; ``expert_linear_fn``: a backend's own ``expert_linear`` (default the op)."""
    return lora_up_product(lora, expert_linear_fn or expert_linear, offsets)


def _per_expert_linear(x: torch.Tensor, weights: Weights, offs: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    n = weights[0].shape[0]
    parts = [linear(x[a:b], weights[e], out_dtype=out_dtype)
             for e, (a, b) in enumerate(zip(offs, offs[1:])) if b > a]
    if not parts:
        return x.new_zeros(0, n, dtype=out_dtype)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def expert_linear_ref(x: torch.Tensor, weights: Weights, offsets: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """float64 reference."""
    offs = as_offsets(offsets)
    _, n, _ = check_expert_args(x, weights, offs)
    y = x.new_zeros(x.shape[0], n, dtype=torch.float64)
    for e, (a, b) in enumerate(zip(offs, offs[1:])):
        if b > a:
            y[a:b] = x[a:b].double() @ weights[e].double().t()
    return y


@expert_linear.register("fast")
def _expert_linear_fast(x: torch.Tensor, weights: Weights, offsets: Sequence[int] | torch.Tensor,
                        out_dtype: torch.dtype | None = None, delta: torch.Tensor | None = None,
                        lora: LoraUp | None = None, gather: RowGather | None = None) -> torch.Tensor:
    """Stock kernels, not invariant: one ``torch._grouped_mm`` launch for stacked bf16 weights on CUDA
    (where this torch has it), else one cuBLAS/MKL ``F.linear`` per expert."""
    if gather is not None:
        check_gather(x, gather)
        x = gather.rows(x)
    delta = resolve_delta(delta, lora, "expert_linear", lambda up: expert_lora_delta(up, offsets, _expert_linear_fast))
    if delta is not None:
        return (_expert_linear_fast(x, weights, offsets, torch.float32) + delta).to(out_dtype or x.dtype)
    dev = device_offsets(offsets, x)
    if dev is not None:
        _, n, k = check_expert_shapes(x, weights, dev.shape[0])
    else:
        offs = as_offsets(offsets)
        _, n, k = check_expert_args(x, weights, offs)
    out_dtype = out_dtype or x.dtype
    if (isinstance(weights, torch.Tensor) and x.is_cuda and hasattr(torch, "_grouped_mm")
            and x.dtype == weights.dtype == torch.bfloat16 and n % 8 == 0 and k % 8 == 0 and x.shape[0] > 0):
        # _grouped_mm wants the cumulative row ends (int32, on the device) and B as [E, K, N]; device
        # offsets are handed over as they are (no host sync).
        if dev is not None:
            ends = dev[1:].to(torch.int32)
        else:
            ends = torch.tensor(offs[1:], dtype=torch.int32, device=x.device)
        return torch._grouped_mm(x.contiguous(), weights.transpose(-2, -1), offs=ends).to(out_dtype)
    if dev is not None:
        offs = as_offsets(dev)  # the per-expert loop needs host row ranges (a sync on CUDA)
        check_expert_args(x, weights, offs)
    y = x.new_empty(x.shape[0], n, dtype=out_dtype)
    for e, (a, b) in enumerate(zip(offs, offs[1:])):
        if b > a:
            w = weights[e]
            y[a:b] = F.linear(x[a:b], w.to(x.dtype)).to(out_dtype)
    return y
