"""Batch-invariant matmuls.

Stock CPU GEMMs (MKL/oneDNN) choose kernels and blockings from M, so row 0 of ``A[:m] @ W`` changes
with m. The construction here makes every GEMM call the library sees have one fixed shape:

* ``linear`` splits the rows into tiles of ``ROW_TILE`` (zero-padded) and runs one batched GEMM
  whose every batch element is ``[ROW_TILE, K] @ [K, N]`` against the same weight. The number of
  tiles changes with the batch; the per-tile problem, hence every row's K-loop, does not.
  N and K are padded to multiples of ``COL_TILE``: for N < 16 or ragged K, MKL otherwise switches
  to gemv-like paths whose result depends on the row's position in the tile (measured).
* ``bmm_fixed`` is for products whose per-matrix shape is fixed by the model, not by the batch
  (per-chunk KDA products, per-block attention scores): a batched GEMM's element b does not
  depend on how many other elements share the call.

All three reach the BLAS through ``_bmm``, which keeps a batch of one on MKL's batched GEMM where the
plain GEMM ATen would pick for it gives other bits (one-row and one-column products; see ``_bmm``).

bf16 inputs are computed in fp32 (bf16 products are exact in fp32) and rounded once at the end,
the same contract as a GPU kernel with fp32 accumulation. tests/kernels/test_matmul.py proves
invariance over batch size, row position, operand layout and thread count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ._dispatch import invariant_op

ROW_TILE = 16
COL_TILE = 16


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _batched_gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, r, c] with each element row-major or column-major (unit stride in one of the last two
    dims, the other at least as large as that dim's size): the layouts ATen hands to MKL's batched GEMM.
    Anything else ATen splits into one plain GEMM per element (another MKL routine), so it is copied."""
    _, rows, cols = t.shape
    s_row, s_col = t.stride(1), t.stride(2)
    if (s_col == 1 and s_row >= cols) or (s_row == 1 and s_col >= rows):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` (a [B, m, k], b [B, k, n]) whose element i does not depend on B nor on the
    thread count.

    On CPU, ATen runs a product of at least 400 multiply-adds per element as MKL's batched GEMM when
    B > 1, but as a plain GEMM (sgemm/dgemm) when B == 1, and as one plain GEMM per element when an
    operand's layout is neither row- nor column-major. The batched GEMM computes each element on one
    thread, so its bits depend neither on B nor on the thread count. The plain GEMM does neither
    reliably: under MKL's strict CNR mode it rounds a one-row product (e.g. the MLA scores [1, 80] @
    keys^T [80, 64] of a one-sequence decode step) differently from the batched one, and on CPUs where
    MKL ignores CNR (AMD) it splits the K reduction at 3 or more threads (a [16, 576] @ [576, 32]
    tile: other bits at 3 and 4 threads than at 1 and 2). So operands get a layout the batched path
    accepts, and a batch of one runs as a batch of two (the same element twice, a zero-copy expand):
    twice the work of a one-tile product, the price of its bits not depending on the machine."""
    if a.device.type != "cpu":
        return torch.bmm(a, b)
    a, b = _batched_gemm_operand(a), _batched_gemm_operand(b)
    if a.shape[0] == 1:
        return torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]
    return torch.bmm(a, b)


@dataclass(frozen=True)
class LoraUp:
    """The up half of a LoRA delta, ``scale * t @ b^T``, handed to a GEMM so that it computes the delta in
    its own launch instead of reading it from memory: t [..., r] fp32 (``x @ lora_A^T``, rows as the GEMM's x
    rows), b [N, r] fp32 (``lora_B``; [E, N, r] for ``expert_linear``), scale (``alpha / r``).

    Its value is defined as ``linear(t, b, out_dtype=fp32)`` (per expert for ``expert_linear``), times
    ``scale`` unless that is 1: a backend that fuses it computes that same product, so the output is
    bitwise the unfused ``delta`` path's."""

    t: torch.Tensor
    b: torch.Tensor
    scale: float = 1.0


@dataclass(frozen=True)
class LoraUpConcat:
    """The up halves of several adapters of one input side by side, handed to ``linear_concat``: t [..., sum r_s]
    fp32 (the adapters' A products side by side, rows as x's), bs (each adapter's ``lora_B`` [N_s, r_s] fp32, in
    the order of the concatenated weights), one scale.

    Its value is defined as ``linear_blockdiag(t, bs, out_dtype=fp32)`` times ``scale`` unless that is 1: column
    block s is ``lora_delta(LoraUp(t_s, bs[s], scale))`` bitwise (the block-diagonal product's contract), so a
    backend that fuses it into the GEMM gives each projection the bits ``linear(x, w_s, lora=...)`` gives it."""

    t: torch.Tensor
    bs: tuple[torch.Tensor, ...]
    scale: float = 1.0


def lora_up_product(lora: LoraUp | LoraUpConcat, product: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``scale * product(t, b, *args, out_dtype=...)`` in fp32 (fp64 for fp64 factors: gradchecks), the
    multiply skipped at scale 1: the composition that defines a LoraUp's delta, for ``linear`` and, with the
    expert offsets as ``args``, ``expert_linear``; and a LoraUpConcat's, with its Bs as the block-diagonal
    product's weights."""
    bs = list(lora.bs) if isinstance(lora, LoraUpConcat) else [lora.b]
    acc = torch.float64 if any(f.dtype == torch.float64 for f in (lora.t, *bs)) else torch.float32
    d = product(lora.t, bs if isinstance(lora, LoraUpConcat) else lora.b, *args, out_dtype=acc)
    return d if lora.scale == 1.0 else lora.scale * d


def lora_delta(lora: LoraUp, linear_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``lora``'s delta [..., N] (the unfused composition that defines it); ``linear_fn``: a backend's own
    ``linear`` (default the op)."""
    return lora_up_product(lora, linear_fn or linear)


def grouped_lora_delta(lora: LoraUp, grouped_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """A per-group LoraUp's delta [G, M, N]: ``scale * grouped_linear(t, b)`` in fp32 (the unfused composition that
    defines it); ``grouped_fn``: a backend's own ``grouped_linear`` (default the op)."""
    return lora_up_product(lora, grouped_fn or grouped_linear)


def lora_concat_delta(lora: LoraUpConcat, blockdiag_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``lora``'s delta [..., sum N_s] (the unfused composition that defines it); ``blockdiag_fn``: a backend's
    own ``linear_blockdiag`` (default the op)."""
    return lora_up_product(lora, blockdiag_fn or linear_blockdiag)


def resolve_delta(delta: torch.Tensor | None, lora: LoraUp | LoraUpConcat | None, op: str,
                  delta_of: Callable[..., torch.Tensor] = lora_delta) -> torch.Tensor | None:
    """The one delta of a call given ``delta`` or ``lora`` (not both); ``delta_of`` computes a LoraUp's. Each
    backend passes its own product: a call on one backend never takes its delta from another (on CUDA the op
    dispatches to Triton, so the torch reference called directly would otherwise mix the two)."""
    if lora is None:
        return delta
    if delta is not None:
        raise ValueError(f"{op}: pass delta or lora, not both")
    return delta_of(lora)


@invariant_op
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    delta: torch.Tensor | None = None,
    lora: LoraUp | None = None,
) -> torch.Tensor:
    """``y = x @ weight.T (+ bias) (+ delta)`` with each row computed independently of the others.

    x: [..., K]; weight: [N, K]; returns [..., N] in ``out_dtype`` (default x.dtype). ``delta``: an
    fp32 [..., N] tensor (a LoRA delta) joined to the fp32 result before the single rounding. This (torch)
    backend adds it after the sum: bitwise ``(linear(x, weight, bias, torch.float32) + delta).to(out_dtype)``;
    the Triton GEMM starts its accumulator from it (the K products accumulate onto the delta, one pass; its
    module doc). ``lora`` (instead of ``delta``): the delta as its factors, ``delta = lora_delta(lora)``, which
    the Triton GEMM computes in the same launch; on every backend ``lora=`` gives ``delta=``'s bits.
    """
    delta = resolve_delta(delta, lora, "linear", lambda up: lora_delta(up, linear.impls["torch"]))
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: x has {k} features but weight is {tuple(weight.shape)}")
    cdt = _compute_dtype(x.dtype)
    x2 = x.reshape(-1, k).to(cdt)
    w = weight.to(cdt)
    m = x2.shape[0]
    kp, np_ = _round_up(k, COL_TILE), _round_up(n, COL_TILE)
    mp = _round_up(max(m, 1), ROW_TILE)
    x2 = F.pad(x2, (0, kp - k, 0, mp - m))
    if kp != k or np_ != n:
        w = F.pad(w, (0, kp - k, 0, np_ - n))
    tiles = x2.view(mp // ROW_TILE, ROW_TILE, kp)
    y = _bmm(tiles, w.t().unsqueeze(0).expand(tiles.shape[0], kp, np_))
    y = y.reshape(mp, np_)[:m, :n]
    if bias is not None:
        y = y + bias.to(cdt)
    if delta is not None:
        y = y + check_delta(delta, (*lead, n)).reshape(m, n).to(cdt)
    return y.reshape(*lead, n).to(out_dtype)


def check_delta(delta: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``delta`` of a linear / expert_linear: the output's shape, fp32 (fp64 in gradchecks)."""
    if tuple(delta.shape) != tuple(shape) or delta.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"delta must be an fp32 tensor of the output's shape {tuple(shape)}, got "
                         f"{delta.dtype} {tuple(delta.shape)}")
    return delta


@invariant_op
def bmm_fixed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b`` over leading dims; the per-matrix shape must not depend on the batch.

    a: [..., m, k], b: [..., k, n] (broadcast leading dims); computed in fp32 (fp64 for fp64).
    """
    cdt = _compute_dtype(a.dtype)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.to(cdt).expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.to(cdt).expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return _bmm(a3, b3).reshape(*lead, a.shape[-2], b.shape[-1])


@linear.register("fast")
def _linear_fast(x, weight, bias=None, out_dtype=None, delta=None, lora=None):
    delta = resolve_delta(delta, lora, "linear", lambda up: lora_delta(up, _linear_fast))
    y = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return y.to(out_dtype or x.dtype) if delta is None else (y.float() + delta).to(out_dtype or x.dtype)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference."""
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


@invariant_op
def linear_concat(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    out_dtype: torch.dtype | None = None,
    delta: torch.Tensor | None = None,
    lora: LoraUpConcat | None = None,
) -> torch.Tensor:
    """Several projections of the same input at once: bitwise ``torch.cat([linear(x, w) for w in
    weights], -1)``.

    x: [..., K]; weights: [N_i, K] each (same K and dtype); returns [..., sum N_i] in ``out_dtype``
    (default x.dtype). Every output element keeps the K loop ``linear`` gives it, so the result does
    not depend on which other weights share the call; the Triton backend computes all of them in one
    launch (one weight read per layer input instead of one launch per projection at decode).
    ``delta``: fp32 [..., sum N_i] (the LoRA deltas side by side), added before the one rounding as in
    ``linear``: column block i is bitwise ``linear(x, weights[i], out_dtype=out_dtype, delta=delta_i)``.
    ``lora`` (instead of ``delta``): the deltas as their up factors, ``delta = lora_concat_delta(lora)``, which
    the Triton GEMM computes in the same launch (``project()``'s adapted projections of one input).
    """
    if not weights:
        raise ValueError("linear_concat: no weights")
    delta = resolve_delta(delta, lora, "linear_concat", lambda up: lora_concat_delta(up, linear_blockdiag.impls["torch"]))
    widths = [w.shape[0] for w in weights]
    if delta is None:
        return torch.cat([linear(x, w, out_dtype=out_dtype) for w in weights], dim=-1)
    parts = check_delta(delta, (*x.shape[:-1], sum(widths))).split(widths, dim=-1)
    return torch.cat([linear(x, w, out_dtype=out_dtype, delta=d) for w, d in zip(weights, parts)], dim=-1)


@invariant_op
def linear_blockdiag(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A block-diagonal product: column block s is ``linear(x[..., slice_s], weights[s])`` bitwise, where
    slice_s is the s-th K_s-wide block of x's columns.

    x: [..., sum K_s]; weights: [N_s, K_s] each (one dtype); returns [..., sum N_s] in ``out_dtype``
    (default x.dtype). The LoRA use: the B factors of several adapters of one input applied to their
    A products side by side (``lora_concat_delta``), which the Triton backend runs as one launch.
    """
    ks = check_blockdiag(x, weights)
    return torch.cat([linear(xs, w, out_dtype=out_dtype) for xs, w in zip(x.split(ks, dim=-1), weights)], dim=-1)


def check_blockdiag(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[int]:
    """The blocks' widths K_s of a ``linear_blockdiag`` call, after checking that they tile x's columns."""
    if not weights:
        raise ValueError("linear_blockdiag: no weights")
    ks = [w.shape[-1] if w.dim() == 2 else -1 for w in weights]
    if min(ks) < 0 or sum(ks) != x.shape[-1]:
        raise ValueError(f"linear_blockdiag: x has {x.shape[-1]} features but the weights are "
                         f"{[tuple(w.shape) for w in weights]} (their K must sum to it)")
    return ks


@invariant_op
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
                   delta: torch.Tensor | None = None, lora: LoraUp | None = None) -> torch.Tensor:
    """Per-group ``linear``: ``y[g] = x[g] @ weight[g].T (+ delta[g])`` for x [G, M, K], weight [G, N, K].

    Each group's rows are tiled exactly like ``linear`` (ROW_TILE rows, N and K padded to COL_TILE),
    so a row's result equals ``linear(row, weight[g])`` bitwise and is independent of M and G.
    ``delta``: fp32 [G, M, N] (a LoRA term) joined to the fp32 result before the one rounding as ``linear``
    joins it (this backend: bitwise ``(grouped_linear(x, weight, torch.float32) + delta).to(out_dtype)``; the
    Triton GEMM starts from it). ``lora`` (instead of ``delta``): the delta as its factors, t [G, M, r] and b [G, N, r] fp32
    (b may be an expanded view: one B for every group), ``delta = grouped_lora_delta(lora)``, which the Triton
    GEMM computes in the same launch (no [G, M, N] fp32 delta written and read back). Used for per-head absorbed
    MLA projections (with their LoRA terms) and batched expert/LoRA weights.
    """
    delta = resolve_delta(delta, lora, "grouped_linear", lambda up: grouped_lora_delta(up, grouped_linear.impls["torch"]))
    out_dtype = out_dtype or x.dtype
    g, m, k = x.shape
    n = weight.shape[1]
    if weight.shape[0] != g or weight.shape[2] != k:
        raise ValueError(f"grouped_linear: x {tuple(x.shape)} vs weight {tuple(weight.shape)}")
    cdt = _compute_dtype(x.dtype)
    kp, np_ = _round_up(k, COL_TILE), _round_up(n, COL_TILE)
    mp = _round_up(max(m, 1), ROW_TILE)
    xp = F.pad(x.to(cdt), (0, kp - k, 0, mp - m)).view(g, mp // ROW_TILE, ROW_TILE, kp)
    w = weight.to(cdt)
    if kp != k or np_ != n:
        w = F.pad(w, (0, kp - k, 0, np_ - n))
    wt = w.transpose(1, 2).unsqueeze(1).expand(g, mp // ROW_TILE, kp, np_)
    y = _bmm(xp.reshape(-1, ROW_TILE, kp), wt.reshape(-1, kp, np_)).view(g, mp, np_)[:, :m, :n]
    if delta is not None:
        y = y + check_delta(delta, (g, m, n)).to(cdt)
    return y.to(out_dtype)


# ----------------------------------------------------------------------------- fast mode
# Stock kernels (cuBLAS/MKL): not invariant, for measuring what bitwise mode costs. Same output
# dtypes as the invariant ops.


@linear_concat.register("fast")
def _linear_concat_fast(x, weights, out_dtype=None, delta=None, lora=None):
    """One cuBLAS ``linear`` per weight (the stock kernels fast mode measures against)."""
    delta = resolve_delta(delta, lora, "linear_concat", lambda up: lora_concat_delta(up, _linear_blockdiag_fast))
    y = torch.cat([_linear_fast(x, w, None, None if delta is None else torch.float32) for w in weights], dim=-1)
    return y.to(out_dtype or x.dtype) if delta is None else (y + delta).to(out_dtype or x.dtype)


@linear_blockdiag.register("fast")
def _linear_blockdiag_fast(x, weights, out_dtype=None):
    """One cuBLAS ``linear`` per block."""
    ks = [w.shape[-1] for w in weights]
    return torch.cat([_linear_fast(xs, w, None, out_dtype) for xs, w in zip(x.split(ks, dim=-1), weights)], dim=-1)


@bmm_fixed.register("fast")
def _bmm_fixed_fast(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    cdt = _compute_dtype(a.dtype)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.matmul(a, b).to(cdt)  # cuBLAS accumulates 16-bit GEMMs in fp32
    return torch.matmul(a.to(cdt), b.to(cdt))


@grouped_linear.register("fast")
def _grouped_linear_fast(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
                         delta: torch.Tensor | None = None, lora: LoraUp | None = None) -> torch.Tensor:
    delta = resolve_delta(delta, lora, "grouped_linear", lambda up: grouped_lora_delta(up, _grouped_linear_fast))
    y = torch.bmm(x, weight.to(x.dtype).transpose(1, 2))
    return y.to(out_dtype or x.dtype) if delta is None else (y.float() + delta).to(out_dtype or x.dtype)
