"""linear / bmm_fixed: accuracy against float64 and bitwise row/element invariance."""
from __future__ import annotations

import itertools
from typing import Iterator

import pytest
import torch

from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.matmul import bmm_fixed, linear, linear_blockdiag, linear_concat, linear_ref

from .invariance import BATCHES, THREAD_BATCHES, THREAD_COUNTS, num_threads

U32 = 2.0**-24
SIZES = [1, 3, 16, 17, 64, 80, 100, 256, 576, 1000]


def _gamma_bound(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """Worst-case fp32 dot-product error, any summation order: gamma_K * (|x| @ |w|^T)."""
    return (k * U32 / (1 - k * U32)) * (x.double().abs() @ w.double().abs().t())


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Accuracy does not depend on the thread count; one thread keeps these many small cases fast."""
    with num_threads(1):
        yield


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("k,n", list(itertools.product(SIZES, SIZES)))
def test_linear_matches_float64(k: int, n: int, one_thread: None) -> None:
    g = torch.Generator().manual_seed(k * 7919 + n)
    ms = [[1, 2, 7, 16, 33, 100, 300][(k + n) % 7], (k * n) % 300 + 1]  # M covers 1..300 over the grid
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    for m in ms:
        x = torch.randn(m, k, generator=g)
        ref = linear_ref(x, w)
        got = linear(x, w)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # The bound is rigorous for fp32 accumulation in any order; a wrong row, a transposed or
        # mis-cropped weight, or stray padding gives errors of the size of |y| (~sqrt(K)), far above.
        bound = _gamma_bound(x, w, k) + 1e-30
        assert ((got.double() - ref).abs() <= bound).all(), (m, k, n)
        # + bias: one more rounding of |y + b|
        got_b = linear(x, w, bias)
        ref_b = linear_ref(x, w, bias)
        assert ((got_b.double() - ref_b).abs() <= bound + U32 * ref_b.abs() * 2 + 1e-30).all()


@pytest.mark.parametrize("k,n", [(1, 1), (17, 3), (64, 80), (576, 100), (1000, 17)])
def test_linear_bf16(k: int, n: int, one_thread: None) -> None:
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(37, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    ref = linear_ref(x, w)  # bf16 -> float64 is exact
    got = linear(x, w)
    assert got.dtype == torch.bfloat16
    # fp32 accumulation of exact products, then one bf16 rounding (2^-9 relative): bound both.
    err = (got.double() - ref).abs()
    assert (err <= _gamma_bound(x, w, k) * 1.01 + 2.0**-8 * ref.abs() + 1e-30).all()
    got32 = linear(x, w, out_dtype=torch.float32)
    assert got32.dtype == torch.float32
    assert torch.equal(got32.bfloat16(), got)  # rounded once, at the end


def test_linear_leading_dims_and_empty() -> None:
    x = torch.randn(2, 3, 5, 17)
    w = torch.randn(9, 17)
    y = linear(x, w)
    assert y.shape == (2, 3, 5, 9)
    assert torch.equal(y.reshape(-1, 9), linear(x.reshape(-1, 17), w))
    assert linear(torch.randn(0, 17), w).shape == (0, 9)
    with pytest.raises(ValueError):
        linear(torch.randn(3, 16), w)


@pytest.mark.parametrize("shape", [(3, 4, 5), (64, 64, 64), (64, 17, 128), (16, 576, 64), (1, 5, 3)])
def test_bmm_fixed_matches_float64(shape: tuple[int, int, int], one_thread: None) -> None:
    m, k, n = shape
    a = torch.randn(6, m, k)
    b = torch.randn(6, k, n)
    ref = a.double() @ b.double()
    got = bmm_fixed(a, b)
    bound = (k * U32 / (1 - k * U32)) * (a.double().abs() @ b.double().abs())
    assert ((got.double() - ref).abs() <= bound + 1e-30).all()
    # broadcast leading dims
    b1 = torch.randn(k, n)
    torch.testing.assert_close(bmm_fixed(a, b1), a @ b1, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- invariance


INV_SHAPES = [(17, 3), (64, 1), (5, 16), (100, 80), (256, 256), (576, 17), (1000, 100)]


@pytest.mark.parametrize("k,n", INV_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_invariance(k: int, n: int, dtype: torch.dtype) -> None:
    """Every row alone == the same row inside batches of 1..70 rows at every position, from
    storage at random offsets, computed with 1, 2 or 4 threads."""
    g = torch.Generator().manual_seed(k * 31 + n)
    pool = torch.randn(90, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    flat = torch.empty(90 * k + 64, dtype=dtype)

    def check(sizes: list[int], alone: list[torch.Tensor]) -> None:
        for b in sizes:
            idx = torch.randperm(len(pool), generator=g)[:b]
            off = int(torch.randint(0, 64, (1,), generator=g))
            x = flat[off:off + b * k].view(b, k)  # storage at a random (unaligned) offset
            x.copy_(pool[idx])
            out = linear(x, w, bias)
            if not torch.equal(out, torch.stack([alone[i] for i in idx.tolist()])):
                j = next(j for j, i in enumerate(idx.tolist()) if not torch.equal(out[j], alone[i]))
                pytest.fail(f"row at position {j} of a batch of {b} differs from the row alone")

    with num_threads(1):
        alone = [linear(pool[i:i + 1], w, bias)[0] for i in range(len(pool))]
        check(BATCHES, alone)
    # more threads: fewer calls (an oversubscribed 2-core CI box makes each one slow)
    for threads in THREAD_COUNTS[1:]:
        with num_threads(threads):
            assert all(torch.equal(linear(pool[i:i + 1], w, bias)[0], alone[i]) for i in range(0, 90, 11)), threads
            check(THREAD_BATCHES, alone)


def test_plain_matmul_is_not_row_invariant_here() -> None:
    """Documents the problem linear() solves: plain ``x @ w.T`` gives row 0 different bits alone
    (MKL's M=1 path) than inside a batch. Skipped on a CPU/BLAS where it happens not to."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 256, generator=g)
    w = torch.randn(256, 256, generator=g)
    for m in (2, 16, 17, 33, 70):
        alone, batched = (x[:1] @ w.t())[0], (x[:m] @ w.t())[0]
        if not torch.equal(alone, batched):
            # reliably so: recomputing reproduces both results bit for bit
            assert torch.equal((x[:1] @ w.t())[0], alone) and torch.equal((x[:m] @ w.t())[0], batched)
            assert torch.equal(linear(x[:1], w)[0], linear(x[:m], w)[0])
            return
    pytest.skip("plain x @ w.T happens to be row-invariant on this CPU/BLAS")


BMM_SHAPES = [(64, 64, 64), (64, 17, 128), (16, 576, 64), (1, 5, 3), (7, 13, 1),
              (1, 80, 64), (1, 64, 16)]  # one-row products: MLA scores / DSA dots with one head per shard


@pytest.mark.parametrize("b_layout", ["row-major", "k-major"])
@pytest.mark.parametrize("shape", BMM_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_fixed_element_invariance(shape: tuple[int, int, int], dtype: torch.dtype, b_layout: str) -> None:
    """Element b's product does not depend on the batch count, its position, the other elements'
    values, or the thread count; a row of a product does not depend on the other rows' values.

    ``b_layout="k-major"`` passes b as a transposed view (``keys.transpose(1, 2)``, as attention does);
    with one row per product that is the case where a batch of one and a larger batch reached
    different MKL routines (see ``matmul._bmm``)."""
    m, k, n = shape
    g = torch.Generator().manual_seed(m * k + n)
    a = torch.randn(40, m, k, generator=g).to(dtype)
    if b_layout == "k-major":
        b = torch.randn(40, n, k, generator=g).to(dtype).transpose(1, 2)
    else:
        b = torch.randn(40, k, n, generator=g).to(dtype)
    with num_threads(1):
        alone = [bmm_fixed(a[i:i + 1], b[i:i + 1])[0] for i in range(40)]
    for threads in THREAD_COUNTS:
        with num_threads(threads):
            for count in (1, 2, 3, 15, 16, 17, 33, 40):
                idx = torch.randperm(40, generator=g)[:count]
                out = bmm_fixed(a[idx], b[idx])
                for j, i in enumerate(idx.tolist()):
                    assert torch.equal(out[j], alone[i]), (shape, count, j, threads)
            # other elements' values replaced: element 5 unchanged
            a2, b2 = torch.randn_like(a.float()).to(dtype), torch.randn_like(b.float()).to(dtype)
            a2[5], b2[5] = a[5], b[5]
            assert torch.equal(bmm_fixed(a2, b2)[5], alone[5])
            # zeroing rows of a leaves the other rows' results unchanged
            if m > 1:
                az = a.clone()
                az[:, ::2] = 0
                full = bmm_fixed(a, b)
                zr = bmm_fixed(az, b)
                assert torch.equal(zr[:, 1::2], full[:, 1::2])
                assert torch.equal(zr[:, ::2], torch.zeros_like(zr[:, ::2]))


@pytest.mark.parametrize("shape", [(1, 80, 64), (1, 5, 256), (1, 33, 17), (16, 64, 1), (3, 256, 1), (4, 33, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bmm_fixed_batch_of_one_in_every_layout(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """A batch of one gives the bits of the same element inside a batch, whichever way a and b are laid
    out. ATen computes a batch of one with a plain GEMM and larger batches with MKL's batched GEMM; the
    two differ for one-row or one-column products (under the default strict CNR mode and under AUTO:
    benchmarks/cpu_gemm_batch_of_one.py), which ``matmul._bmm`` routes to the batched GEMM."""
    m, k, n = shape
    g = torch.Generator().manual_seed(m + k + n)
    for a_cm, b_cm in itertools.product((False, True), (False, True)):
        a = torch.randn(5, k, m, generator=g, dtype=dtype).transpose(1, 2) if a_cm else \
            torch.randn(5, m, k, generator=g, dtype=dtype)
        b = torch.randn(5, n, k, generator=g, dtype=dtype).transpose(1, 2) if b_cm else \
            torch.randn(5, k, n, generator=g, dtype=dtype)
        alone = bmm_fixed(a[2:3], b[2:3])[0]
        for lo, hi in ((2, 4), (1, 3), (0, 5)):
            assert torch.equal(bmm_fixed(a[lo:hi], b[lo:hi])[2 - lo], alone), (shape, a_cm, b_cm, hi - lo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_concat_is_the_concatenation_of_linears(dtype: torch.dtype) -> None:
    """``linear_concat`` (fused projections, model.layers.project) gives every column the bits ``linear``
    gives it, with gradients of the same function; fast mode is one stock linear per weight."""
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(n, 40, generator=g).to(dtype) for n in (7, 16, 33)]
    x = torch.randn(9, 40, generator=g).to(dtype)
    for out_dtype in (None, torch.float32):
        assert torch.equal(linear_concat(x, ws, out_dtype=out_dtype),
                           torch.cat([linear(x, w, out_dtype=out_dtype) for w in ws], dim=-1))
    xg = x.float().requires_grad_()
    wg = [w.float().requires_grad_() for w in ws]
    gy = torch.randn(9, 56, generator=g)
    got = torch.autograd.grad(linear_concat(xg, wg), [xg, *wg], gy)
    want = torch.autograd.grad(torch.cat([xg @ w.t() for w in wg], dim=-1), [xg, *wg], gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp32 GEMMs of <= 56 terms, other orders
    with kernel_mode("fast"):
        fast = linear_concat(x, ws)
    torch.testing.assert_close(fast.float(), linear_concat(x, ws).float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="no weights"):
        linear_concat(x, [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_concat_delta_is_the_unfused_sum(dtype: torch.dtype) -> None:
    """``linear_concat(..., delta=)`` (project()'s LoRA deltas) is bitwise ``(fp32 concat + delta).to(out)``,
    i.e. column block i is ``linear(x, w_i, delta=delta_i)``; fast mode adds it too."""
    g = torch.Generator().manual_seed(6)
    ws = [torch.randn(n, 40, generator=g).to(dtype) for n in (7, 16, 33)]
    x = torch.randn(9, 40, generator=g).to(dtype)
    delta = torch.randn(9, 56, generator=g)
    for out_dtype in (None, torch.float32):
        y = linear_concat(x, ws, out_dtype=out_dtype, delta=delta)
        assert torch.equal(y, (linear_concat(x, ws, out_dtype=torch.float32) + delta).to(out_dtype or dtype))
        blocks = [linear(x, w, out_dtype=out_dtype, delta=d) for w, d in zip(ws, delta.split([7, 16, 33], -1))]
        assert torch.equal(y, torch.cat(blocks, -1))
    with kernel_mode("fast"):
        fast = linear_concat(x, ws, delta=delta)
    torch.testing.assert_close(fast.float(), linear_concat(x, ws, delta=delta).float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="delta must be an fp32 tensor"):
        linear_concat(x, ws, delta=delta[:, :50])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_blockdiag_is_the_blocks_linears(dtype: torch.dtype) -> None:
    """``linear_blockdiag`` (all LoRA B factors of one input in one op) gives column block s the bits of
    ``linear(x[..., block s], w_s)``, rows invariant to the batch; its gradients are the composition's
    (same torch ops) and close to float64 (fp32 GEMMs of <= 13 terms: 1e-5 relative is ample)."""
    g = torch.Generator().manual_seed(7)
    ks, ns = (8, 5, 13), (7, 16, 3)
    ws = [torch.randn(n, k, generator=g).to(dtype) for n, k in zip(ns, ks)]
    x = torch.randn(9, sum(ks), generator=g).to(dtype)
    for out_dtype in (None, torch.float32):
        y = linear_blockdiag(x, ws, out_dtype=out_dtype)
        assert torch.equal(y, torch.cat([linear(xs, w, out_dtype=out_dtype) for xs, w in zip(x.split(ks, -1), ws)], -1))
        for m in (1, 2, 5):
            assert torch.equal(linear_blockdiag(x[:m], ws, out_dtype=out_dtype), y[:m])
    xg = x.float().requires_grad_()
    wg = [w.float().requires_grad_() for w in ws]
    gy = torch.randn(9, sum(ns), generator=g)
    got = torch.autograd.grad(linear_blockdiag(xg, wg), [xg, *wg], gy)
    xd, wd = xg.detach().double().requires_grad_(), [w.detach().double().requires_grad_() for w in wg]
    ref = torch.autograd.grad(torch.cat([xs @ w.t() for xs, w in zip(xd.split(ks, -1), wd)], -1), [xd, *wd], gy.double())
    for a, r in zip(got, ref):
        assert (a.double() - r).abs().max() <= 1e-5 * r.abs().max()
    with kernel_mode("fast"):
        fast = linear_blockdiag(x, ws)
    torch.testing.assert_close(fast.float(), linear_blockdiag(x, ws).float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="their K must sum"):
        linear_blockdiag(x[:, :-1], ws)
    with pytest.raises(ValueError, match="no weights"):
        linear_blockdiag(x, [])
