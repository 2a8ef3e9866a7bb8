"""The grouped ``expert_linear`` backward on the GPU (Triton forward, moe_gemm_grads.py backward) at the
bench preset's MoE shapes (64 experts, hidden 2048, expert intermediate 256, 16K tokens x top-8 with a
skewed routing): against float64, against the per-expert loop it replaced, bitwise determinism, and
its time next to that loop's (printed with -s).

Tolerance. bf16 weights and a bf16 input: dx runs as a bf16 GEMM with fp32 accumulation after rounding
the output gradient to bf16 (relative <= 2^-9 per element), exactly what the per-expert loop did; the
LoRA factors (fp32) run fp32 GEMMs. dx is returned in x's dtype (bf16: one more 2^-9 rounding), so
elementwise |err| <= 2^-7 (|gy| @ |W|) for dx, and <= 2 L 2^-24 (|gy|^T @ |x|) + 1e-30 for the fp32
weight gradient (L = the expert's row count): what a correct computation meets and an expert mix-up
misses by orders of magnitude. That is at ``backward_matmul_precision="ieee"``; at the default "tf32" the
fp32 output gradient is rounded to TF32 (2^-11 relative; x is bf16, exact in TF32) before the products,
which adds 2^-11 (|gy|^T @ |x|) to the weight bound and 2^-11 (|gy| @ |W|) to dx's (2^-7 still covers it).
"""
from __future__ import annotations

import itertools
import time

import pytest
import torch

from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.moe_gemm import expert_linear

# CUDA only, also under TRITON_INTERPRET=1 (bench-size shapes; the interpreter would take hours)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, D, INTER = 64, 2048, 256


def _counts(m: int, gen: torch.Generator) -> list[int]:
    p = torch.rand(E, generator=gen) ** 3
    p[::9] = 0  # some experts get nothing
    return torch.bincount(torch.multinomial(p, m, replacement=True, generator=gen), minlength=E).tolist()


def _offsets(counts):
    return [0, *itertools.accumulate(counts)]


def _old_loop(gy, x, ws, off, stacked):
    """The per-expert backward this replaced (cuBLAS per expert, same compute dtypes)."""
    w0 = ws if stacked else ws[0]
    cdt = x.dtype if x.dtype == w0.dtype and x.dtype == torch.bfloat16 else torch.float32
    dx = gy.new_zeros(gy.shape[0], x.shape[1], dtype=x.dtype)
    dw = torch.zeros_like(ws) if stacked else None
    for e, (a, b) in enumerate(zip(off, off[1:])):
        if b > a:
            g = gy[a:b].to(cdt)
            dx[a:b] = (g @ ws[e].to(cdt)).to(x.dtype)
            if stacked:
                dw[e] = (g.t() @ x[a:b].to(cdt)).to(ws.dtype)
    return dx, dw


def _timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


@pytest.mark.parametrize("which,precision", [("base_gate_proj", "tf32"), ("lora_A", "ieee"), ("lora_A", "tf32")])
def test_grouped_backward_bench_shapes(which, precision):
    with numerics_scope(current_numerics().replace(backward_matmul_precision=precision)):
        _check_grouped_backward(which, precision)


def _check_grouped_backward(which, precision):
    gen = torch.Generator().manual_seed(0)
    m = 16384 * 8
    counts = _counts(m, gen)
    off = _offsets(counts)
    dev = "cuda"
    x = torch.randn(m, D, generator=gen).to(dev, torch.bfloat16)
    if which == "base_gate_proj":  # frozen bf16 expert weights [INTER, D]: dx only
        ws = [(torch.randn(INTER, D, generator=gen) * 0.02).to(dev, torch.bfloat16) for _ in range(E)]
        weights, stacked, n = ws, False, INTER
    else:  # stacked fp32 LoRA A [E, 32, D]: dx and dA
        weights, stacked, n = (torch.randn(E, 32, D, generator=gen) * 0.02).to(dev), True, 32
    gy = torch.randn(m, n, generator=gen).to(dev)

    def new():
        xl = x.clone().requires_grad_(True)
        wl = weights.clone().requires_grad_(True) if stacked else weights
        expert_linear(xl, wl, off, out_dtype=torch.float32).backward(gy)
        return xl.grad, (wl.grad if stacked else None)

    dx, dw = new()
    dx2, dw2 = new()
    assert torch.equal(dx, dx2) and (dw is None or torch.equal(dw, dw2)), "not deterministic"
    dx_old, dw_old = _old_loop(gy, x, weights, off, stacked)
    t_new, t_old = _timed(new), _timed(lambda: _old_loop(gy, x, weights, off, stacked))
    print(f"{which}: grouped backward {t_new:.1f} ms (incl. forward), per-expert loop {t_old:.1f} ms")
    # float64 on the experts with the fewest, the median and the most rows
    order = sorted((e for e in range(E) if counts[e]), key=lambda e: counts[e])
    for e in (order[0], order[len(order) // 2], order[-1]):
        a, b = off[e], off[e + 1]
        w = weights[e].double()
        ref_x = gy[a:b].double() @ w
        # dx is returned in x's dtype (bf16) in both cases: the bf16 bound
        assert bool(((dx[a:b].double() - ref_x).abs() <= 2.0 ** -7 * (gy[a:b].double().abs() @ w.abs())).all()), e
        if stacked:
            ref_w = gy[a:b].double().t() @ x[a:b].double()
            rel = 2 * (b - a) * 2.0 ** -24 + (2.0 ** -11 if precision == "tf32" else 0.0)
            bound = rel * (gy[a:b].double().abs().t() @ x[a:b].double().abs()) + 1e-30
            assert bool(((dw[e].double() - ref_w).abs() <= bound).all()), e
            # vs the loop's dW: the same float64 bound, not a fixed rtol (both are fp32 sums of b - a products
            # in different orders; where terms cancel they differ by more than any rtol -- it failed on the H200)
            assert bool(((dw_old[e].double() - ref_w).abs() <= bound).all()), e
        # the loop it replaced meets the same bound (its GEMMs sum in another order, so the bf16 results may
        # differ from ours in the last place), and ours is no less accurate than it on this expert
        assert bool(((dx_old[a:b].double() - ref_x).abs() <= 2.0 ** -7 * (gy[a:b].double().abs() @ w.abs())).all()), e
        err_new = float((dx[a:b].double() - ref_x).abs().max())
        err_old = float((dx_old[a:b].double() - ref_x).abs().max())
        if precision == "ieee":  # same arithmetic as the loop: no less accurate
            assert err_new <= 1.5 * err_old + 1e-6, (e, err_new, err_old)
    for e in range(E):
        if not counts[e] and stacked:
            assert not dw[e].any()


def test_device_offsets_backward_equals_host_offsets():
    """Device offsets (the MoE's CUDA path) reach the backward through the forward's non-blocking copy to
    pinned memory, shared by the calls of one offsets tensor: the gradients equal those with host offsets
    bitwise (same grouped backward once the offsets are known), for base and LoRA-style weights."""
    gen = torch.Generator().manual_seed(1)
    m = 4096 * 8
    counts = _counts(m, gen)
    off = _offsets(counts)
    dev_off = torch.tensor(off, dtype=torch.int32, device="cuda")
    x = torch.randn(m, D, generator=gen).to("cuda", torch.bfloat16)
    base = [(torch.randn(INTER, D, generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(E)]
    lora = (torch.randn(E, 32, D, generator=gen) * 0.02).to("cuda")
    gb = torch.randn(m, INTER, generator=gen).to("cuda")
    gl = torch.randn(m, 32, generator=gen).to("cuda")

    def grads(offsets):
        xl = x.clone().requires_grad_(True)
        wl = lora.clone().requires_grad_(True)
        y_base = expert_linear(xl, base, offsets, out_dtype=torch.float32)
        y_lora = expert_linear(xl, wl, offsets, out_dtype=torch.float32)
        torch.autograd.backward([y_base, y_lora], [gb, gl])
        return xl.grad, wl.grad

    host, dev = grads(off), grads(dev_off)
    assert all(torch.equal(a, b) for a, b in zip(host, dev))
    assert getattr(dev_off, "_zmrl_host_offsets", None) is not None  # one pinned copy for both calls
