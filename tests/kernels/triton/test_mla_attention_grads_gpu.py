"""The MLA backward (kernels_batch_invariant/mla_attention_grads.py) on the GPU at the bench preset's
head shape with the model's dtypes: every position of two sequences as a query (as in training),
sparse key lists, bf16 cache and queries, so the TF32 products run. Against autograd of the float64
reference, relative Frobenius error per gradient: the gradients are returned in bf16 (2^-8 relative
rounding) from TF32 products (2^-11 per operand) over a few hundred keys, measured errors are printed
(``-s``); 1e-2 leaves margin while a wrong term is O(1). Two backward passes give equal bits.
With ``backward_matmul_precision="bf16"`` (bf16 GEMM operands, fp32 accumulation: P and dS round to
2^-8 as in FlashAttention's backward) the same checks hold with 2e-2 (the operands' rounding is 8x TF32's; measured 3e-3).
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_attention import make_paged_cache, sparse_key_positions
from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.mla_attention import mla_attention, mla_attention_ref

pytestmark = [pytest.mark.gpu]

H, DC, DR, WIDTH, SCALE = 64, 512, 64, 256, 576 ** -0.5


@pytest.fixture(scope="module")
def problem():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lens = [1200, 700]
    cache, bt, _ = make_paged_cache(lens, 64, DC + DR, torch.float32, seed=11)
    cache = cache.nan_to_num(0.0).to(torch.bfloat16)
    sidx = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lens)])
    qpos = torch.cat([torch.arange(n) for n in lens])
    kp = sparse_key_positions(qpos, width=WIDTH, seed=12, keep=0.5)
    g = torch.Generator().manual_seed(13)
    q_lat = torch.randn(len(qpos), H, DC, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(len(qpos), H, DR, generator=g).to(torch.bfloat16)
    go = torch.randn(len(qpos), H, DC, generator=g).to(torch.bfloat16)
    dev = torch.device("cuda")
    return tuple(t.to(dev) for t in (cache, bt, sidx, kp, q_lat, q_pe, go))


def _grads(fn, problem, dtype):
    cache, bt, sidx, kp, q_lat, q_pe, go = problem
    xs = [t.detach().to(dtype).requires_grad_() for t in (q_lat, q_pe, cache)]
    out = fn(*xs, bt, sidx, kp, SCALE, DC)
    out.backward(go.to(out.dtype))
    return [x.grad for x in xs]


@pytest.mark.parametrize("precision, tol", [("tf32", 1e-2), ("bf16", 2e-2)])
def test_bf16_gradients_match_float64_and_are_deterministic(problem, precision, tol):
    with numerics_scope(current_numerics().replace(backward_matmul_precision=precision)):
        got = _grads(mla_attention, problem, torch.bfloat16)
        again = _grads(mla_attention, problem, torch.bfloat16)
    want = _grads(mla_attention_ref, problem, torch.float64)
    errs = {n: float((a.double() - b).norm() / b.norm()) for n, a, b in zip(("q_lat", "q_pe", "kv_cache"), got, want)}
    print(f"\nMLA backward (bf16 inputs, {precision} GEMMs) rel. error vs float64:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(v < tol for v in errs.values()), errs
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "MLA backward is not deterministic"
    if precision != "tf32":  # the other path was taken
        with numerics_scope(current_numerics().replace(backward_matmul_precision="tf32")):
            tf32 = _grads(mla_attention, problem, torch.bfloat16)
        assert not all(torch.equal(a, b) for a, b in zip(got, tf32))
