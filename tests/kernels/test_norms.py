"""rms_norm / layer_norm / rms_norm_gated: accuracy against float64, bitwise row invariance,
gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.norms import (
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_gated,
    rms_norm_gated_ref,
    rms_norm_ref,
)

from .invariance import assert_rows_invariant

DIMS = [1, 5, 64, 256, 1000]


def _x(t: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # non-zero mean and a spread of row scales, so LayerNorm's centring and eps both matter
    x = torch.randn(t, d, generator=g) * torch.rand(t, 1, generator=g).mul(10).add(0.01) + 0.5
    return x.to(dtype)


# Tolerance for fp32 results: the row statistic goes through a tree of depth log2(D) <= 10 adds
# (relative error <= 10u), x*x / d*d, rsqrt (~1-2 ulp) and 1-3 multiplies: <= ~16u ~ 1e-6 relative
# per element. rtol 1e-5 leaves margin; any real bug (wrong eps placement, sum instead of mean,
# missing weight/bias, unbiased variance) is >= 1e-3 relative for these D (D = 1000: 1/D).
RTOL32, ATOL32 = 1e-5, 1e-6
# bf16 outputs add one final rounding: 2^-9 relative.
RTOL16, ATOL16 = 2.0**-8, 1e-5


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("t", [1, 7, 33])
def test_rms_norm_matches_float64(t: int, d: int) -> None:
    x = _x(t, d, seed=d + t)
    w = torch.randn(d) * 0.5 + 1
    for weight in (w, None):
        got = rms_norm(x, weight, 1e-6)
        assert got.dtype == torch.float32 and got.shape == x.shape
        torch.testing.assert_close(got.double(), rms_norm_ref(x, weight, 1e-6), rtol=RTOL32, atol=ATOL32)
    # eps matters when the row is tiny: 1e-4-sized rows with eps 1e-5 are far from x/rms(x)
    xs = x * 1e-4
    torch.testing.assert_close(rms_norm(xs, w, 1e-5).double(), rms_norm_ref(xs, w, 1e-5), rtol=RTOL32, atol=ATOL32)


@pytest.mark.parametrize("d", DIMS)
def test_layer_norm_matches_float64(d: int) -> None:
    x = _x(13, d, seed=d)
    w, b = torch.randn(d) * 0.5 + 1, torch.randn(d) * 0.1
    for weight, bias in ((w, b), (None, None), (w, None), (None, b)):
        got = layer_norm(x, weight, bias, 1e-6)
        # (x - mean) cancels: its error is u*|x| absolute, i.e. u*|x|/std relative to the output;
        # rows here have |mean|/std <= ~50, so <= ~3e-6: still inside rtol + atol below.
        torch.testing.assert_close(got.double(), layer_norm_ref(x, weight, bias, 1e-6), rtol=RTOL32, atol=1e-5)


@pytest.mark.parametrize("d", [1, 5, 64, 128, 1000])
def test_rms_norm_gated_matches_float64(d: int) -> None:
    x = _x(3 * 4, d, seed=d).view(3, 4, d)  # [T, H, dk]
    gate = torch.randn(3, 4, d) * 4
    w = torch.randn(d) * 0.5 + 1
    got = rms_norm_gated(x, gate, w, 1e-5)
    assert got.shape == (3, 4, d)
    # as rms_norm plus the sigmoid (<= ~4u) and one more multiply
    torch.testing.assert_close(got.double(), rms_norm_gated_ref(x, gate, w, 1e-5), rtol=RTOL32, atol=ATOL32)
    # the fused op is exactly the unfused composition in fp32 (one rounding at the end)
    from zmrl.kernels_batch_invariant.pointwise import sigmoid
    assert torch.equal(got, rms_norm(x, w, 1e-5) * sigmoid(gate))


@pytest.mark.parametrize("d", [5, 64, 1000])
def test_bf16_inputs_and_out_dtype(d: int) -> None:
    x = _x(9, d, seed=d, dtype=torch.bfloat16)
    w = (torch.randn(d) * 0.5 + 1).bfloat16()
    b = (torch.randn(d) * 0.1).bfloat16()
    gate = torch.randn(9, d).bfloat16()
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), rms_norm_ref(x, w, 1e-6), rtol=RTOL16, atol=ATOL16)
    y32 = rms_norm(x, w, 1e-6, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), y)  # computed in fp32, rounded once
    ln = layer_norm(x, w, b, 1e-6)
    torch.testing.assert_close(ln.double(), layer_norm_ref(x, w, b, 1e-6), rtol=RTOL16, atol=1e-2)
    assert torch.equal(layer_norm(x, w, b, 1e-6, out_dtype=torch.float32).bfloat16(), ln)
    gn = rms_norm_gated(x, gate, w, 1e-5)
    torch.testing.assert_close(gn.double(), rms_norm_gated_ref(x, gate, w, 1e-5), rtol=RTOL16, atol=ATOL16)
    assert rms_norm(x.float(), w, 1e-6, out_dtype=torch.bfloat16).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariance(d: int, dtype: torch.dtype) -> None:
    x = _x(80, d, seed=d, dtype=dtype)
    gate = torch.randn(80, d).to(dtype)
    w = (torch.randn(d) * 0.5 + 1).to(dtype)
    b = (torch.randn(d) * 0.1).to(dtype)
    assert_rows_invariant(lambda x: rms_norm(x, w, 1e-6), (x,), seed=d)
    assert_rows_invariant(lambda x: layer_norm(x, w, b, 1e-6), (x,), seed=d + 1)
    assert_rows_invariant(lambda x, gt: rms_norm_gated(x, gt, w, 1e-5), (x, gate), seed=d + 2)


def test_row_invariance_long_rows() -> None:
    """Rows longer than torch's 32768-element grain: a stock reduction would split such a row
    across threads when there are few rows (torch.sum does on this CPU), a tree never does."""
    d = 40_000
    x = _x(20, d, seed=1)
    w = torch.randn(d) * 0.5 + 1
    sizes = [1, 2, 3, 16, 17]
    assert_rows_invariant(lambda x: rms_norm(x, w, 1e-6), (x,), sizes=sizes)
    assert_rows_invariant(lambda x: layer_norm(x, w, None, 1e-6), (x,), sizes=sizes)


def test_heads_folded_into_leading_dims() -> None:
    """[T, H, dk] gated norm: token t's heads give the same bits alone or in a batch."""
    x = torch.randn(40, 4, 64)
    gate = torch.randn(40, 4, 64)
    w = torch.randn(64)
    assert_rows_invariant(lambda x, gt: rms_norm_gated(x, gt, w, 1e-5), (x, gate), sizes=[1, 15, 16, 17, 33])
    full = rms_norm_gated(x, gate, w, 1e-5)
    assert torch.equal(rms_norm_gated(x.reshape(-1, 64), gate.reshape(-1, 64), w, 1e-5).view(40, 4, 64), full)


# ----------------------------------------------------------------------------- autograd


def test_gradients_match_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, w, b, 1e-6), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, gt, w: rms_norm_gated(x, gt, w, 1e-5), (x, gate, w))
    # fp32 op's gradient vs autograd through the float64 reference
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    gy = torch.randn(3, 7, generator=g, dtype=torch.float64)
    (rms_norm(x32, w32, 1e-6).double() * gy).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (rms_norm_ref(xr, wr, 1e-6) * gy).sum().backward()
    torch.testing.assert_close(x32.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w32.grad.double(), wr.grad, rtol=1e-4, atol=1e-5)
