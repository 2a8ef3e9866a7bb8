"""``backward_gemms``: the hand-written backwards' 16-bit products with fp32 output, checked on the CPU (their
exact-fp32 branch) and, where a GPU is present, through cuBLAS's fp32-output path."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.backward_gemms import fp32_out_gemms, mm_f32, mm_fp32_factor

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_factor_product_is_the_product_to_16_bits(device, dtype):
    """a @ f for a 16-bit a and an fp32 f (f as its hi + lo 16-bit halves): against float64, the error is that of
    f carried to ~2^-17 (bf16) / 2^-23 (fp16, whose 11-bit halves hold more of it) relative plus fp32 accumulation
    over K terms: 2^-15 of sum |a||f| bounds both, while dropping the lo half (bf16: 2^-9) exceeds it."""
    dev = torch.device(device)
    if not fp32_out_gemms(dev):
        pytest.skip("this torch has no fp32-output 16-bit mm")
    g = torch.Generator().manual_seed(5)
    a = torch.randn(37, 300, generator=g).to(dev, dtype)
    f = torch.randn(300, 24, generator=g).to(dev)
    got = mm_fp32_factor(a, f)
    assert got.dtype == torch.float32 and got.shape == (37, 24)
    want = a.double() @ f.double()
    scale = a.double().abs() @ f.double().abs()
    assert ((got.double() - want).abs() <= 2**-15 * scale).all()
    hi_only = mm_f32(a, f.to(dtype)).double()
    if dtype == torch.bfloat16:
        assert ((hi_only - want).abs() > 2**-15 * scale).any(), "the bound is tight enough to see the lo half"
    # a transposed view as the 16-bit operand (the weight-gradient product g^T @ t): the same bound
    t = torch.randn(37, 8, generator=g).to(dev)
    got_t = mm_fp32_factor(a.t(), t)
    want_t = a.double().t() @ t.double()
    assert got_t.shape == (300, 8)
    assert ((got_t.double() - want_t).abs() <= 2**-15 * (a.double().abs().t() @ t.double().abs())).all()


@pytest.mark.parametrize("device", DEVICES)
def test_mm_f32_scale_and_out(device):
    dev = torch.device(device)
    if not fp32_out_gemms(dev):
        pytest.skip("this torch has no fp32-output 16-bit mm")
    g = torch.Generator().manual_seed(6)
    a = torch.randn(9, 40, generator=g).to(dev, torch.bfloat16)
    b = torch.randn(40, 7, generator=g).to(dev, torch.bfloat16)
    exact = a.double() @ b.double()
    out = torch.full((9, 7), float("nan"), device=dev)
    got = mm_f32(a, b, 0.5, out=out)
    assert got.data_ptr() == out.data_ptr()  # written into out; its NaNs are not read (beta = 0)
    assert torch.allclose(got.double(), 0.5 * exact, rtol=1e-5, atol=1e-5)
