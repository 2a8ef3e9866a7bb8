"""Triton GEMMs (linear, linear_concat, linear_blockdiag, grouped_linear, bmm_fixed, expert_linear): float64 accuracy, bitwise row
invariance over M / batch composition / expert token counts, gradients.

Runs on CUDA, or on CPU under TRITON_INTERPRET=1 with small shapes (the interpreter casts tiles to
fp32 before the dot, so bf16 inputs are exercised there too, through the fp32 dot path).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.matmul import (LoraUp, LoraUpConcat, bmm_fixed, grouped_linear, linear, linear_blockdiag,
                                                 linear_concat, lora_concat_delta, lora_delta)
from zmrl.kernels_batch_invariant.moe_gemm import RowGather, expert_linear, expert_linear_ref, expert_lora_delta
from zmrl.kernels_batch_invariant.triton import triton_impl
from zmrl.kernels_batch_invariant.triton import _common
from zmrl.kernels_batch_invariant.triton.matmul import grouped_tile
from tests.kernels.triton.gemm_launches import count_gemm_launches

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

U32 = 2.0**-24

# M values the GPU invariance sweep covers (the brief's list): around every tile boundary.
GPU_MS = [1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 1023, 1024, 4096]
CPU_MS = [1, 2, 3, 7, 16, 17, 63, 65, 129]

# Bench preset projection shapes (N, K) (see benchmarks/gemm_invariant_vs_cublas.py).
BENCH_NK = [(2048, 2048), (768, 2048), (12288, 768), (576, 2048), (2048, 8192), (4096, 768), (256, 2048),
            (2048, 256), (16384, 512), (128, 2048), (16, 2048), (64, 2048)]


@pytest.fixture(autouse=True)
def _ieee_backward_matmuls():
    """The gradient bounds here are for IEEE fp32 GEMMs. On CUDA the trainer's default runs the
    backward's fp32 GEMMs at TF32 (2^-11 per product; numerics.backward_matmul_precision), whose
    bound tests/kernels/triton/test_moe_gemm_grads_gpu.py states; this file checks the math."""
    with numerics_scope(current_numerics().replace(backward_matmul_precision="ieee")):
        yield


def _lin(*args, **kw):
    return triton_impl(linear)(*args, **kw)


def _bound(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Error bound for y = x @ w^T with fp32 accumulation then one rounding to out.dtype.

    gamma_K * (|x| @ |w|^T) is the worst case of fp32 accumulation in any order. fp16 against fp32
    runs IEEE FMA dots (factor 2 of slack). 16-bit operands run tensor-core MMAs whose fp32 accumulation
    need not round to nearest: factor 8 (a few bits), still ~1e-4 relative of sum|x||w| at K=1000,
    while a wrong row/column/tile gives errors of the size of |y|. fp32 x against bf16 w runs three
    bf16 MMAs on a 3-way split of x (3K accumulations of exact products): factor 8 as well, and so does
    bf16 x against fp32 w (the split of w) and fp32 x fp32 (both split, six products: what is dropped
    is below 2^-24 of |x||w|, inside the same factor). The final
    rounding adds half an ulp of the output dtype (2^-24 fp32, 2^-8 bf16) of |y|.
    """
    k = x.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    split = torch.float32 in (x.dtype, w.dtype) and {x.dtype, w.dtype} <= {torch.float32, torch.bfloat16}
    slack = 2.0 if (x.dtype == torch.float32 or w.dtype == torch.float32) and not split else 8.0
    s = x.double().abs() @ w.double().abs().t()
    ulp = 2.0**-8 if out.dtype == torch.bfloat16 else U32
    return slack * gamma * s + ulp * ref.abs() + 1e-30


def _assert_delta_start(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                        delta: torch.Tensor, k_split: bool) -> None:
    """A Triton product with a delta: a split-K product adds it after its fp32 partial sums, bitwise
    ``(fp32 result + delta).to(out)``; any other starts its accumulator from it (the K products accumulate onto
    the delta): within ``_bound`` of float64, whose gamma_K term grows by |delta| (each accumulation step may
    round at the delta's magnitude), and a zero delta gives the product without one bit for bit."""
    if k_split:
        assert torch.equal(got, (_lin(x, w, bias, out_dtype=torch.float32) + delta).to(got.dtype))
        return
    ref = x.double() @ w.double().t() + delta.double() + (0 if bias is None else bias.double())
    k = x.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    bound = _bound(x, w, got, ref) + 8.0 * gamma * delta.double().abs()
    assert ((got.double() - ref).abs() <= bound).all(), float(((got.double() - ref).abs() - bound).max())
    zero = torch.zeros_like(delta)
    assert torch.equal(_lin(x, w, bias, out_dtype=got.dtype, delta=zero), _lin(x, w, bias, out_dtype=got.dtype))


def _dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16]


# ------------------------------------------------------------------------------------- linear
LINEAR_SHAPES = [(1, 7, 33), (5, 33, 7), (17, 64, 80), (3, 576, 40), (9, 1000, 33), (70, 20, 130), (2, 1, 1)]


@pytest.mark.parametrize("dtype", _dtypes())
def test_linear_matches_float64(device, interpret, dtype):
    shapes = list(LINEAR_SHAPES)
    if not interpret:
        shapes += [(m, k, n) for (n, k) in BENCH_NK for m in (1, 200)] + [(4096, 2048, 2048), (300, 2048, 163840)]
    g = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=g).to(device, dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
        b = torch.randn(n, generator=g).to(device, dtype)
        for bias in (None, b):
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            y = _lin(x, w, bias)
            assert y.shape == (m, n) and y.dtype == dtype
            err = (y.double() - ref).abs()
            bound = _bound(x, w, y, ref) + (0 if bias is None else 2 * U32 * ref.abs())
            assert (err <= bound).all(), f"{(m, k, n, dtype)}: max err {err.max():.3g}"
        y32 = _lin(x, w, out_dtype=torch.float32)
        assert y32.dtype == torch.float32
        assert torch.equal(y32.to(dtype), _lin(x, w)), "fp32 accumulator rounded once, at the end"


# ------------------------------------------------------------------------------ linear_concat
@pytest.mark.parametrize("dtype", _dtypes())
def test_linear_concat_is_the_concatenation_of_linears(device, interpret, dtype):
    """One launch over separate weights (different N, one K; separate allocations at arbitrary
    relative addresses) gives every column the bits Triton ``linear`` gives it, for every M, with
    the rows invariant to the batch; fp32 output rounded once equals the 16-bit output."""
    g = torch.Generator().manual_seed(7)
    cat = triton_impl(linear_concat)
    cases = [(33, (7, 40, 1, 16)), (64, (64, 3, 130))]
    if not interpret:
        cases += [(2048, (2048, 2048, 2048, 128, 16, 128)), (2048, (768, 576, 128, 32))]
    for k, ns in cases:
        ws = [(torch.randn(n, k, generator=g) / k**0.5).to(device, dtype) for n in ns]
        pool = torch.randn(16, k, generator=g).to(device, dtype)
        for m in ([1, 5, 16, 17] if interpret else [1, 7, 64, 65, 256, 257, 1000]):
            x = pool[torch.arange(m) % 16]
            y = cat(x, ws)
            assert y.shape == (m, sum(ns)) and y.dtype == dtype
            assert torch.equal(y, torch.cat([_lin(x, w) for w in ws], dim=-1)), (k, ns, m)
            y32 = cat(x, ws, out_dtype=torch.float32)
            assert torch.equal(y32, torch.cat([_lin(x, w, out_dtype=torch.float32) for w in ws], dim=-1))
            assert torch.equal(y32.to(dtype), y)
        _assert_rows_invariant(lambda r: cat(r, ws), pool, [1, 2, 17] if interpret else GPU_MS, seed=k)


@pytest.mark.parametrize("m", [9, 48])  # dX by an addmm chain per weight (M < sum N) / one GEMM over all weights
@pytest.mark.parametrize("frozen", [None, 1])  # every weight gets a gradient (one GEMM) / weight 1 is frozen
def test_linear_concat_lora_factors_and_gradients(device, interpret, m, frozen):
    """fp32 weights (LoRA A factors) against bf16/fp32 x; gradients equal those of separate linears
    (up to the backward's own rounding: both are fp32 GEMMs of the same operands, compared with a
    bound), and repeated backward passes are bitwise equal."""
    g = torch.Generator().manual_seed(8)
    cat = triton_impl(linear_concat)
    k = 48
    ws = [torch.randn(n, k, generator=g).to(device).requires_grad_(i != frozen) for i, n in enumerate((8, 8, 24))]
    x = torch.randn(m, k, generator=g).to(device).requires_grad_()
    gy = torch.randn(m, 40, generator=g).to(device)
    wanted = [x, *(w for w in ws if w.requires_grad)]
    y = cat(x, ws, out_dtype=torch.float32)
    assert torch.equal(y, torch.cat([_lin(x, w, out_dtype=torch.float32) for w in ws], dim=-1))
    grads = torch.autograd.grad(y, wanted, gy)
    again = torch.autograd.grad(cat(x, ws, out_dtype=torch.float32), wanted, gy)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the backward is deterministic"
    wd = [w.detach().double().requires_grad_(w.requires_grad) for w in ws]
    xd = x.detach().double().requires_grad_()
    ref = torch.autograd.grad(torch.cat([xd @ w.t() for w in wd], dim=-1), [xd, *(w for w in wd if w.requires_grad)],
                              gy.double())
    for got, want in zip(grads, ref):
        assert got.shape == want.shape
        # fp32 GEMMs of K <= 48 terms: a few ulps of sum |terms|; 1e-5 of the largest value is ample
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6


def test_linear_concat_errors_and_fallbacks(device):
    cat = triton_impl(linear_concat)
    x = torch.randn(3, 16, device=device)
    with pytest.raises(ValueError, match="no weights"):
        cat(x, [])
    with pytest.raises(ValueError, match="features"):
        cat(x, [torch.randn(4, 16, device=device), torch.randn(4, 8, device=device)])
    # mixed dtypes cannot share one segment table: separate launches, same bits
    ws = [torch.randn(4, 16, device=device), torch.randn(5, 16, device=device).to(torch.bfloat16)]
    assert torch.equal(cat(x, ws, out_dtype=torch.float32),
                       torch.cat([_lin(x, w, out_dtype=torch.float32) for w in ws], dim=-1))
    # the torch backend is the reference composition
    w2 = [torch.randn(4, 16), torch.randn(6, 16)]
    xc = torch.randn(3, 16)
    assert torch.equal(linear_concat.impls["torch"](xc, w2), torch.cat([linear.impls["torch"](xc, w) for w in w2], -1))


def test_linear_concat_delta_is_each_blocks_linear(device, interpret, monkeypatch):
    """``linear_concat(..., delta=)`` (the LoRA deltas of project(), in the one launch) gives column block s the bits
    of ``linear(x, w_s, delta=delta_s)`` and the delta's value (``_assert_delta_start``), for 16-bit and fp32
    operands and outputs, with a split K (fp32 weights, K > SPLIT_K_CHUNK: the delta is added in the partial
    sum's pass) and through the fallbacks (one weight, mixed dtypes); the delta's gradient is the output's, in
    fp32."""
    from zmrl.kernels_batch_invariant.triton.matmul import SPLIT_K_CHUNK
    g = torch.Generator().manual_seed(21)
    cat = triton_impl(linear_concat)
    cases = [(torch.bfloat16, torch.bfloat16, 40), (torch.float32, torch.float32, 40), (torch.bfloat16, torch.float32, 40),
             (torch.bfloat16, torch.float32, SPLIT_K_CHUNK + 20)]
    for x_dtype, w_dtype, k in cases:
        ws = [(torch.randn(n, k, generator=g) / k**0.5).to(device, w_dtype) for n in (7, 16, 33)]
        x = torch.randn(5, k, generator=g).to(device, x_dtype)
        delta = torch.randn(5, 56, generator=g).to(device)
        for out_dtype in (torch.bfloat16, torch.float32):
            launches = count_gemm_launches(monkeypatch)
            fused = cat(x, ws, out_dtype=out_dtype, delta=delta)
            assert len(launches) == 1, "one launch for all weights, the delta in it"
            monkeypatch.undo()
            blocks = [_lin(x, w, out_dtype=out_dtype, delta=d) for w, d in zip(ws, delta.split([7, 16, 33], -1))]
            assert torch.equal(fused, torch.cat(blocks, -1)), (x_dtype, w_dtype, k)
            for w, d, block in zip(ws, delta.split([7, 16, 33], -1), blocks):
                _assert_delta_start(block, x, w, None, d, k > SPLIT_K_CHUNK and w_dtype == torch.float32)
    # fallbacks: one weight; weights of two dtypes (separate launches)
    x = torch.randn(5, 40, generator=g).to(device, torch.bfloat16)
    w1, w2 = torch.randn(8, 40, generator=g).to(device, torch.bfloat16), torch.randn(4, 40, generator=g).to(device)
    d = torch.randn(5, 12, generator=g).to(device)
    assert torch.equal(cat(x, [w1], delta=d[:, :8]), _lin(x, w1, delta=d[:, :8]))
    assert torch.equal(cat(x, [w1, w2], delta=d), torch.cat([_lin(x, w1, delta=d[:, :8]), _lin(x, w2, delta=d[:, 8:])], -1))
    with pytest.raises(ValueError, match="delta must be an fp32 tensor"):
        cat(x, [w1, w2], delta=d[:, :8])
    # gradients: fused vs unfused, bitwise (the same backward GEMMs; the delta's gradient is gy in fp32)
    ws = [(torch.randn(n, 40, generator=g) / 40**0.5).to(device).requires_grad_() for n in (8, 4)]
    xs = x.float().requires_grad_()
    dg = d.clone().requires_grad_()
    gy = torch.randn(5, 12, generator=g).to(device, torch.bfloat16)
    fused = torch.autograd.grad(cat(xs, ws, out_dtype=torch.bfloat16, delta=dg), [xs, *ws, dg], gy)
    plain = torch.autograd.grad((cat(xs, ws, out_dtype=torch.float32) + dg).to(torch.bfloat16), [xs, *ws, dg], gy)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


def _blockdiag_case(g, device, x_dtype, w_dtype, ks, ns, m):
    """Weights [N_s, K_s] as views of one wider allocation each (equal strides: one launch) and x
    [m, sum K_s]."""
    kmax = max(ks)
    ws = [(torch.randn(n, kmax, generator=g) / kmax**0.5).to(device, w_dtype)[:, :k] for n, k in zip(ns, ks)]
    x = torch.randn(m, sum(ks), generator=g).to(device, x_dtype)
    return x, ws


# (x dtype, w dtype): fp32 x fp32 is the LoRA case (the fp32 A products through the fp32 B factors)
_BLOCKDIAG_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                     (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtypes", _BLOCKDIAG_DTYPES, ids=lambda d: f"{str(d[0])[6:]}x{str(d[1])[6:]}")
def test_linear_blockdiag_blocks_are_linears(device, interpret, dtypes, monkeypatch):
    """One launch; column block s is bitwise Triton ``linear(x[..., block s], w_s)`` (blocks of equal
    and of different K, N not a multiple of the tile), in the input's dtype and in fp32; the rows do not
    depend on the batch; the torch backend is the reference composition."""
    x_dtype, w_dtype = dtypes
    g = torch.Generator().manual_seed(22)
    bd = triton_impl(linear_blockdiag)
    cases = [((8, 8, 8), (7, 16, 40)), ((32, 5, 17), (3, 33, 8))]
    if not interpret:
        cases += [((32,) * 6, (2048, 2048, 2048, 128, 16, 128)), ((32, 32), (768, 576))]
    for ks, ns in cases:
        x, ws = _blockdiag_case(g, device, x_dtype, w_dtype, ks, ns, 9)
        for out_dtype in (None, torch.float32):
            launches = count_gemm_launches(monkeypatch)
            y = bd(x, ws, out_dtype)
            assert len(launches) == 1
            monkeypatch.undo()
            assert y.shape == (9, sum(ns)) and y.dtype == (out_dtype or x_dtype)
            want = torch.cat([_lin(xs, w, out_dtype=out_dtype) for xs, w in zip(x.split(ks, -1), ws)], -1)
            assert torch.equal(y, want), (ks, ns, out_dtype)
            ref = torch.cat([xs.double() @ w.double().t() for xs, w in zip(x.split(ks, -1), ws)], -1)
            c0 = 0
            for xs, w, n in zip(x.split(ks, -1), ws, ns):
                ys = y[:, c0:c0 + n]
                assert ((ys.double() - ref[:, c0:c0 + n]).abs() <= _bound(xs, w, ys, ref[:, c0:c0 + n])).all()
                c0 += n
        _assert_rows_invariant(lambda r: bd(r, ws, torch.float32), x, [1, 2, 17] if interpret else GPU_MS, seed=sum(ks))
    xc, wc = _blockdiag_case(g, torch.device("cpu"), x_dtype, w_dtype, (8, 5), (7, 3), 4)
    assert torch.equal(linear_blockdiag.impls["torch"](xc, wc),
                       torch.cat([linear.impls["torch"](xs, w) for xs, w in zip(xc.split([8, 5], -1), wc)], -1))


def test_linear_blockdiag_fallbacks_and_errors(device, interpret):
    """Weights the one launch cannot take (mixed dtypes, unequal strides, fp32 weights whose K would be
    split) run one linear per block: the same bits. Bad shapes fail with a one-line error."""
    from zmrl.kernels_batch_invariant.triton.matmul import SPLIT_K_CHUNK
    g = torch.Generator().manual_seed(23)
    bd = triton_impl(linear_blockdiag)
    x = torch.randn(3, 24, generator=g).to(device)
    ws = [torch.randn(4, 8, generator=g).to(device), torch.randn(5, 16, generator=g).to(device, torch.bfloat16)]
    want = torch.cat([_lin(x[:, :8], ws[0]), _lin(x[:, 8:], ws[1])], -1)
    assert torch.equal(bd(x, ws), want)
    ws = [torch.randn(4, 8, generator=g).to(device), torch.randn(5, 16, generator=g).to(device)]  # strides differ
    assert torch.equal(bd(x, ws), torch.cat([_lin(x[:, :8], ws[0]), _lin(x[:, 8:], ws[1])], -1))
    k = SPLIT_K_CHUNK + 4
    xb = torch.randn(2, k + 8, generator=g).to(device, torch.bfloat16)
    ws = [torch.randn(3, k, generator=g).to(device) / k**0.5, torch.randn(6, k, generator=g).to(device)[:, :8]]
    assert torch.equal(bd(xb, ws, torch.float32),
                       torch.cat([_lin(xb[:, :k], ws[0], out_dtype=torch.float32),
                                  _lin(xb[:, k:], ws[1], out_dtype=torch.float32)], -1))
    for op in (bd, linear_blockdiag.impls["torch"]):
        with pytest.raises(ValueError, match="no weights"):
            op(x.cpu() if op is not bd else x, [])
        with pytest.raises(ValueError, match="their K must sum"):
            op(x.cpu() if op is not bd else x, [torch.randn(4, 8, device=x.device if op is bd else "cpu")])


@pytest.mark.parametrize("frozen", [None, 1])
def test_linear_blockdiag_gradients(device, interpret, frozen):
    """Gradients (x and every trainable weight, LoRA-shaped fp32 x fp32) equal those of the unfused
    composition — cat of Triton linears on the blocks — up to the backward's own rounding (both run
    fp32 GEMMs of the same operands, so they agree to a few ulps of the largest value: 1e-5 relative),
    are close to float64 within the fp32 GEMM bound for K <= 40 terms (1e-5 relative), and repeated
    backward passes are bitwise equal."""
    g = torch.Generator().manual_seed(24)
    bd = triton_impl(linear_blockdiag)
    ks, ns = (8, 8, 5), (7, 16, 40)
    x, ws = _blockdiag_case(g, device, torch.float32, torch.float32, ks, ns, 6)
    x = x.requires_grad_()
    ws = [w.detach().clone().requires_grad_(i != frozen) for i, w in enumerate(ws)]
    wanted = [x, *(w for w in ws if w.requires_grad)]
    gy = torch.randn(6, sum(ns), generator=g).to(device)
    grads = torch.autograd.grad(bd(x, ws, torch.float32), wanted, gy)
    again = torch.autograd.grad(bd(x, ws, torch.float32), wanted, gy)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the backward is deterministic"
    unfused = torch.autograd.grad(
        torch.cat([_lin(xs, w, out_dtype=torch.float32) for xs, w in zip(x.split(ks, -1), ws)], -1), wanted, gy)
    xd = x.detach().double().requires_grad_()
    wd = [w.detach().double().requires_grad_(w.requires_grad) for w in ws]
    ref = torch.autograd.grad(torch.cat([xs @ w.t() for xs, w in zip(xd.split(ks, -1), wd)], -1),
                              [xd, *(w for w in wd if w.requires_grad)], gy.double())
    for got, plain, want in zip(grads, unfused, ref):
        assert got.shape == want.shape
        scale = want.abs().max()
        assert (got.double() - plain.double()).abs().max() <= 1e-5 * scale + 1e-6
        assert (got.double() - want).abs().max() <= 1e-5 * scale + 1e-6

def test_linear_mixed_dtypes_compute_in_fp32(device, interpret):
    """bf16 activations x fp32 weights (LoRA factors, router) and fp32 activations x bf16 weights
    (MLA's attention output through W_UV) are fp32-accurate, like the torch backend, and both (a 3-way
    bf16 split of the fp32 operand on the GPU) are row-invariant."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 96, generator=g).to(device, torch.bfloat16)
    w = torch.randn(32, 96, generator=g).to(device)
    y = _lin(x, w, out_dtype=torch.float32)
    ref = x.double() @ w.double().t()
    assert ((y.double() - ref).abs() <= _bound(x, w, y, ref)).all()
    # LoRA A shapes (r = 32, and six adapters of one input fused) over a wide range of weight magnitudes
    lora = [(9, 70, 32), (70, 40, 96)] if interpret else [(64, 2048, 32), (300, 2048, 192), (1000, 8192, 32)]
    for m, k, n in lora:
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        w = torch.randn(n, k, generator=g).to(device) * torch.logspace(-3, 3, k).to(device)
        y = _lin(x, w, out_dtype=torch.float32)
        ref = x.double() @ w.double().t()
        err = (y.double() - ref).abs()
        assert (err <= _bound(x, w, y, ref)).all(), f"bf16 x fp32 w {(m, k, n)}: max err {err.max():.3g}"
        sizes = [1, 2, 7, 16, 17, 65] if interpret else GPU_MS
        _assert_rows_invariant(lambda r: _lin(r, w, out_dtype=torch.float32), x[:16], sizes, seed=n)
    shapes = [(7, 33, 40), (70, 64, 20)] if interpret else [(7, 33, 40), (1000, 512, 128), (300, 2048, 16384)]
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=g).to(device) * torch.logspace(-3, 3, k).to(device)  # wide range
        w = torch.randn(n, k, generator=g).to(device, torch.bfloat16)
        for out_dtype in (torch.float32, torch.bfloat16):
            y = _lin(x, w, out_dtype=out_dtype)
            ref = x.double() @ w.double().t()
            err = (y.double() - ref).abs()
            assert (err <= _bound(x, w, y, ref)).all(), f"{(m, k, n, out_dtype)}: max err {err.max():.3g}"
        pool = x[:16]
        sizes = [1, 2, 7, 16, 17, 65] if interpret else GPU_MS
        _assert_rows_invariant(lambda r: _lin(r, w, out_dtype=torch.float32), pool, sizes, seed=m)


def test_linear_leading_dims_empty_and_errors(device):
    x = torch.randn(2, 3, 5, 17, device=device)
    w = torch.randn(9, 17, device=device)
    y = _lin(x, w)
    assert y.shape == (2, 3, 5, 9)
    assert torch.equal(y.reshape(-1, 9), _lin(x.reshape(-1, 17), w))
    assert _lin(torch.randn(0, 17, device=device), w).shape == (0, 9)
    with pytest.raises(ValueError):
        _lin(torch.randn(3, 16, device=device), w)
    # fp64 (gradchecks) falls back to the torch backend
    xd, wd = x.double(), w.double()
    assert torch.equal(_lin(xd, wd), linear.impls["torch"](xd, wd))


def _assert_rows_invariant(fn, pool: torch.Tensor, sizes: list[int], seed: int, unaligned: bool = True) -> None:
    """fn(rows)[j] == fn(row alone) bitwise, for batches of every size in ``sizes`` drawn (with
    replacement, random order) from ``pool``, some from storage at an unaligned offset."""
    g = torch.Generator().manual_seed(seed)
    p, k = pool.shape
    alone = torch.stack([fn(pool[i:i + 1])[0] for i in range(p)])
    for b in sizes:
        idx = torch.randint(0, p, (b,), generator=g)
        x = pool[idx.to(pool.device)]
        if unaligned and b % 2:
            # same values at a random element offset: the kernel sees another pointer alignment
            off = int(torch.randint(1, 8, (1,), generator=g))
            flat = torch.empty(b * k + off, dtype=pool.dtype, device=pool.device)
            x = flat[off:].view(b, k)
            x.copy_(pool[idx.to(pool.device)])
        out = fn(x)
        want = alone[idx.to(alone.device)]
        if not torch.equal(out, want):
            bad = (out != want).flatten(1).any(1).nonzero()[0].item()
            pytest.fail(f"batch of {b}: row {bad} differs from the same row computed alone")


def test_column_block_rows_are_read_in_place(device, interpret):
    """A column block of wider rows (project()'s outputs feeding the next projection) reaches the GEMM without a
    copy when its row stride and K are multiples of 16 and it starts 16-byte aligned (the kernel then sees what
    contiguous rows would give it), and is copied otherwise; either way every row has the bits of the
    contiguous rows' product, whatever the batch."""
    from zmrl.kernels_batch_invariant.triton.matmul import _rows
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(40, 96, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(24, 32, generator=g) / 32**0.5).to(device, torch.bfloat16)
    block = wide[:, 32:64]  # row stride 96, K 32, 64-byte offset
    assert _rows(block, 32).data_ptr() == block.data_ptr(), "read in place"
    assert _rows(wide[:, 4:36], 32).data_ptr() != wide[:, 4:36].data_ptr(), "8-byte offset: copied"
    assert _rows(wide[:, :24], 24).is_contiguous(), "K not a multiple of 16: copied"
    one = _rows(wide[3:4, 32:64], 32)
    assert one.stride() == (32, 1) and one.data_ptr() == wide[3:4, 32:64].data_ptr(), "one row: contiguous strides"
    alone = torch.stack([_lin(block[i:i + 1].contiguous(), w)[0] for i in range(40)])
    assert torch.equal(_lin(block, w), alone)
    _assert_rows_invariant(lambda r: _lin(torch.cat([r, r, r], dim=-1)[:, 32:64], w), block.contiguous(),
                           [1, 2, 17] if interpret else GPU_MS, seed=4, unaligned=False)


@pytest.mark.parametrize("dtype", _dtypes())
def test_linear_row_invariance(device, interpret, dtype):
    # interpreter: few, small calls (each tile costs milliseconds there)
    sizes = CPU_MS if interpret else GPU_MS
    shapes = [(33, 7), (20, 40)] if interpret else [(33, 7), (1000, 33)] + [(k, n) for n, k in BENCH_NK[:6]]
    g = torch.Generator().manual_seed(2)
    for k, n in shapes:
        pool = torch.randn(16 if interpret else 48, k, generator=g).to(device, dtype)
        w = torch.randn(n, k, generator=g).to(device, dtype)
        b = torch.randn(n, generator=g).to(device, dtype)
        _assert_rows_invariant(lambda x: _lin(x, w, b), pool, sizes, seed=k + n)
        _assert_rows_invariant(lambda x: _lin(x, w, out_dtype=torch.float32), pool, sizes[:8], seed=n)


def test_linear_lm_head_invariance(device, interpret):
    """The widest bench GEMM (vocab 163840) at decode and prefill sizes."""
    if interpret:
        pytest.skip("GPU shape")
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(16, 2048, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(163840, 2048, generator=g) * 0.02).to(device, torch.bfloat16)
    _assert_rows_invariant(lambda x: _lin(x, w, out_dtype=torch.float32), pool, [1, 3, 8, 64, 129, 256, 1000], seed=3)


@pytest.mark.parametrize("dtype", _dtypes())
def test_linear_grads_match_float64(device, dtype):
    g = torch.Generator().manual_seed(4)
    for m, k, n in [(5, 33, 7), (17, 64, 80), (2, 100, 16)]:
        x = torch.randn(m, k, generator=g).to(device, dtype).requires_grad_(True)
        w = torch.randn(n, k, generator=g).to(device, dtype).requires_grad_(True)
        b = torch.randn(n, generator=g).to(device, dtype).requires_grad_(True)
        gy = torch.randn(m, n, generator=g).to(device)
        y = _lin(x, w, b, out_dtype=torch.float32)
        (y * gy).sum().backward()
        xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, b))
        ((xd @ wd.t() + bd) * gy.double()).sum().backward()
        # fp32: fp32 GEMMs of K <= 100 terms (~1e-5 rel). bf16: dY rounded to bf16 for the 16-bit
        # backward GEMMs and grads rounded to bf16 (2^-8 rel each): 2e-2 of the grad scale.
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
            assert got.dtype == dtype
            scale = want.abs().max().item() + 1e-12
            assert (got.double() - want).abs().max().item() <= tol * scale * 4, (m, k, n, dtype)
        # frozen weight (LoRA training): only dX, and x is not kept for a dW
        x.grad = None
        (_lin(x, w.detach(), out_dtype=torch.float32) * gy).sum().backward()
        want = gy.double() @ w.detach().double()
        assert (x.grad.double() - want).abs().max().item() <= tol * 4 * (want.abs().max().item() + 1e-12)


# ------------------------------------------------------------------------------ grouped_linear
@pytest.mark.parametrize("dtype", [*_dtypes(), "f32_x_bf16_w"])
def test_grouped_linear_rows_equal_linear(device, interpret, dtype):
    """Row r of group g == Triton linear(row, weight[g]) bitwise, for any M (also transposed and
    expanded weight views, as the MLA absorbed projections pass them), and close to float64."""
    g = torch.Generator().manual_seed(5)
    shapes = [(3, 5, 33, 7), (2, 70, 16, 20)]
    if not interpret:  # MLA absorbed shapes: 64 heads, nope 128 <-> kv_lora 512
        shapes = [(64, 1, 128, 512), (64, 200, 512, 128), (3, 1000, 33, 7)]
    # "f32_x_bf16_w": MLA's fp32 attention output through the bf16 W_UV (the split-x path)
    x_dtype, w_dtype = (torch.float32, torch.bfloat16) if dtype == "f32_x_bf16_w" else (dtype, dtype)
    for G, M, K, N in shapes:
        x = torch.randn(G, M, K, generator=g).to(device, x_dtype)
        w = torch.randn(G, N, K, generator=g).to(device, w_dtype)
        for wv in (w, w.transpose(1, 2).contiguous().transpose(1, 2), w[:1].expand(G, N, K)):
            y = triton_impl(grouped_linear)(x, wv)
            assert y.shape == (G, M, N) and y.dtype == x_dtype
            for gi in range(G):
                assert torch.equal(y[gi], _lin(x[gi], wv[gi])), (G, M, K, N, gi)
                assert torch.equal(y[gi, :1], _lin(x[gi, :1], wv[gi]))
            ref = x.double() @ wv.double().transpose(1, 2)
            err = (y.double() - ref).abs()
            bound = torch.stack([_bound(x[i], wv[i], y, ref[i]) for i in range(G)])
            assert (err <= bound).all()
    # out_dtype, empty, fp64 fallback
    x = torch.randn(2, 3, 16, device=device)
    w = torch.randn(2, 5, 16, device=device)
    assert triton_impl(grouped_linear)(x.bfloat16(), w.bfloat16(), out_dtype=torch.float32).dtype == torch.float32
    assert triton_impl(grouped_linear)(x[:, :0], w).shape == (2, 0, 5)
    xd, wd = x.double(), w.double()
    assert torch.equal(triton_impl(grouped_linear)(xd, wd), grouped_linear.impls["torch"](xd, wd))


def test_grouped_linear_delta_is_each_groups_linear(device, interpret):
    """``grouped_linear`` with a ``delta`` (the absorbed MLA LoRA terms, fp32 [G, M, N]): on the Triton backend
    group g has the bits of ``linear(x[g], w[g], delta=delta[g])`` (its accumulator starts from the delta), on
    the torch backend the unfused ``(fp32 result + delta).to(out)``'s, for the fp32 x bf16 split path (o_lat
    through W_UV) and bf16 operands, fp32 and bf16 outputs; its gradients equal the unfused ones (the delta's
    is the output's, in fp32)."""
    g = torch.Generator().manual_seed(21)
    G, M, K, N = (3, 9, 40, 24) if interpret else (64, 70, 512, 128)
    for x_dtype, w_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
        x = torch.randn(G, M, K, generator=g).to(device, x_dtype)
        w = (torch.randn(G, N, K, generator=g) / K**0.5).to(device, w_dtype)
        delta = torch.randn(G, M, N, generator=g).to(device)
        for impl, out_dtype in itertools.product(("triton", "torch"), (torch.float32, torch.bfloat16)):
            op = triton_impl(grouped_linear) if impl == "triton" else grouped_linear.impls["torch"]
            fused = op(x, w, out_dtype=out_dtype, delta=delta)
            if impl == "torch":
                plain = (op(x, w, out_dtype=torch.float32) + delta).to(out_dtype)
            else:
                plain = torch.stack([_lin(x[i], w[i], out_dtype=out_dtype, delta=delta[i]) for i in range(G)])
            assert torch.equal(fused, plain), (impl, x_dtype, out_dtype)
        with pytest.raises(ValueError, match="delta must be"):
            triton_impl(grouped_linear)(x, w, delta=delta[:, :1])
    x = torch.randn(G, M, K, generator=g).to(device).requires_grad_()
    w = torch.randn(G, N, K, generator=g).to(device, torch.bfloat16).requires_grad_()
    d = torch.randn(G, M, N, generator=g).to(device).requires_grad_()
    gy = torch.randn(G, M, N, generator=g).to(device, torch.bfloat16)
    op = triton_impl(grouped_linear)
    fused = torch.autograd.grad(op(x, w, out_dtype=torch.bfloat16, delta=d), [x, w, d], gy)
    plain = torch.autograd.grad((op(x, w, out_dtype=torch.float32) + d).to(torch.bfloat16), [x, w, d], gy)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shared_b", [True, False], ids=["shared_b", "per_group_b"])
@pytest.mark.parametrize("scale", [1.0, 0.75])
def test_grouped_linear_lora_equals_its_delta(device, interpret, shared_b, scale, monkeypatch):
    """``grouped_linear`` with ``lora`` (the absorbed MLA LoRA terms as their factors: t [G, M, r] per head, b one
    B for every head as an expanded view, or one per head) is bitwise the ``delta`` path it replaces,
    ``delta = scale * grouped_linear(t, b, fp32)``, on the Triton and torch backends, for the q_lat (bf16 x bf16
    -> fp32) and o (fp32 x bf16 -> bf16) products; a fused call writes no [G, M, N] delta. Its gradients match
    float64 (fp32 backward GEMMs over <= 40 terms: 1e-5 of the largest value)."""
    g = torch.Generator().manual_seed(23)
    G, M, K, N, R = (3, 9, 40, 24, 8) if interpret else (64, 70, 512, 128, 32)
    for x_dtype, out_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        x = torch.randn(G, M, K, generator=g).to(device, x_dtype)
        w = (torch.randn(G, N, K, generator=g) / K**0.5).to(device, torch.bfloat16)
        t = torch.randn(G, M, R, generator=g).to(device)
        # shared: MLA's A^T [N, r] for every head, a transposed view expanded (strides 0, 1, N)
        b = (torch.randn(R, N, generator=g).to(device).t().unsqueeze(0).expand(G, -1, -1) if shared_b else
             torch.randn(G, N, R, generator=g).to(device))
        lora = LoraUp(t, b, scale)
        for impl in ("triton", "torch"):
            op = triton_impl(grouped_linear) if impl == "triton" else grouped_linear.impls["torch"]
            d = op(t, b, out_dtype=torch.float32)
            delta = d if scale == 1.0 else scale * d
            assert torch.equal(op(x, w, out_dtype=out_dtype, lora=lora), op(x, w, out_dtype=out_dtype, delta=delta)), \
                (impl, x_dtype)
        with pytest.raises(ValueError, match="lora must hold"):
            triton_impl(grouped_linear)(x, w, lora=LoraUp(t[:, :1], b, scale))
    launches = count_gemm_launches(monkeypatch)
    triton_impl(grouped_linear)(x, w, out_dtype=torch.bfloat16, lora=lora)
    assert len(launches) == 1, "the LoRA delta in the product's epilogue"
    monkeypatch.undo()
    # gradients of x, t and b (a shared b's flow through its expand) against float64
    x = torch.randn(G, M, K, generator=g).to(device).requires_grad_()
    w = (torch.randn(G, N, K, generator=g) / K**0.5).to(device)
    t = torch.randn(G, M, R, generator=g).to(device).requires_grad_()
    b0 = torch.randn(1 if shared_b else G, N, R, generator=g).to(device).requires_grad_()
    gy = torch.randn(G, M, N, generator=g).to(device)
    b = b0.expand(G, -1, -1)
    with numerics_scope(current_numerics().replace(backward_matmul_precision="ieee")):
        got = torch.autograd.grad(triton_impl(grouped_linear)(x, w, out_dtype=torch.float32,
                                                              lora=LoraUp(t, b, scale)), [x, t, b0], gy)
    xd, td, bd = (v.detach().double().requires_grad_() for v in (x, t, b0))
    y = xd @ w.double().transpose(1, 2) + scale * td @ bd.expand(G, -1, -1).transpose(1, 2)
    want = torch.autograd.grad(y, [xd, td, bd], gy.double())
    for a, r in zip(got, want):
        assert a.shape == r.shape and (a.double() - r).abs().max() <= 1e-5 * r.abs().max()


def test_grouped_linear_grads(device):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 9, 40, generator=g).to(device).requires_grad_(True)
    w = torch.randn(3, 24, 40, generator=g).to(device).requires_grad_(True)
    gy = torch.randn(3, 9, 24, generator=g).to(device)
    (triton_impl(grouped_linear)(x, w) * gy).sum().backward()
    xd, wd = (t.detach().double().requires_grad_(True) for t in (x, w))
    ((xd @ wd.transpose(1, 2)) * gy.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------- bmm_fixed
@pytest.mark.parametrize("dtype", _dtypes())
def test_bmm_fixed_matches_float64_and_is_element_invariant(device, interpret, dtype):
    shapes = [(3, 4, 5), (16, 17, 64), (1, 5, 3), (7, 13, 1), (2, 0, 4)]
    if not interpret:
        shapes += [(64, 64, 64), (64, 128, 128), (64, 576, 64), (16, 128, 64), (32, 128, 2048)]
    g = torch.Generator().manual_seed(7)
    for m, k, n in shapes:
        a = torch.randn(12, m, k, generator=g).to(device, dtype)
        b = torch.randn(12, k, n, generator=g).to(device, dtype)
        y = triton_impl(bmm_fixed)(a, b)
        assert y.shape == (12, m, n) and y.dtype == torch.float32
        ref = a.double() @ b.double()
        gamma = k * U32 / (1 - k * U32)
        slack = 2.0 if dtype == torch.float32 else 8.0
        assert ((y.double() - ref).abs() <= slack * gamma * (a.double().abs() @ b.double().abs()) + 1e-30).all()
        alone = [triton_impl(bmm_fixed)(a[i:i + 1], b[i:i + 1])[0] for i in range(12)]
        for count in (1, 2, 5, 12):
            idx = torch.randperm(12, generator=g)[:count].to(device)
            out = triton_impl(bmm_fixed)(a[idx], b[idx])
            for j, i in enumerate(idx.tolist()):
                assert torch.equal(out[j], alone[i]), ((m, k, n), count, j)
    # broadcast leading dims (a shared b), 2-D operands
    a = torch.randn(2, 3, 8, 16, device=device)
    b = torch.randn(16, 4, device=device)
    y = triton_impl(bmm_fixed)(a, b)
    assert y.shape == (2, 3, 8, 4)
    torch.testing.assert_close(y, a @ b, rtol=1e-5, atol=1e-5)
    assert triton_impl(bmm_fixed)(a[0, 0], b).shape == (8, 4)


def test_bmm_fixed_grads(device):
    g = torch.Generator().manual_seed(8)
    a = torch.randn(2, 3, 8, 16, generator=g).to(device).requires_grad_(True)
    b = torch.randn(3, 16, 5, generator=g).to(device).requires_grad_(True)  # broadcast over dim 0
    gy = torch.randn(2, 3, 8, 5, generator=g).to(device)
    (triton_impl(bmm_fixed)(a, b) * gy).sum().backward()
    ad, bd = (t.detach().double().requires_grad_(True) for t in (a, b))
    ((ad @ bd) * gy.double()).sum().backward()
    torch.testing.assert_close(a.grad.double(), ad.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), bd.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- expert_linear
def _offsets(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)]


def _expert_case(device, dtype, e: int, n: int, k: int, seed: int, w_dtype: torch.dtype | None = None):
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(n, k, generator=g) / k**0.5).to(device, w_dtype or dtype) for _ in range(e)]
    return g, ws


@pytest.mark.parametrize("dtype", _dtypes())
def test_expert_linear_equals_per_expert_linear(device, interpret, dtype):
    """Each expert's rows == Triton linear(rows, W_e) bitwise (list and stacked weights), incl.
    experts with no rows; close to float64."""
    cases = [(4, 24, 40, [3, 0, 70, 1]), (3, 7, 33, [0, 5, 0])]
    if not interpret:
        cases += [(64, 256, 2048, None), (64, 2048, 256, None)]
    for E, N, K, counts in cases:
        g, ws = _expert_case(device, dtype, E, N, K, seed=E + N)
        if counts is None:  # bench MoE: 4096 tokens x top-8 over 64 experts, uneven, some empty
            p = torch.rand(E, generator=g) ** 3
            p[::9] = 0
            counts = torch.bincount(torch.multinomial(p, 4096 * 8, replacement=True, generator=g), minlength=E).tolist()
        off = _offsets(counts)
        x = torch.randn(off[-1], K, generator=g).to(device, dtype)
        stacked = torch.stack(ws)
        for weights in (ws, stacked):
            y = triton_impl(expert_linear)(x, weights, off)
            assert y.shape == (off[-1], N) and y.dtype == dtype
            for e in range(E):
                a, b = off[e], off[e + 1]
                if b > a:
                    assert torch.equal(y[a:b], _lin(x[a:b], weights[e])), (E, N, K, e)
            ref = expert_linear_ref(x, weights, off)
            for e in range(E):
                a, b = off[e], off[e + 1]
                if b > a:
                    be = _bound(x[a:b], ws[e], y[a:b], ref[a:b])
                    assert ((y[a:b].double() - ref[a:b]).abs() <= be).all()
        y32 = triton_impl(expert_linear)(x, ws, off, out_dtype=torch.float32)
        assert y32.dtype == torch.float32 and torch.equal(y32.to(dtype), triton_impl(expert_linear)(x, ws, off))


def test_expert_linear_lora_factors(device):
    """bf16 activations through fp32 stacked factors (batched expert LoRA: A [E, r, in], B [E, out, r])."""
    g = torch.Generator().manual_seed(9)
    a_f = torch.randn(5, 8, 48, generator=g).to(device)
    x = torch.randn(13, 48, generator=g).to(device, torch.bfloat16)
    off = _offsets([4, 0, 6, 2, 1])
    t = triton_impl(expert_linear)(x, a_f, off, out_dtype=torch.float32)
    for e in range(5):
        assert torch.equal(t[off[e]:off[e + 1]], _lin(x[off[e]:off[e + 1]], a_f[e], out_dtype=torch.float32))


@pytest.mark.parametrize("k", [40, 1100])  # one K step / split K (fp32 weights, K > SPLIT_K_CHUNK)
def test_delta_starts_the_sum(device, interpret, k):
    """``linear`` / ``expert_linear`` with a ``delta`` (the LoRA delta, fp32): the accumulator starts from it
    (``_assert_delta_start``: float64 bound, a zero delta changes no bit; a split-K product adds it after its
    partials, bitwise the unfused sum), with or without bias, in a 16-bit or fp32 output; an expert's rows have
    the bits of ``linear(rows, w_e, delta=...)``; the gradients equal the unfused ones (the delta's is the
    output's, in fp32)."""
    from zmrl.kernels_batch_invariant.triton.matmul import SPLIT_K_CHUNK
    g = torch.Generator().manual_seed(13)
    x = torch.randn(19, k, generator=g).to(device, torch.bfloat16)
    for w_dtype in (torch.bfloat16, torch.float32):
        w = (torch.randn(24, k, generator=g) / k**0.5).to(device, w_dtype)
        bias = torch.randn(24, generator=g).to(device, w_dtype)
        delta = torch.randn(19, 24, generator=g).to(device)
        for b, out_dtype in itertools.product((None, bias), (torch.bfloat16, torch.float32)):
            fused = _lin(x, w, b, out_dtype=out_dtype, delta=delta)
            _assert_delta_start(fused, x, w, b, delta, k > SPLIT_K_CHUNK and w_dtype == torch.float32)
        ws = torch.stack([w, w.flip(0), w * 0.5])
        off = _offsets([7, 0, 12])
        fused = triton_impl(expert_linear)(x, ws, off, delta=delta)
        rows = [_lin(x[off[e]:off[e + 1]], ws[e], delta=delta[off[e]:off[e + 1]]) for e in range(3)]
        assert torch.equal(fused, torch.cat(rows))
    # gradients: fused vs unfused (fp32 LoRA-style weight, bf16 output)
    w = (torch.randn(24, k, generator=g) / k**0.5).to(device).requires_grad_()
    xs = x.float().requires_grad_()
    d = delta.clone().requires_grad_()
    gy = torch.randn(19, 24, generator=g).to(device, torch.bfloat16)
    fused = torch.autograd.grad(_lin(xs, w, out_dtype=torch.bfloat16, delta=d), [xs, w, d], gy)
    plain = torch.autograd.grad((_lin(xs, w, out_dtype=torch.float32) + d).to(torch.bfloat16), [xs, w, d], gy)
    for a, b_ in zip(fused, plain):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("k,r", [(40, 32), (300, 8), (1100, 32)])  # r = 8: a zero-padded BLOCK_R; 1100: split K
def test_lora_in_the_epilogue_equals_the_unfused_delta(device, interpret, k, r):
    """``linear`` / ``expert_linear`` with ``lora`` (the LoRA delta as its up factors, computed in the GEMM's
    epilogue) equal the ``delta`` path with that delta computed by its defining composition
    (``lora_delta``: the fp32 x fp32 product and the scale), bitwise, for bf16 and fp32 base weights, with or
    without bias, at scale 1 and 2; row invariant; the gradients (of x, t and b) equal the unfused ones."""
    g = torch.Generator().manual_seed(k + r)
    m = 37
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    t = torch.randn(m, r, generator=g).to(device)
    for w_dtype, scale in ((torch.bfloat16, 1.0), (torch.float32, 2.0)):
        w = (torch.randn(48, k, generator=g) / k**0.5).to(device, w_dtype)
        b = (torch.randn(48, r, generator=g) / r**0.5).to(device)
        bias = torch.randn(48, generator=g).to(device, w_dtype)
        up = LoraUp(t, b, scale)
        for bb, out_dtype in itertools.product((None, bias), (torch.bfloat16, torch.float32)):
            fused = _lin(x, w, bb, out_dtype=out_dtype, lora=up)
            unfused = _lin(x, w, bb, out_dtype=out_dtype, delta=lora_delta(up, _lin))
            assert torch.equal(fused, unfused), (w_dtype, bb, out_dtype)
        _assert_rows_invariant(lambda rows, w=w, up=up: _lin(rows[:, :k], w, lora=LoraUp(rows[:, k:].float(), up.b, scale)),
                               torch.cat([x, t.to(torch.bfloat16)], dim=-1), [1, 2, 7, 17] if interpret else GPU_MS, seed=5)
        ws = torch.stack([w, w.flip(0), w * 0.5])
        bs = torch.stack([b, b.flip(0), b * 3])
        off = _offsets([9, 0, m - 9])
        eup = LoraUp(t, bs, scale)
        fused = triton_impl(expert_linear)(x, ws, off, lora=eup)
        unfused = expert_lora_delta(eup, off, triton_impl(expert_linear))
        assert torch.equal(fused, triton_impl(expert_linear)(x, ws, off, delta=unfused))
        dev_off = torch.tensor(off, device=device)
        assert torch.equal(triton_impl(expert_linear)(x, ws, dev_off, lora=eup), fused)  # device offsets
    with pytest.raises(ValueError, match="delta or lora"):
        _lin(x, w, delta=lora_delta(up, _lin), lora=up)
    # gradients: fused vs unfused, through x, t and b (fp32 base weight, bf16 output)
    w = (torch.randn(48, k, generator=g) / k**0.5).to(device).requires_grad_()
    xs, ts, bs1 = x.float().requires_grad_(), t.clone().requires_grad_(), b.clone().requires_grad_()
    gy = torch.randn(m, 48, generator=g).to(device, torch.bfloat16)
    fused = torch.autograd.grad(_lin(xs, w, out_dtype=torch.bfloat16, lora=LoraUp(ts, bs1, 2.0)), [xs, w, ts, bs1], gy)
    plain = torch.autograd.grad(_lin(xs, w, out_dtype=torch.bfloat16, delta=2.0 * _lin(ts, bs1, out_dtype=torch.float32)),
                                [xs, w, ts, bs1], gy)
    # x and w: the same backward GEMMs, bitwise. t and b: the fused product multiplies the bf16 output gradient by
    # the fp32 factors' bf16 halves (lora_grads), the unfused one an fp32 copy of it by the factors: the same
    # gradient to ~2^-16 of each term (test_lora_gradients_of_a_16bit_output bounds both against float64)
    for a, b_ in zip(fused[:2], plain[:2]):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)
    for a, b_ in zip(fused[2:], plain[2:]):
        assert (a - b_).abs().max() <= 2e-5 * b_.abs().max()
    bst = bs.clone().requires_grad_()
    ts2 = t.clone().requires_grad_()
    fused = torch.autograd.grad(triton_impl(expert_linear)(x, ws, off, lora=LoraUp(ts2, bst, 2.0)), [ts2, bst],
                                gy)
    plain = torch.autograd.grad(triton_impl(expert_linear)(
        x, ws, off, delta=2.0 * triton_impl(expert_linear)(ts2, bst, off, out_dtype=torch.float32)), [ts2, bst], gy)
    for a, b_ in zip(fused, plain):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)


def _concat_lora_case(g, device, w_dtype, k, ns, rs, m, scale):
    """Base weights [N_s, K] (views of one allocation: one segment table), x [m, K] bf16, t [m, sum r_s] and
    B_s [N_s, r_s] fp32 (B as views of one allocation too when the ranks agree)."""
    wide = (torch.randn(sum(ns), k, generator=g) / k**0.5).to(device, w_dtype)
    ws = list(wide.split(list(ns)))
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    t = torch.randn(m, sum(rs), generator=g).to(device)
    if len(set(rs)) == 1:
        bs = (torch.randn(sum(ns), rs[0], generator=g) / rs[0]**0.5).to(device).split(list(ns))
    else:
        bs = tuple((torch.randn(n, r, generator=g) / r**0.5).to(device) for n, r in zip(ns, rs))
    return x, ws, LoraUpConcat(t, tuple(bs), scale)


@pytest.mark.parametrize("rs", [(32, 32, 32), (8, 8, 8), (32, 8, 32)])  # r = 8: zero-padded BLOCK_R; mixed: unfused
def test_linear_concat_lora_in_the_epilogue(device, interpret, rs, monkeypatch):
    """``linear_concat(..., lora=)`` (project()'s adapted projections: every B product in the base GEMM's
    epilogue) is bitwise the ``delta`` path with the delta of its definition (``lora_concat_delta``: the
    block-diagonal product of the B factors, then the scale), and column block s is bitwise Triton
    ``linear(x, w_s, lora=LoraUp(t_s, B_s))`` — for bf16 and fp32 base weights, scale 1 and 2, segments that
    are not tile multiples; one launch where the ranks agree; the rows do not depend on the batch."""
    from zmrl.kernels_batch_invariant.triton.matmul import SPLIT_K_CHUNK
    g = torch.Generator().manual_seed(sum(rs))
    cat, bd = triton_impl(linear_concat), triton_impl(linear_blockdiag)
    ns, m = (7, 16, 33), 19
    cases = [(torch.bfloat16, 40, 1.0), (torch.float32, 40, 2.0), (torch.float32, SPLIT_K_CHUNK + 20, 1.0)]
    if not interpret:
        cases.append((torch.bfloat16, 2048, 2.0))
    for w_dtype, k, scale in cases:
        x, ws, up = _concat_lora_case(g, device, w_dtype, k, ns, rs, m, scale)
        for out_dtype in (torch.bfloat16, torch.float32):
            launches = count_gemm_launches(monkeypatch)
            fused = cat(x, ws, out_dtype=out_dtype, lora=up)
            n_launches = len(launches)
            monkeypatch.undo()
            split_k = w_dtype == torch.float32 and k > SPLIT_K_CHUNK
            if len(set(rs)) == 1 and not split_k:
                assert n_launches == 1, "one launch: every B product in the epilogue"
            unfused = cat(x, ws, out_dtype=out_dtype, delta=lora_concat_delta(up, bd))
            assert torch.equal(fused, unfused), (w_dtype, k, scale, out_dtype)
            ts = up.t.split(list(rs), dim=-1)
            blocks = [_lin(x, w, out_dtype=out_dtype, lora=LoraUp(t, b, scale)) for w, t, b in zip(ws, ts, up.bs)]
            assert torch.equal(fused, torch.cat(blocks, -1))
    x, ws, up = _concat_lora_case(g, device, torch.bfloat16, 40, ns, rs, 17, 2.0)
    _assert_rows_invariant(lambda rows: cat(rows[:, :40], ws, lora=LoraUpConcat(rows[:, 40:].float(), up.bs, 2.0)),
                           torch.cat([x, up.t.to(torch.bfloat16)], dim=-1), [1, 2, 7, 17] if interpret else GPU_MS, seed=9)
    # one projection: linear's own epilogue
    one = LoraUpConcat(up.t[:, :rs[0]], up.bs[:1], 2.0)
    assert torch.equal(cat(x, ws[:1], lora=one), _lin(x, ws[0], lora=LoraUp(one.t, one.bs[0], 2.0)))
    with pytest.raises(ValueError, match="delta or lora"):
        cat(x, ws, delta=lora_concat_delta(up, bd), lora=up)
    with pytest.raises(ValueError, match="one B"):
        cat(x, ws, lora=LoraUpConcat(up.t, up.bs[:2], 2.0))
    # the torch backend computes the defining composition
    xc, wc = x.cpu().float(), [w.cpu().float() for w in ws]
    upc = LoraUpConcat(up.t.cpu(), tuple(b.cpu() for b in up.bs), 2.0)
    assert torch.equal(linear_concat.impls["torch"](xc, wc, lora=upc),
                       linear_concat.impls["torch"](xc, wc, delta=lora_concat_delta(upc, linear_blockdiag.impls["torch"])))


@pytest.mark.parametrize("frozen", [False, True])  # trainable base weights (the dW GEMM) / frozen (LoRA training)
def test_linear_concat_lora_gradients(device, interpret, frozen):
    """The gradients of x, the base weights, t and every B of the fused ``linear_concat(..., lora=)`` match
    float64 (fp32 GEMMs of <= 40 terms: a few ulps of the largest value, 1e-5 relative is ample) and are
    bitwise the same on a second backward pass (run-to-run determinism)."""
    g = torch.Generator().manual_seed(31)
    cat = triton_impl(linear_concat)
    ns, k, r, m = (8, 24, 5), 40, 8, 11
    x, ws, up = _concat_lora_case(g, device, torch.float32, k, ns, (r,) * 3, m, 2.0)
    x = x.float().requires_grad_()
    ws = [w.clone().requires_grad_(not frozen) for w in ws]
    t = up.t.clone().requires_grad_()
    bs = [b.clone().requires_grad_() for b in up.bs]
    wanted = [x, t, *bs, *([] if frozen else ws)]
    gy = torch.randn(m, sum(ns), generator=g).to(device)

    def grads():
        y = cat(x, ws, out_dtype=torch.float32, lora=LoraUpConcat(t, tuple(bs), 2.0))
        return torch.autograd.grad(y, wanted, gy)

    got = grads()
    assert all(torch.equal(a, b) for a, b in zip(got, grads())), "the backward is deterministic"
    pd = [p.detach().double().requires_grad_() for p in wanted]
    xd, td, bd = pd[0], pd[1], pd[2:5]
    wd = pd[5:] if not frozen else [w.detach().double() for w in ws]
    ys = [xd @ w.t() + 2.0 * ts @ b.t() for w, ts, b in zip(wd, td.split(r, dim=-1), bd)]
    ref = torch.autograd.grad(torch.cat(ys, -1), pd, gy.double())
    for a, want in zip(got, ref):
        assert a.shape == want.shape
        assert (a.double() - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6


@pytest.mark.parametrize("concat", [False, True])
def test_lora_gradients_of_a_16bit_output(device, interpret, concat, monkeypatch):
    """With a bf16 output (the model's projections) the LoRA factors' gradients of ``linear`` / ``linear_concat``
    match float64 and are deterministic. The 16-bit output gradient is multiplied as it is (each fp32 factor as
    two bf16 halves, ``mm_fp32_factor``; the path is asserted taken), never copied to fp32 (on CPU its GEMMs are
    exact fp32 products of the halves). Bound: the gradient is exact in bf16, the factors carried to ~2^-17 relative, fp32
    accumulation over <= 40 (or M = 37) terms: 2e-5 of the largest value is ample, while a wrong column block or a
    transposed factor gives errors of the size of the values."""
    from zmrl.kernels_batch_invariant import backward_gemms
    from zmrl.kernels_batch_invariant.triton import matmul as tmm
    calls = []
    real = backward_gemms.mm_fp32_factor
    monkeypatch.setattr(tmm, "mm_fp32_factor", lambda a, f: calls.append(a.shape) or real(a, f))
    g = torch.Generator().manual_seed(41)
    ns, k, r, m, scale = ((8, 24, 16) if concat else (40,)), 40, 8, 37, 2.0
    x, ws, up = _concat_lora_case(g, device, torch.bfloat16, k, ns, (r,) * len(ns), m, scale)
    t = up.t.clone().requires_grad_()
    bs = [b.clone().requires_grad_() for b in up.bs]
    gy = torch.randn(m, sum(ns), generator=g).to(device, torch.bfloat16)

    def grads():
        if concat:
            y = triton_impl(linear_concat)(x, ws, lora=LoraUpConcat(t, tuple(bs), scale))
        else:
            y = _lin(x, ws[0], lora=LoraUp(t, bs[0], scale))
        assert y.dtype == torch.bfloat16
        return torch.autograd.grad(y, [t, *bs], gy)

    got = grads()
    assert all(torch.equal(a, b) for a, b in zip(got, grads())), "the backward is deterministic"
    assert len(calls) == 4 * len(ns), calls  # dt and dB of every segment, in each of the two backward passes
    td, bd = t.detach().double().requires_grad_(), [b.detach().double().requires_grad_() for b in bs]
    ys = [scale * ts @ b.t() for ts, b in zip(td.split(r, dim=-1), bd)]
    ref = torch.autograd.grad(torch.cat(ys, -1), [td, *bd], gy.double())
    for a, want in zip(got, ref):
        assert a.shape == want.shape and a.dtype == torch.float32
        assert (a.double() - want).abs().max() <= 2e-5 * want.abs().max() + 1e-6


def test_lora_epilogue_at_training_rows(device, interpret, monkeypatch):
    """At training sizes (>= LARGE_M rows per expert, or rows of a linear / linear_concat: the 256 x 128 tiles a LoRA
    product turns into 128 x 256 ones, ``lora_config``) every row is computed and equals the unfused delta path: a
    grid counted for the other tile leaves rows unwritten (found by the bench-shape GPU parity test: NaN in a
    32K-token prefill). Under the interpreter (whose dot holds a [BLOCK_M, BLOCK_K, BLOCK_N] product, at most 2^20
    elements) the 16-bit products take a 256 x 128 tile with a 16-wide K step, so the change happens there too."""
    from zmrl.kernels_batch_invariant.triton import matmul as tmm
    from zmrl.kernels_batch_invariant.triton.matmul import LARGE_M, GemmConfig
    monkeypatch.setattr(tmm, "LORA_WIDE_N", 32)  # this 48-wide product takes the wide LoRA tile (128 x 256)
    if interpret:
        real = tmm.linear_config
        monkeypatch.setattr(tmm, "linear_config", lambda n, k, dtype, m=1, experts=False: (
            GemmConfig(256, 128, 16, 8, 3) if dtype == torch.bfloat16 and m >= LARGE_M
            else GemmConfig(32, 32, 32, 4, 3) if dtype == torch.float32 else real(n, k, dtype, m, experts)))
    g = torch.Generator().manual_seed(7)
    k, r, n = 40, 32, 48
    counts = [LARGE_M + 77, 0, 2 * LARGE_M + 1000]  # the mean rows per expert picks the tile: >= LARGE_M
    off = _offsets(counts)
    m = off[-1]
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    t = torch.randn(m, r, generator=g).to(device)
    ws = torch.stack([(torch.randn(n, k, generator=g) / k**0.5) for _ in counts]).to(device, torch.bfloat16)
    bs = torch.stack([torch.randn(n, r, generator=g) / r**0.5 for _ in counts]).to(device)
    up = LoraUp(t, bs, 1.0)
    fused = triton_impl(expert_linear)(x, ws, off, lora=up)
    unfused = triton_impl(expert_linear)(x, ws, off, delta=expert_lora_delta(up, off, triton_impl(expert_linear)))
    assert torch.isfinite(fused).all() and torch.equal(fused, unfused)
    plain = LoraUp(t, bs[0], 1.0)
    assert torch.equal(_lin(x, ws[0], lora=plain), _lin(x, ws[0], delta=lora_delta(plain, _lin)))
    # linear_concat: its column tiles are counted for the narrowed tile too
    both = LoraUpConcat(torch.cat([t, t.flip(0)], dim=-1), (bs[0], bs[2]), 1.0)
    fused = triton_impl(linear_concat)(x, [ws[0], ws[2]], lora=both)
    unfused = triton_impl(linear_concat)(x, [ws[0], ws[2]],
                                         delta=lora_concat_delta(both, triton_impl(linear_blockdiag)))
    assert torch.isfinite(fused).all() and torch.equal(fused, unfused)


@triton.jit
def _banded_tiles(out_ptr, GROUP: tl.constexpr):
    r, c = grouped_tile(tl.program_id(0), tl.program_id(1), GROUP)
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), r * 1000 + c)


def test_banded_order_visits_every_tile_once(device):
    """``grouped_tile`` maps the grid onto itself one to one, for bands that divide the row tiles, a short last band,
    one row or one column tile."""
    for rows, cols, group in [(1, 7, 8), (7, 1, 8), (16, 5, 8), (19, 3, 8), (13, 4, 4), (5, 6, 1)]:
        out = torch.full((cols, rows), -1, dtype=torch.int32, device=device)
        _banded_tiles[(rows, cols)](out, GROUP=group)
        got = sorted(out.flatten().tolist())
        assert got == sorted(r * 1000 + c for r in range(rows) for c in range(cols)), (rows, cols, group)


def test_banded_order_gives_the_plain_orders_bits(device, interpret, monkeypatch):
    """Every mode of the GEMM (plain with bias, LoRA epilogue, segments, batched, experts, split K with the serial
    sum) on grids of several row and column tiles gives the same bits in the banded launch order as in the plain
    one: the order decides which program computes a tile, never what it computes."""
    from zmrl.kernels_batch_invariant.triton import matmul as tmm
    from zmrl.kernels_batch_invariant.triton.matmul import GemmConfig
    # small tiles: many row and column tiles at interpreter-sized shapes (every config gives the same bits)
    monkeypatch.setattr(tmm, "linear_config", lambda n, k, dtype, m=1, experts=False: GemmConfig(16, 16, 16, 4, 2))
    g = torch.Generator().manual_seed(11)
    m, k, n, r = 100, 40, 72, 8
    bf = torch.bfloat16
    x = torch.randn(m, k, generator=g).to(device, bf)
    w, w2 = (torch.randn(n, k, generator=g).to(device, bf) for _ in range(2))
    bias = torch.randn(n, generator=g).to(device, bf)
    t = torch.randn(m, r, generator=g).to(device)
    lb = torch.randn(n, r, generator=g).to(device)
    w32 = torch.randn(n, 600, generator=g).to(device)  # an fp32 weight with K > SPLIT_K_CHUNK: split K
    x600 = torch.randn(m, 600, generator=g).to(device, bf)
    xg = torch.randn(3, m, k, generator=g).to(device, bf)
    wg = torch.randn(3, n, k, generator=g).to(device, bf)
    off = _offsets([37, 0, 63])
    ws = torch.stack([w, w2, w])
    calls = {
        "plain": lambda: _lin(x, w, bias),
        "lora": lambda: _lin(x, w, lora=LoraUp(t, lb, 0.5)),
        "segments": lambda: triton_impl(linear_concat)(x, [w, w2[:40]]),
        "batched": lambda: triton_impl(grouped_linear)(xg, wg),
        "experts": lambda: triton_impl(expert_linear)(x, ws, off),
        "split_k": lambda: _lin(x600, w32, out_dtype=torch.float32),
    }
    for name, call in calls.items():
        monkeypatch.setattr(tmm, "GROUP_M", 1)
        plain = call()
        monkeypatch.setattr(tmm, "GROUP_M", 4)
        banded = call()
        assert torch.isfinite(plain).all() and torch.equal(plain, banded), name


def test_split_k_fp32_weights(device, interpret):
    """fp32 weights with K > SPLIT_K_CHUNK (LoRA A factors over the hidden state, MLA's o_proj input) sum K
    in fixed chunks: the result is fp32-accurate, independent of the batch, with or without bias, and the
    same bits through linear, linear_concat (a column block) and expert_linear (an expert's rows) — the
    equalities project() and the batched expert LoRA rely on. K = 1100: two whole chunks and a partial one."""
    from zmrl.kernels_batch_invariant.triton.matmul import SPLIT_K_CHUNK
    k = 2 * SPLIT_K_CHUNK + 76
    g = torch.Generator().manual_seed(12)
    ws = [torch.randn(n, k, generator=g).to(device) / k**0.5 for n in (32, 8, 40)]
    bias = torch.randn(32, generator=g).to(device)
    x = torch.randn(21, k, generator=g).to(device, torch.bfloat16)
    for b in (None, bias):
        for out_dtype in (torch.float32, torch.bfloat16):
            y = _lin(x, ws[0], b, out_dtype=out_dtype)
            ref = x.double() @ ws[0].double().t() + (0 if b is None else b.double())
            err = (y.double() - ref).abs()
            assert (err <= _bound(x, ws[0], y, ref)).all(), f"max err {err.max():.3g}"
        _assert_rows_invariant(lambda r, b=b: _lin(r, ws[0], b, out_dtype=torch.float32), x[:9],
                               [1, 2, 7, 17] if interpret else GPU_MS, seed=4)
    cat = triton_impl(linear_concat)(x, ws, out_dtype=torch.float32)
    assert torch.equal(cat, torch.cat([_lin(x, w, out_dtype=torch.float32) for w in ws], dim=-1))
    stacked = torch.stack([torch.randn(32, k, generator=g) / k**0.5 for _ in range(4)]).to(device)
    off = _offsets([5, 0, 9, 7])
    t = triton_impl(expert_linear)(x, stacked, off, out_dtype=torch.float32)
    for e in range(4):
        if off[e + 1] > off[e]:
            assert torch.equal(t[off[e]:off[e + 1]], _lin(x[off[e]:off[e + 1]], stacked[e], out_dtype=torch.float32))


def test_split_k_sum_in_the_gemm_launch_equals_the_separate_sum(device, interpret, monkeypatch):
    """The serial split-K sum (each tile's last program adds the partials, one launch) gives the bits of the
    separate ``_split_k_sum`` launch: plain (with bias, with a delta, bf16 out), concatenated and expert
    products; repeated calls reuse the tile counters (each tile's summing program resets its own)."""
    from zmrl.kernels_batch_invariant.triton import matmul as M
    k = 2 * M.SPLIT_K_CHUNK + 76
    g = torch.Generator().manual_seed(21)
    ws = [torch.randn(n, k, generator=g).to(device) / k**0.5 for n in (32, 8, 96)]
    bias = torch.randn(32, generator=g).to(device)
    x = torch.randn(37, k, generator=g).to(device, torch.bfloat16)
    delta = torch.randn(37, 32, generator=g).to(device)
    stacked = torch.stack([torch.randn(32, k, generator=g) / k**0.5 for _ in range(4)]).to(device)
    off = _offsets([5, 0, 19, 13])
    lin = triton_impl(linear)

    def products():
        return [lin(x, ws[0], out_dtype=torch.float32), lin(x, ws[0], bias, out_dtype=torch.bfloat16),
                lin(x, ws[0], out_dtype=torch.float32, delta=delta), lin(x, ws[2], out_dtype=torch.float32),
                triton_impl(linear_concat)(x, ws, out_dtype=torch.float32),
                triton_impl(expert_linear)(x, stacked, off, out_dtype=torch.float32)]

    sums = count_gemm_launches(monkeypatch, "_split_k_sum")  # none while the GEMMs sum their own partials
    monkeypatch.setattr(M, "SERIAL_SPLIT_SUM", True)
    serial = products()
    again = products()
    assert not sums, "the serial path fell back to the separate sum"
    monkeypatch.setattr(M, "SERIAL_SPLIT_SUM", False)
    separate = products()
    assert len(sums) == len(separate), "every product of the case splits K"
    for i, (a, b, c) in enumerate(zip(serial, again, separate)):
        assert torch.equal(a, c), f"product {i}: the serial sum differs from _split_k_sum"
        assert torch.equal(a, b), f"product {i}: a repeated call differs"
    assert all(int(buf.abs().sum()) == 0 for buf, _ in _common._COUNTERS.values()), "tile counters left non-zero"


def test_expert_linear_reads_gathered_rows_in_place(device, interpret):
    """``gather``: the MoE's dispatch (pair r reads token order[r] // top_k) read by the kernel gives the bits of
    the product over the gathered copy: bf16 weights with the LoRA epilogue, and the fp32 A factors (split K)."""
    from zmrl.kernels_batch_invariant.matmul import LoraUp
    from zmrl.kernels_batch_invariant.triton.matmul import SPLIT_K_CHUNK
    g = torch.Generator().manual_seed(31)
    t_tokens, top_k, k, n, r = 6, 3, SPLIT_K_CHUNK + 40, 48, 8
    h = torch.randn(t_tokens, k, generator=g).to(device, torch.bfloat16)
    order = torch.randperm(t_tokens * top_k, generator=g).to(device)
    off = _offsets([5, 0, 9, 4])
    gather = RowGather(order, top_k)
    rows = h[order // top_k]
    w = torch.stack([torch.randn(n, k, generator=g) / k**0.5 for _ in range(4)]).to(device, torch.bfloat16)
    a = torch.stack([torch.randn(r, k, generator=g) / k**0.5 for _ in range(4)]).to(device)
    b = torch.stack([torch.randn(n, r, generator=g) * 0.1 for _ in range(4)]).to(device)
    el = triton_impl(expert_linear)
    t = el(h, a, off, out_dtype=torch.float32, gather=gather)
    assert torch.equal(t, el(rows, a, off, out_dtype=torch.float32))
    y = el(h, w, off, lora=LoraUp(t, b, 0.5), gather=gather)
    assert torch.equal(y, el(rows, w, off, lora=LoraUp(t, b, 0.5)))
    dev_off = torch.tensor(off, dtype=torch.int32, device=device)  # device offsets: the graph-capturable form
    assert torch.equal(el(h, w, dev_off, gather=gather), el(rows, w, off))
    with pytest.raises(ValueError, match="gather needs"):
        el(h, w, off, gather=RowGather(order.float(), top_k))


@pytest.mark.parametrize("dtype", _dtypes())
def test_expert_linear_invariant_to_token_counts(device, interpret, dtype):
    """A (row, expert) pair gives the same bits whatever the other experts' and its own expert's
    token counts are, and wherever the row sits in its expert's segment."""
    E, N, K = (4, 24, 40) if interpret else (64, 256, 2048)
    g, ws = _expert_case(device, dtype, E, N, K, seed=11)
    pool = torch.randn(32, K, generator=g).to(device, dtype)
    # alone[e][i]: row i as the only row of the call, routed to expert e
    alone = {}
    for e in range(E):
        for i in range(pool.shape[0]):
            if (i + e) % 3 == 0 or not interpret:
                counts = [0] * E
                counts[e] = 1
                alone[e, i] = triton_impl(expert_linear)(pool[i:i + 1], ws, _offsets(counts))[0]
    totals = [1, 7, 64, 65, 130] if interpret else [1, 8, 64, 129, 1000, 4096]
    for total in totals:
        # random routing: expert per row from a skewed distribution (many empty experts at small totals)
        pairs = [(e, i) for (e, i) in alone]
        pick = torch.randint(0, len(pairs), (total,), generator=g).tolist()
        chosen = sorted((pairs[p] for p in pick), key=lambda t: t[0])
        counts = [0] * E
        for e, _ in chosen:
            counts[e] += 1
        x = pool[torch.tensor([i for _, i in chosen], device=pool.device)]
        y = triton_impl(expert_linear)(x, ws, _offsets(counts))
        want = torch.stack([alone[p] for p in chosen])
        if not torch.equal(y, want):
            bad = (y != want).any(1).nonzero()[0].item()
            pytest.fail(f"{total} routed rows: row {bad} (expert {chosen[bad][0]}) differs from the row alone")


def test_expert_linear_grads(device):
    g = torch.Generator().manual_seed(12)
    off = _offsets([3, 0, 5, 2])
    x = torch.randn(10, 24, generator=g).to(device).requires_grad_(True)
    ws = [torch.randn(16, 24, generator=g).to(device).requires_grad_(True) for _ in range(4)]
    stacked = torch.randn(4, 16, 24, generator=g).to(device).requires_grad_(True)
    gy = torch.randn(10, 16, generator=g).to(device)
    for weights in (ws, stacked):
        x.grad = None
        (triton_impl(expert_linear)(x, weights, off) * gy).sum().backward()
        xd = x.detach().double().requires_grad_(True)
        wd = ([w.detach().double().requires_grad_(True) for w in ws] if isinstance(weights, list)
              else stacked.detach().double().requires_grad_(True))
        (expert_linear_ref(xd, wd, off) * gy.double()).sum().backward()
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
        if isinstance(weights, list):
            for w, w_d in zip(ws, wd):
                # an expert without rows gets no gradient at all (None), as autograd gives the reference
                assert (w.grad is None) == (w_d.grad is None)
                if w.grad is not None:
                    torch.testing.assert_close(w.grad.double(), w_d.grad, rtol=1e-5, atol=1e-5)
                w.grad = None
        else:
            torch.testing.assert_close(stacked.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)


def test_expert_linear_empty_and_errors(device):
    ws = [torch.randn(6, 8, device=device) for _ in range(3)]
    assert triton_impl(expert_linear)(torch.randn(0, 8, device=device), ws, [0, 0, 0, 0]).shape == (0, 6)
    with pytest.raises(ValueError):
        triton_impl(expert_linear)(torch.randn(4, 8, device=device), ws, [0, 1, 2])  # E+1 offsets
    with pytest.raises(ValueError):
        triton_impl(expert_linear)(torch.randn(4, 8, device=device), ws, [0, 3, 2, 4])  # not rising


def test_moe_layer_uses_grouped_gemm_bitwise(device, interpret):
    """On CUDA the MoE layer (all its ops dispatched to Triton) gives each routed expert's rows the
    bits of the per-expert module path, with and without expert LoRA."""
    if interpret:
        pytest.skip("the model dispatches to Triton only for CUDA tensors")
    from zmrl.lora import apply_lora
    from zmrl.lora.config import LoraConfig
    from zmrl.model import ModelConfig, build_model
    from zmrl.model.moe import MoE

    model = build_model(ModelConfig.preset("tiny"), seed=0, dtype="bfloat16").to(device)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    g = torch.Generator().manual_seed(13)
    hs = torch.randn(50, moe.experts[0].gate_proj.in_features, generator=g).to(device, torch.bfloat16)
    counts = torch.bincount(torch.randint(0, len(moe.experts), (50,), generator=g), minlength=len(moe.experts)).tolist()
    off = _offsets(counts)
    for with_lora in (False, True):
        if with_lora:
            apply_lora(model, LoraConfig(r=8, alpha=16.0, init_b_std=0.05, init_seed=5))
        with torch.no_grad():
            y = moe._routed_experts(hs, counts)
            for e in range(len(moe.experts)):
                a, b = off[e], off[e + 1]
                if b > a:
                    assert torch.equal(y[a:b], moe.experts[e](hs[a:b], moe.experts_lora, e)), (with_lora, e)
