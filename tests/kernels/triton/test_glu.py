"""Triton swiglu / situ_glu: float64 reference, row invariance, gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.glu import situ_glu, situ_glu_ref, swiglu, swiglu_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes, randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

# A handful of fp32 roundings per element plus exp's error (<= 2 ulp, x4 through tanh's quotient):
# ~1e-6 relative; rtol 1e-5. atol 1e-6 covers products that cancel to ~0 (g ~ 0).
RTOL, ATOL = 1e-5, 1e-6
OPS = [(swiglu, swiglu_ref), (situ_glu, situ_glu_ref)]


def _inputs(n: int, i: int, device, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = randn(n, i, device=device, seed=seed, scale=4.0, dtype=dtype)
    u = randn(n, i, device=device, seed=seed + 1, scale=30.0, dtype=dtype)
    return g, u


@pytest.mark.parametrize("op,ref", OPS, ids=["swiglu", "situ_glu"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_glu_matches_float64(device, interpret, op, ref, in_dtype) -> None:
    for i in ([1, 7, 256, 1030] if interpret else [1, 7, 256, 1030, 2048]):
        g, u = _inputs(3, i, device, seed=i, dtype=in_dtype)
        got = triton_impl(op)(g, u, torch.float32)
        torch.testing.assert_close(got.double(), ref(g, u), rtol=RTOL, atol=ATOL)
    # small and huge arguments: the tanh/sigmoid branches (|x| < 1/4 polynomial, overflowing exp)
    vals = torch.tensor([0.0, 1e-6, -1e-4, 0.2, -0.26, 3.0, -30.0, 90.0, -100.0, 500.0], device=device)
    g, u = vals[:, None].expand(10, 10).contiguous(), vals[None, :].expand(10, 10).contiguous() * 25
    torch.testing.assert_close(triton_impl(op)(g, u).double(), ref(g, u), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("beta,linear_beta", [(1.0, None), (2.0, 10.0)])
def test_situ_glu_betas(device, interpret, beta, linear_beta) -> None:
    g, u = _inputs(5, 70, device, seed=3)
    got = triton_impl(situ_glu)(g, u, torch.float32, beta, linear_beta)
    torch.testing.assert_close(got.double(), situ_glu_ref(g, u, beta, linear_beta), rtol=RTOL, atol=ATOL)
    assert_rows_invariant(lambda a, b: triton_impl(situ_glu)(a, b, None, beta, linear_beta), [g, u],
                          batch_sizes(interpret))


@pytest.mark.parametrize("op,ref", OPS, ids=["swiglu", "situ_glu"])
def test_glu_dtypes_errors_invariance(device, interpret, op, ref) -> None:
    g, u = _inputs(6 if interpret else 64, 256, device, seed=0, dtype=torch.bfloat16)
    y = triton_impl(op)(g, u)
    assert y.dtype == torch.bfloat16 and y.shape == g.shape
    with pytest.raises(ValueError, match="differ in shape"):
        triton_impl(op)(g, u[:, :-1])
    assert_rows_invariant(lambda a, b: triton_impl(op)(a, b), [g, u], batch_sizes(interpret))
    # expert hidden rows: [T, I] with I = 256 (bench) in fp32 out
    assert_rows_invariant(lambda a, b: triton_impl(op)(a, b, torch.float32), [g, u], batch_sizes(interpret))


@pytest.mark.parametrize("op,ref", OPS, ids=["swiglu", "situ_glu"])
def test_glu_reads_fused_halves_in_place(device, interpret, op, ref) -> None:
    """gate and up as the two column halves of one fused projection output (the shared expert's gate|up):
    the bits of contiguous copies, in 2-D and with leading dims."""
    fused = randn(5, 2 * 96, device=device, seed=11, scale=4.0, dtype=torch.bfloat16)
    g, u = fused[:, :96], fused[:, 96:]
    assert torch.equal(triton_impl(op)(g, u), triton_impl(op)(g.contiguous(), u.contiguous()))
    g3, u3 = fused.view(5, 2, 96)[:, 0:1], fused.view(5, 2, 96)[:, 1:2]
    assert torch.equal(triton_impl(op)(g3, u3, torch.float32),
                       triton_impl(op)(g3.contiguous(), u3.contiguous(), torch.float32))


@pytest.mark.parametrize("op,ref", OPS, ids=["swiglu", "situ_glu"])
def test_glu_gradient(device, interpret, op, ref) -> None:
    g, u = _inputs(4, 33, device, seed=5)
    g.requires_grad_(True)
    u.requires_grad_(True)
    gy = randn(4, 33, device=device, seed=7)
    got = torch.autograd.grad(triton_impl(op)(g, u), (g, u), gy)
    gd, ud = g.detach().double().requires_grad_(True), u.detach().double().requires_grad_(True)
    want = torch.autograd.grad(ref(gd, ud), (gd, ud), gy.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
