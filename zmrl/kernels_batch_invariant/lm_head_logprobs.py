"""Token log-probs through the output projection, chunk by chunk over rows: the trainer's ``lm_head`` +
log-prob, without the [R, V] logits of a whole micro-batch (nor their gradient) ever existing at once.

    lp[r] = token_logprobs(linear(hidden[r], weight, bias, out_dtype=float32), token_ids[r], T_r)

Forward: the rows are cut into chunks of ``chunk_rows``; each chunk calls the very ops the rollout
engine calls when it samples (``linear`` for the fp32 logits, as ``HybridForCausalLM.compute_logits``
does, then ``token_logprobs``, as the sampler does), on whichever backend the tensors' device selects.
Both ops compute each row independently of the other rows in the call (docs/numerics.md), so a
row's log-prob has the same bits in any chunk, and the same bits as the unchunked call and the
engine's. Rows with different temperatures are passed to ``token_logprobs`` as separate calls (the
temperature is a scalar of the op), one per run of equal temperature inside a chunk.

Backward (correct and deterministic, not invariant): per chunk, in the same fixed order, the logits
are recomputed with the same ``linear`` and differentiated in closed form,

    dz = g * (onehot(token) - softmax(z / T)) / T         (T = 0 or 1: no division, as in the forward)
    d hidden = dz @ W,   d W += dz^T hidden,   d bias += sum_rows dz

so only one chunk's [chunk_rows, V] logits and their gradient are alive at a time. On CUDA, dz comes from
one fused kernel reading each row's logits twice and writing dz once in the GEMMs' dtype
(triton/logprob_grads.py: ~10 bytes moved per logit instead of ~28); the torch composition
``_softmax_grad_torch`` runs elsewhere and for fp64. The GEMMs are stock (cuBLAS 16-bit GEMMs with fp32
accumulation when hidden and weight share a 16-bit dtype on CUDA, as the Triton ``linear`` backward does;
fp32 otherwise, fp64 for fp64 inputs); weight and bias gradients accumulate over the chunks in fp32 in
chunk order.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .logprob import _check_temperature, _scales, token_logprobs
from .matmul import linear
from .numerics import with_backward_matmuls

# Rows per chunk when the caller does not say: 1024 rows of a 160K vocabulary are 0.6 GiB of fp32 logits.
DEFAULT_CHUNK_ROWS = 1024

Segments = Sequence[tuple[int, float]]


def _runs(segments: Segments, start: int, stop: int) -> list[tuple[int, int, float]]:
    """(first row, end row, temperature) of the runs of equal temperature that cover rows [start, stop)."""
    runs: list[tuple[int, int, float]] = []
    lo = 0
    for n, t in segments:
        hi = lo + n
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            if runs and runs[-1][1] == a and runs[-1][2] == t:
                runs[-1] = (runs[-1][0], b, t)
            else:
                runs.append((a, b, t))
        lo = hi
        if lo >= stop:
            break
    return runs


def _check(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, segments: Segments,
           chunk_rows: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"lm_head_token_logprobs: hidden {tuple(hidden.shape)} must be [R, D] and weight "
                         f"{tuple(weight.shape)} [V, D]")
    if token_ids.shape != hidden.shape[:1]:
        raise ValueError(f"lm_head_token_logprobs: token_ids {tuple(token_ids.shape)} must be [{hidden.shape[0]}]")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"lm_head_token_logprobs: token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.numel() and bool(((token_ids < 0) | (token_ids >= weight.shape[0])).any()):
        bad = ((token_ids < 0) | (token_ids >= weight.shape[0])).nonzero()[0, 0].item()
        raise ValueError(f"token id {int(token_ids[bad])} at position {bad} is outside the vocabulary "
                         f"[0, {weight.shape[0]})")
    if sum(n for n, _ in segments) != hidden.shape[0] or any(n < 0 for n, _ in segments):
        raise ValueError(f"lm_head_token_logprobs: segments {[n for n, _ in segments]} must be non-negative row "
                         f"counts summing to {hidden.shape[0]}")
    for _, t in segments:
        _check_temperature(t)
    if chunk_rows < 1:
        raise ValueError(f"lm_head_token_logprobs: chunk_rows must be >= 1, got {chunk_rows}")


def _forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, token_ids: torch.Tensor,
             segments: Segments, chunk_rows: int) -> torch.Tensor:
    r = hidden.shape[0]
    zdt = _logits_dtype(hidden)
    out = torch.empty(r, dtype=zdt, device=hidden.device)
    for start in range(0, r, chunk_rows):
        stop = min(start + chunk_rows, r)
        logits = linear(hidden[start:stop], weight, bias, out_dtype=zdt)
        for a, b, t in _runs(segments, start, stop):
            out[a:b] = token_logprobs(logits[a - start:b - start], token_ids[a:b], t)
    return out


def _logits_dtype(hidden: torch.Tensor) -> torch.dtype:
    """fp32 logits, as ``compute_logits``; fp64 for fp64 hidden states (float64 gradchecks)."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _grad_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if hidden.dtype == torch.float64 or weight.dtype == torch.float64:
        return torch.float64
    if hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        return hidden.dtype
    return torch.float32


def _inverse_temperatures(segments: Segments, start: int, stop: int, z: torch.Tensor) -> torch.Tensor | None:
    """1/T per row of the chunk [start, stop) in z's dtype (1 where T is 0 or 1); None when no row is scaled
    (decided on the host: no device sync). The gradient's softmax multiplies by 1/T, where the forward
    divides by T: the two agree to rounding."""
    runs = _runs(segments, start, stop)
    if not any(_scales(t) for _, _, t in runs):
        return None
    inv_t = torch.ones(stop - start, dtype=z.dtype, device=z.device)
    for a, b, t in runs:
        if _scales(t):
            inv_t[a - start:b - start] = 1.0 / t
    return inv_t


def _softmax_grad_torch(z: torch.Tensor, token_ids: torch.Tensor, g: torch.Tensor, inv_t: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """dz = inv_t * g * (onehot(token_ids) - softmax(z * inv_t)) [C, V] in ``out_dtype``, from logits z [C, V]
    (overwritten), token_ids [C], g [C] and inv_t [C] (None: no row scaled) in z's dtype: the torch
    composition, for fp64 and where the fused kernel (triton/logprob_grads.py) does not run."""
    if inv_t is not None:
        z.mul_(inv_t[:, None])
    dz = torch.softmax(z, dim=-1)
    g = g[:, None]
    dz.mul_(-g).scatter_add_(1, token_ids[:, None].long(), g)
    if inv_t is not None:
        dz.mul_(inv_t[:, None])
    return dz.to(out_dtype)


SoftmaxGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.dtype], torch.Tensor]
_softmax_grad_kernel: tuple[SoftmaxGrad, Callable[[torch.device], bool]] | None = None


def register_softmax_grad_kernel(fn: SoftmaxGrad, runs_on: Callable[[torch.device], bool]) -> None:
    """Install a fused ``_softmax_grad_torch`` (same arguments; fp32 logits only, z left unmodified) for devices
    where ``runs_on(device)`` (triton/logprob_grads.py); elsewhere the torch composition runs."""
    global _softmax_grad_kernel
    _softmax_grad_kernel = (fn, runs_on)


def _softmax_grad(z: torch.Tensor) -> SoftmaxGrad:
    if _softmax_grad_kernel is not None and z.dtype == torch.float32 and _softmax_grad_kernel[1](z.device):
        return _softmax_grad_kernel[0]
    return _softmax_grad_torch


class _LMHeadTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                token_ids: torch.Tensor, segments: Segments, chunk_rows: int) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, bias, token_ids)
        ctx.segments, ctx.chunk_rows = segments, chunk_rows
        return _forward(hidden, weight, bias, token_ids, segments, chunk_rows)

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, token_ids = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        r = hidden.shape[0]
        zdt = _logits_dtype(hidden)
        gdt = _grad_dtype(hidden, weight)
        w = weight.to(gdt)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=zdt, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=zdt, device=bias.device) if need_b else None
        g_all = grad.to(zdt)
        # The bias gradient is summed over the rows from the fp32 dz (the model's lm_head has no bias: rare),
        # so dz is then produced in fp32 and rounded to the GEMMs' dtype after the sum.
        dz_dtype = zdt if need_b else gdt
        for start in range(0, r, ctx.chunk_rows):
            stop = min(start + ctx.chunk_rows, r)
            h = hidden[start:stop]
            with torch.no_grad():
                z = linear(h, weight, bias, out_dtype=zdt)
            inv_t = _inverse_temperatures(ctx.segments, start, stop, z)
            dz = _softmax_grad(z)(z, token_ids[start:stop], g_all[start:stop], inv_t, dz_dtype)
            del z
            if need_b:
                db += dz.sum(0)
                dz = dz.to(gdt)
            if need_h:
                dh[start:stop] = (dz @ w).to(hidden.dtype)
            if need_w:
                dw += (dz.t() @ h.to(gdt)).to(zdt)
        return (dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None)


def lm_head_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           token_ids: torch.Tensor, segments: Segments,
                           chunk_rows: int | None = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Per-row ``log_softmax(linear(hidden, weight, bias, fp32) / T)[token]``, chunked over rows.

    hidden: [R, D]; weight: [V, D]; bias: [V] or None; token_ids: [R] integer; segments: consecutive
    (row count, temperature) runs covering the R rows (one per sequence, typically); chunk_rows: rows per
    chunk (None: all rows in one chunk). Returns [R] fp32, bitwise equal per row to
    ``token_logprobs(linear(hidden, weight, bias, out_dtype=torch.float32), token_ids, T)``. fp64 hidden
    states (float64 gradchecks) get fp64 logits and log-probs.
    """
    chunk = max(hidden.shape[0], 1) if chunk_rows is None else chunk_rows
    _check(hidden, weight, token_ids, segments, chunk)
    segments = tuple((int(n), float(t)) for n, t in segments)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)):
        return _LMHeadTokenLogprobs.apply(hidden, weight, bias, token_ids, segments, chunk)
    return _forward(hidden, weight, bias, token_ids, segments, chunk)


def lm_head_token_logprobs_ref(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               token_ids: torch.Tensor, segments: Segments) -> torch.Tensor:
    """float64 reference (autograd-differentiable)."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    temps = torch.cat([torch.full((n,), t if t > 0 else 1.0, dtype=torch.float64) for n, t in segments]
                      ) if segments else torch.ones(0, dtype=torch.float64)
    z = z / temps.to(z.device)[:, None]
    return z.gather(-1, token_ids.long()[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


__all__ = ["DEFAULT_CHUNK_ROWS", "lm_head_token_logprobs", "lm_head_token_logprobs_ref"]
