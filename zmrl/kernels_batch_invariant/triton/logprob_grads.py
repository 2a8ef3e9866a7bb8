"""Triton kernel of the chunked lm_head + log-prob backward (``lm_head_logprobs._LMHeadTokenLogprobs``):
the logit gradient of one chunk of rows in one kernel, written in the dtype of the GEMMs that consume it.

* ``softmax_grad``: from the chunk's fp32 logits z [C, V] (unit column stride; the rows may be padded, as
  ``linear``'s output rows are), the token ids [C], the output gradients g [C] fp32 and the rows' inverse
  temperatures inv_t [C] fp32 (None: no row is scaled),

      p = softmax(z * inv_t_row),   dz = inv_t_row * g_row * (onehot(token_row) - p)      [C, V]

  in ``out_dtype`` (bf16 or fp16 on CUDA for the 16-bit GEMMs, fp32 otherwise), by the fp32 formula of
  the torch composition (``lm_head_logprobs._softmax_grad_torch``): -g p, plus g at the token, times
  inv_t; the softmax's sum is taken in another order (and the GPU may fuse a product and a sum into one
  FMA), so the two agree to a few ulps, not bitwise.

Why: V is the vocabulary (163840), so these [C, V] passes are the backward's memory traffic besides its
GEMMs. The torch composition moves about 28 bytes per logit (softmax: read 4, write 4; the multiply by -g:
8; the cast to bf16, once per GEMM: 12), 44 with a temperature (a scaling pass before the softmax and
after it: 8 each). Here: the logits read twice (4 + 4: an online max / sum pass, then the output pass,
partly from L2) and dz written once (2 bytes in bf16, 4 in fp32): 10 bytes per logit, 12 in fp32.

Registered on ``lm_head_logprobs`` for CUDA tensors (and CPU tensors under the interpreter, the CPU
tests); elsewhere, and for fp64 logits, the torch composition there runs, which
tests/kernels/triton/test_logprob_grads.py compares this with. The backward need not be batch-invariant,
only correct and deterministic: one program per row walks its columns in fixed blocks in ascending order
(the block is a function of V only), with no atomics, so every element has the same bits in every call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import lm_head_logprobs as _lm_head
from ._common import INTERPRET, await_previous_kernel, pdl, row_block, row_warps

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _softmax_grad_kernel(z_ptr, tok_ptr, g_ptr, inv_t_ptr, dz_ptr, V, stride_z, SCALE: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One program per row: the online max / sum of the (scaled) logits per lane of a column block, merged
    across lanes at the end, then dz, ascending column blocks. dz's dtype is the one of ``dz_ptr``."""
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK)
    if SCALE:
        inv_t = tl.load(inv_t_ptr + row)
    m_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s_vec = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        c = start + cols
        z = tl.load(z_row + c, mask=c < V, other=float("-inf"))
        if SCALE:
            z = z * inv_t  # inv_t > 0: padding stays -inf
        m_new = tl.maximum(m_vec, z)
        # m_new == -inf only in lanes that have seen no column yet (the forward checked the logits finite):
        # shifting those by 0 instead keeps (-inf) - (-inf) out, and their terms are exp(-inf) = 0
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - shift) + tl.exp(z - shift)
        m_vec = m_new
    m = tl.max(m_vec, axis=0)  # finite: V >= 1
    inv_sum = 1.0 / tl.sum(s_vec * tl.exp(m_vec - m), axis=0)  # lanes without a column: 0 * exp(-inf)
    g = tl.load(g_ptr + row)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    for start in range(0, V, BLOCK):
        c = start + cols
        live = c < V
        z = tl.load(z_row + c, mask=live, other=0.0)
        if SCALE:
            z = z * inv_t
        dz = -g * (tl.exp(z - m) * inv_sum)
        dz = tl.where(c == tok, dz + g, dz)
        if SCALE:
            dz = dz * inv_t
        tl.store(dz_ptr + row * V + c, dz.to(dz_ptr.dtype.element_ty), mask=live)


def softmax_grad(z: torch.Tensor, token_ids: torch.Tensor, g: torch.Tensor, inv_t: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """z [C, V] fp32 with unit column stride, token_ids [C] integer, g [C] fp32, inv_t [C] fp32 or None ->
    dz = inv_t * g * (onehot(token_ids) - softmax(z * inv_t)) [C, V] contiguous in ``out_dtype`` (z is not
    modified)."""
    if z.dim() != 2 or z.stride(1) != 1 or z.dtype != torch.float32:
        raise ValueError(f"softmax_grad: z must be a 2-D float32 tensor with unit column stride, got "
                         f"{tuple(z.shape)} {z.dtype} with strides {z.stride()}")
    rows, vocab = z.shape
    for name, t in (("token_ids", token_ids), ("g", g), ("inv_t", inv_t)):
        if t is not None and t.shape != (rows,):
            raise ValueError(f"softmax_grad: {name} {tuple(t.shape)} must be [{rows}]")
    if g.dtype != torch.float32 or (inv_t is not None and inv_t.dtype != torch.float32):
        raise ValueError(f"softmax_grad: g and inv_t must be float32, got {g.dtype} and "
                         f"{None if inv_t is None else inv_t.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"softmax_grad: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    dz = torch.empty(rows, vocab, dtype=out_dtype, device=z.device)
    if rows and vocab:
        block = row_block(vocab)
        g = g.contiguous()  # an output gradient may come expanded (stride 0), e.g. from .sum().backward()
        scale = inv_t is not None
        _softmax_grad_kernel[(rows,)](z, token_ids.contiguous(), g, inv_t.contiguous() if scale else g, dz, vocab,
                                      z.stride(0), SCALE=scale, BLOCK=block, num_warps=row_warps(block), **pdl())
    return dz


def _runs_here(device: torch.device) -> bool:
    """CUDA tensors, and CPU tensors under the interpreter (the CPU tests of this kernel)."""
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")


_lm_head.register_softmax_grad_kernel(softmax_grad, _runs_here)
