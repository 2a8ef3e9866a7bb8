"""Triton rms_norm / layer_norm / rms_norm_gated: float64 reference, row invariance, gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.norms import (
    add_rms_norm, layer_norm, layer_norm_ref, rms_norm, rms_norm_gated, rms_norm_gated_ref, rms_norm_ref,
)
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes, randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

# fp32 accumulation over D <= 8192 elements: the sum of squares carries <= ~D/BLOCK + log2(BLOCK) roundings
# (~1e-6 relative), rsqrt ~2 ulp, two products: output relative error ~2e-6; 2e-5 relative + 2e-5 absolute
# (for outputs near 0 after the LayerNorm shift) leaves margin. A wrong eps, mean, weight or bias is >= 1e-3.
RTOL, ATOL = 2e-5, 2e-5
EPS = 1e-6


def _widths(interpret: bool) -> list[int]:
    # odd widths, a multi-block width (> 4096: the column loop), and on CUDA the bench hidden size
    return [1, 7, 33, 130, 4100] if interpret else [1, 7, 33, 130, 2048, 4100, 7168]


def _rows(interpret: bool) -> int:
    return 3 if interpret else 37


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_norms_match_float64(device, interpret, in_dtype) -> None:
    for d in _widths(interpret):
        n = _rows(interpret)
        x = randn(n, d, device=device, seed=d, scale=3.0, dtype=in_dtype) + 0.5
        w = randn(d, device=device, seed=d + 1)
        b = randn(d, device=device, seed=d + 2)
        gate = randn(n, d, device=device, seed=d + 3, scale=2.0, dtype=in_dtype)
        # fp32 output of bf16 input: the error is the kernel's, not the output rounding
        got = triton_impl(rms_norm)(x, w, EPS, torch.float32)
        torch.testing.assert_close(got.double(), rms_norm_ref(x, w, EPS), rtol=RTOL, atol=ATOL)
        got = triton_impl(rms_norm)(x, None, EPS, torch.float32)
        torch.testing.assert_close(got.double(), rms_norm_ref(x, None, EPS), rtol=RTOL, atol=ATOL)
        got = triton_impl(layer_norm)(x, w, b, EPS, torch.float32)
        torch.testing.assert_close(got.double(), layer_norm_ref(x, w, b, EPS), rtol=RTOL, atol=ATOL)
        got = triton_impl(layer_norm)(x, None, None, EPS, torch.float32)
        torch.testing.assert_close(got.double(), layer_norm_ref(x, None, None, EPS), rtol=RTOL, atol=ATOL)
        got = triton_impl(rms_norm_gated)(x, gate, w, EPS, torch.float32)
        torch.testing.assert_close(got.double(), rms_norm_gated_ref(x, gate, w, EPS), rtol=RTOL, atol=ATOL)


def test_dtypes_shapes_and_dispatch(device, interpret) -> None:
    x = randn(2, 3, 40, device=device, seed=0, dtype=torch.bfloat16)
    w = randn(40, device=device, seed=1)
    y = triton_impl(rms_norm)(x, w, EPS)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # the bf16 output is the fp32 output rounded once (RNE on the GPU; the interpreter truncates)
    if not interpret:
        assert torch.equal(y, triton_impl(rms_norm)(x, w, EPS, torch.float32).to(torch.bfloat16))
    assert triton_impl(layer_norm)(x, w, None, EPS, torch.float32).dtype == torch.float32
    # non-contiguous input: same values as contiguous
    xt = randn(40, 6, device=device, seed=2).t()
    assert torch.equal(triton_impl(rms_norm)(xt, w, EPS), triton_impl(rms_norm)(xt.contiguous(), w, EPS))
    assert triton_impl(rms_norm)(x[:0], w, EPS).shape == (0, 3, 40)
    if device.type == "cuda":  # the op dispatches to Triton on CUDA
        assert torch.equal(rms_norm(x, w, EPS), y)


def test_rows_invariant(device, interpret) -> None:
    sizes = batch_sizes(interpret)
    for d in ([33, 4100] if interpret else [33, 2048, 4100]):
        n = 6 if interpret else 64
        x = randn(n, d, device=device, seed=d, dtype=torch.bfloat16)
        gate = randn(n, d, device=device, seed=d + 1, dtype=torch.bfloat16)
        w = randn(d, device=device, seed=d + 2)
        b = randn(d, device=device, seed=d + 3)
        assert_rows_invariant(lambda a: triton_impl(rms_norm)(a, w, EPS), [x], sizes)
        assert_rows_invariant(lambda a: triton_impl(layer_norm)(a, w, b, EPS, torch.float32), [x], sizes)
        assert_rows_invariant(lambda a, g: triton_impl(rms_norm_gated)(a, g, w, EPS), [x, gate], sizes)


def test_rms_norms_read_rows_in_place(device, interpret) -> None:
    """A column slice of a fused projection's output (MLA's q_a / c_kv) and per-head views: the bits of the
    contiguous copies."""
    t, d = 5, 48
    fused = randn(t, 3 * d + 5, device=device, seed=21, dtype=torch.bfloat16)
    w = randn(d, device=device, seed=22, dtype=torch.bfloat16)
    x = fused[:, 5: 5 + d]
    assert torch.equal(triton_impl(rms_norm)(x, w, EPS), triton_impl(rms_norm)(x.contiguous(), w, EPS))
    x3, g3 = fused[:, : 2 * 16].view(t, 2, 16), fused[:, 2 * 16: 4 * 16].view(t, 2, 16)
    wg = randn(16, device=device, seed=23)
    got = triton_impl(rms_norm_gated)(x3, g3, wg, EPS, torch.float32)
    assert torch.equal(got, triton_impl(rms_norm_gated)(x3.contiguous(), g3.contiguous(), wg, EPS, torch.float32))
    assert torch.equal(triton_impl(rms_norm_gated)(x3, g3.contiguous(), wg, EPS, torch.float32), got)


def test_add_rms_norm_is_the_add_and_the_norm(device, interpret) -> None:
    """One launch, the bits of ``x + residual`` and ``rms_norm`` of it (the kernel's norm instructions are
    rms_norm's). Under the interpreter, whose fp32 -> bf16 conversion truncates where the GPU rounds to nearest
    even, h may differ from torch's add by one ulp; the norm is then checked on the kernel's own h."""
    for d in (96, 2048):
        x = randn(7, d, device=device, seed=d, dtype=torch.bfloat16)
        r = randn(7, d, device=device, seed=d + 1, scale=3.0, dtype=torch.bfloat16)
        w = randn(d, device=device, seed=d + 2, dtype=torch.bfloat16)
        h, y = triton_impl(add_rms_norm)(x, r, w, EPS)
        assert h.dtype == y.dtype == torch.bfloat16 and h.shape == y.shape == x.shape
        if interpret:
            torch.testing.assert_close(h.float(), (x + r).float(), rtol=2.0**-7, atol=0.0)
        else:
            assert torch.equal(h, x + r)
        assert torch.equal(y, triton_impl(rms_norm)(h, w, EPS))
        assert_rows_invariant(lambda a, b: triton_impl(add_rms_norm)(a, b, w, EPS), [x, r], batch_sizes(interpret))
    x32 = randn(3, 16, device=device, seed=5)  # fp32: the two ops
    h, y = triton_impl(add_rms_norm)(x32, x32, None, EPS)
    assert torch.equal(h, x32 + x32) and torch.equal(y, triton_impl(rms_norm)(x32 + x32, None, EPS))
    with pytest.raises(ValueError, match="add_rms_norm"):
        triton_impl(add_rms_norm)(x, r[:, :-1], w, EPS)


def test_gradients(device, interpret) -> None:
    d, n = (33, 4) if interpret else (2048, 16)
    x = randn(n, d, device=device, seed=0, scale=2.0).requires_grad_(True)
    gate = randn(n, d, device=device, seed=1).requires_grad_(True)
    w = randn(d, device=device, seed=2).requires_grad_(True)
    b = randn(d, device=device, seed=3).requires_grad_(True)
    gy = randn(n, d, device=device, seed=4)
    cases = [
        (lambda: triton_impl(rms_norm)(x, w, EPS), lambda xd, gd, wd, bd: rms_norm_ref(xd, wd, EPS), (x, w)),
        (lambda: triton_impl(layer_norm)(x, w, b, EPS),
         lambda xd, gd, wd, bd: layer_norm_ref(xd, wd, bd, EPS), (x, w, b)),
        (lambda: triton_impl(rms_norm_gated)(x, gate, w, EPS),
         lambda xd, gd, wd, bd: rms_norm_gated_ref(xd, gd, wd, EPS), (x, gate, w)),
    ]
    for fwd, ref, params in cases:
        got = torch.autograd.grad(fwd(), params, gy)
        leaves = [t.detach().double().requires_grad_(True) for t in (x, gate, w, b)]
        out = ref(*leaves)
        want = torch.autograd.grad(out, [leaves[[id(p) for p in (x, gate, w, b)].index(id(q))] for q in params],
                                   gy.double())
        for g_got, g_want in zip(got, want):
            # fp32 backward of a sum over d rows/cols: ~1e-6 relative; 1e-4 on the scale of the gradient
            torch.testing.assert_close(g_got.double(), g_want, rtol=1e-4, atol=1e-4 * float(g_want.abs().max()))
