"""Triton token log-probs and log-softmax of temperature-scaled logits (fast mode:
``logprob.py``).

One program per row. The row is read in column blocks of a fixed width (``row_block(V)``: a function of
the vocabulary size only) in ascending order, with an online max/sum kept per lane of the block
(``m_i = max(m_i, z)``, ``s_i = s_i * exp(m_old - m_i) + exp(z - m_i)``); at the end the lanes are merged
by one ``tl.max`` and one ``tl.sum`` (fixed trees for a fixed block). So the log-sum-exp of a row is a
function of that row alone, whatever the number or order of rows in the call. Semantics follow the
torch op (``zmrl/kernels_batch_invariant/logprob.py``):

* ``z = logits (fp32) / temperature`` as a correctly rounded division (``div_rn``) by fp32(T), skipped
  for T == 0 (greedy: raw logits) and T == 1; negative or non-finite T is a ValueError;
* non-finite ``z`` (NaN/Inf logits, or overflow after the division) raises the torch op's ValueError
  naming the first bad row (the kernel flags rows; the check costs one host sync, as in the torch op);
* ``token_logprobs = z[token] - lse`` and ``log_softmax = z - lse`` use the same ``z`` and ``lse``, so
  gathering the log-softmax gives the token log-prob bit for bit.

Backward is hand-written with stock torch ops (it need not be invariant): d z = g * (onehot - softmax)
for token log-probs and d z = g - softmax * sum(g) for log-softmax, divided by T when scaled.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import logprob as _ops
from ..logprob import _check_token_ids, _scales
from ._common import await_previous_kernel, pdl, row_block, row_warps

token_logprobs = _ops.token_logprobs
log_softmax = _ops.log_softmax


@triton.jit
def _logprob_kernel(x_ptr, tok_ptr, lp_ptr, ls_ptr, lse_ptr, bad_ptr, V, stride_row, temperature,
                    SCALE: tl.constexpr, PICK: tl.constexpr, WRITE_ALL: tl.constexpr, BLOCK: tl.constexpr):
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s_vec = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        c = start + cols
        msk = c < V
        z = tl.load(x_row + c, mask=msk, other=0.0).to(tl.float32)
        if SCALE:
            z = tl.math.div_rn(z, temperature)
        bad = tl.where(msk & ((z != z) | (tl.abs(z) == float("inf"))), 1, bad)
        z = tl.where(msk, z, float("-inf"))
        m_new = tl.maximum(m_vec, z)
        # m_new == -inf only in lanes that have seen no column yet (all real z are finite).
        empty = m_new == float("-inf")
        alpha = tl.where(empty, 0.0, tl.exp(m_vec - m_new))
        p = tl.where(empty, 0.0, tl.exp(z - m_new))
        s_vec = s_vec * alpha + p
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    s = tl.sum(tl.where(m_vec == float("-inf"), 0.0, s_vec * tl.exp(m_vec - m)), axis=0)
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    tl.store(bad_ptr + row, tl.max(bad, axis=0))
    if PICK:
        tok = tl.load(tok_ptr + row).to(tl.int64)
        zt = tl.load(x_row + tok).to(tl.float32)
        if SCALE:
            zt = tl.math.div_rn(zt, temperature)
        tl.store(lp_ptr + row, zt - lse)
    if WRITE_ALL:
        for start in range(0, V, BLOCK):
            c = start + cols
            msk = c < V
            z = tl.load(x_row + c, mask=msk, other=0.0).to(tl.float32)
            if SCALE:
                z = tl.math.div_rn(z, temperature)
            tl.store(ls_ptr + row * V + c, z - lse, mask=msk)


def _raise_if_nonfinite(bad: torch.Tensor, lead_shape: torch.Size, temperature: float) -> None:
    """The torch op's error for non-finite scaled logits, naming the first bad row."""
    if bad.numel() == 0 or not bool(bad.any()):
        return
    flat = int(bad.nonzero()[0, 0])
    row: object = flat
    if len(lead_shape) > 1:
        row = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(lead_shape)))
    raise ValueError(f"logits row {row} contains NaN or Inf (after dividing by temperature {temperature})")


def _launch(logits: torch.Tensor, token_ids: torch.Tensor | None, temperature: float,
            write_all: bool, check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (token log-probs [R] or empty, log-softmax [R, V] or empty, lse [R]); raises on non-finite
    (``check=False``: does not look, no host synchronisation)."""
    _ops._check_temperature(temperature)
    v = logits.shape[-1]
    # Rows may be strided (e.g. a column slice logits[:, :vocab]); columns must be unit-stride.
    x = logits.reshape(-1, v)
    if v and x.stride(-1) != 1:
        x = x.contiguous()
    r = x.shape[0]
    dev = logits.device
    lse = torch.empty(r, dtype=torch.float32, device=dev)
    bad = torch.zeros(r, dtype=torch.int32, device=dev)
    lp = torch.empty(r if token_ids is not None else 0, dtype=torch.float32, device=dev)
    ls = torch.empty((r, v) if write_all else (0,), dtype=torch.float32, device=dev)
    tok = token_ids.reshape(-1).contiguous() if token_ids is not None else lse
    if r and v:
        block = row_block(v)
        _logprob_kernel[(r,)](x, tok, lp, ls, lse, bad, v, x.stride(0), float(temperature),
                              SCALE=_scales(temperature), PICK=token_ids is not None, WRITE_ALL=write_all,
                              BLOCK=block, num_warps=row_warps(block), **pdl())
    if check:
        _raise_if_nonfinite(bad, logits.shape[:-1], temperature)
    return lp, ls, lse


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:  # type: ignore[override]
        lp, _, lse = _launch(logits, token_ids, temperature, write_all=False)
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.temperature = temperature
        return lp.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        logits, token_ids, lse = ctx.saved_tensors
        t = ctx.temperature
        v = logits.shape[-1]
        z = logits.reshape(-1, v).to(torch.float32)
        if _scales(t):
            z = z / t
        g = grad.reshape(-1, 1).to(torch.float32)
        dz = torch.exp(z - lse[:, None]).mul_(-g)  # -g * softmax
        dz.scatter_add_(1, token_ids.reshape(-1, 1).long(), g)
        if _scales(t):
            dz = dz / t
        return dz.reshape(logits.shape).to(logits.dtype), None, None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float) -> torch.Tensor:  # type: ignore[override]
        _, ls, _ = _launch(logits, None, temperature, write_all=True)
        out = ls.reshape(logits.shape)
        ctx.save_for_backward(out)
        ctx.temperature = temperature
        ctx.in_dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        g = grad.to(torch.float32)
        dz = g - torch.exp(out) * g.sum(-1, keepdim=True)
        if _scales(ctx.temperature):
            dz = dz / ctx.temperature
        return dz.to(ctx.in_dtype), None


@token_logprobs.register("triton")
def token_logprobs_triton(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, *,
                          check: bool = True) -> torch.Tensor:
    if check:
        _check_token_ids(logits, token_ids)
    if logits.dtype == torch.float64:  # gradchecks only: the torch backend computes in fp64
        return token_logprobs.impls["torch"](logits, token_ids, temperature, check=check)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogprobs.apply(logits, token_ids, temperature)
    lp, _, _ = _launch(logits, token_ids, temperature, write_all=False, check=check)
    return lp.reshape(logits.shape[:-1])


@log_softmax.register("triton")
def log_softmax_triton(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    if logits.dtype == torch.float64:
        return log_softmax.impls["torch"](logits, temperature)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogSoftmax.apply(logits, temperature)
    _, ls, _ = _launch(logits, None, temperature, write_all=True)
    return ls.reshape(logits.shape)
