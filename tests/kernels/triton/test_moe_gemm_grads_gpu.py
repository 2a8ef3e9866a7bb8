"""The grouped ``expert_linear`` backward on the GPU (Triton forward, the Triton backward kernels of
triton/expert_grads.py dispatched from moe_gemm_grads.py) at the bench preset's MoE shapes (64 experts,
hidden 2048, expert intermediate 256, LoRA r = 32, 16K tokens x top-8 with a skewed routing): against
float64, against the per-expert loop and the padded-bmm torch path they replaced, bitwise determinism,
and their times (printed with -s).

Tolerance. Elementwise |err| <= (c_in + 2 L u + c_out) S with S = |a| @ |b| in float64 (the sum of
the absolute products of the element's length-L dot), u = 2^-24:
* c_in, the rounding of the operands to the compute class: bf16 x and bf16 weights make a bf16 GEMM,
  the fp32 output gradient rounded to bf16 (2^-8, bf16's unit roundoff), as the per-expert loop did;
  fp32 GEMMs (LoRA factors) at ``backward_matmul_precision="tf32"`` feed the tensor cores fp32 values
  of which they keep 10 mantissa bits (truncated: < 2^-10 relative per fp32 operand, 2 x 2^-10 per
  product); at "ieee" nothing;
* 2 L u: fp32 accumulation (each addition <= 2u relative, rounding or truncating);
* c_out: the final rounding to bf16 (2^-8) or fp32 (u).
What a correct computation meets and an expert mix-up misses by orders of magnitude.
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


def _routed_rows(m: int, seed: int):
    """(generator, m, skewed expert counts, their host and device offsets, bf16 rows [m, D] on the GPU)."""
    gen = torch.Generator().manual_seed(seed)
    counts = _counts(m, gen)
    off = _offsets(counts)
    dev_off = torch.tensor(off, dtype=torch.int32, device="cuda")
    return gen, m, counts, off, dev_off, torch.randn(m, D, generator=gen).to("cuda", torch.bfloat16)


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
        # dx is returned in x's dtype (bf16) in both cases: the bf16 bound (c_in + c_out <= 2^-7 in every case)
        rel_x = 2.0 ** -7 + 2 * w.shape[0] * 2.0 ** -24
        assert bool(((dx[a:b].double() - ref_x).abs() <= rel_x * (gy[a:b].double().abs() @ w.abs())).all()), e
        if stacked:
            ref_w = gy[a:b].double().t() @ x[a:b].double()
            # fp32 gy at TF32 (< 2^-10; x is bf16, exact in TF32), fp32 accumulation and result
            rel = (2 * (b - a) + 1) * 2.0 ** -24 + (2.0 ** -10 if precision == "tf32" else 0.0)
            bound = rel * (gy[a:b].double().abs().t() @ x[a:b].double().abs()) + 1e-30
            assert bool(((dw[e].double() - ref_w).abs() <= bound).all()), e
            # vs the loop's dW: the same float64 bound, not a fixed rtol (both are fp32 sums of b - a products
            # in different orders; where terms cancel they differ by more than any rtol -- it failed on the H200)
            assert bool(((dw_old[e].double() - ref_w).abs() <= bound).all()), e
        # the loop it replaced meets the same bound (its GEMMs sum in another order, so the bf16 results may
        # differ from ours in the last place), and ours is no less accurate than it on this expert
        assert bool(((dx_old[a:b].double() - ref_x).abs() <= rel_x * (gy[a:b].double().abs() @ w.abs())).all()), e
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
    gen, m, counts, off, dev_off, x = _routed_rows(4096 * 8, seed=1)
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


# One MoE layer's expert products at the bench preset with LoRA r = 32 on every expert projection:
# (x dtype, weight dims [N, K], weights stacked?, weight dtype, output-gradient dtype, weights trained?)
R = 32
BENCH_PRODUCTS = {
    "base_gate": (torch.bfloat16, (INTER, D), False, torch.bfloat16, torch.float32, False),  # frozen, fp32 out
    "base_down": (torch.bfloat16, (D, INTER), False, torch.bfloat16, torch.float32, False),
    "base_gate_trained": (torch.bfloat16, (INTER, D), False, torch.bfloat16, torch.bfloat16, True),  # no LoRA
    "lora_A_gate": (torch.bfloat16, (R, D), True, torch.float32, torch.float32, True),
    "lora_B_gate": (torch.float32, (INTER, R), True, torch.float32, torch.float32, True),
    "lora_A_down": (torch.bfloat16, (R, INTER), True, torch.float32, torch.float32, True),
    "lora_B_down": (torch.float32, (D, R), True, torch.float32, torch.float32, True),
}


def _rel(l: int, c_in: float, out_dtype: torch.dtype) -> float:
    return c_in + 2 * l * 2.0 ** -24 + (2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -24)


def _c_in(x_dtype, w_dtype, g_dtype, precision):
    if x_dtype == w_dtype == torch.bfloat16:
        return 0.0 if g_dtype == torch.bfloat16 else 2.0 ** -8
    return 2 * 2.0 ** -10 if precision == "tf32" else 0.0


@pytest.mark.parametrize("which,precision", [*((w, "tf32") for w in BENCH_PRODUCTS),
                                             ("lora_A_gate", "ieee"), ("lora_B_down", "ieee")])
def test_kernels_vs_torch_path_bench_shapes(which, precision):
    """``expert_linear_grads`` (Triton kernels) vs ``expert_linear_grads_torch`` (the padded-bmm path they
    replaced) on one bench-shape product: both against float64 on the experts with the fewest, the median
    and the most rows; the kernels bitwise deterministic; both timed (-s)."""
    from zmrl.kernels_batch_invariant.moe_gemm_grads import expert_linear_grads, expert_linear_grads_torch
    from zmrl.kernels_batch_invariant.numerics import backward_matmuls

    x_dt, (n, k), stacked, w_dt, g_dt, trained = BENCH_PRODUCTS[which]
    gen = torch.Generator().manual_seed(2)
    m = 16384 * 8
    counts = _counts(m, gen)
    off = _offsets(counts)
    dev = torch.device("cuda")
    x = torch.randn(m, k, generator=gen).to(dev, x_dt)
    w = (torch.randn(E, n, k, generator=gen) * 0.02).to(dev, w_dt)
    weights = w if stacked else list(w.unbind(0))
    gy = torch.randn(m, n, generator=gen).to(dev, g_dt)
    need_w = ([True] if stacked else [True] * E) if trained else ([False] if stacked else [False] * E)
    xs = x if trained else None

    with numerics_scope(current_numerics().replace(backward_matmul_precision=precision)):
        def new():
            return expert_linear_grads(gy, xs, weights, off, True, need_w, x_dt)

        def old():
            with backward_matmuls(dev):
                return expert_linear_grads_torch(gy, xs, weights, off, True, need_w, x_dt)

        dx, dws = new()
        dx2, dws2 = new()
        assert torch.equal(dx, dx2), "dx not deterministic"
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(dws, dws2)), "dW not deterministic"
        dx_old, dws_old = old()
        t_new, t_old = _timed(new, reps=5), _timed(old, reps=5)
    print(f"\n{which} ({precision}): Triton kernels {t_new:.2f} ms, padded-bmm torch path {t_old:.2f} ms "
          f"({t_old / t_new:.1f}x)")
    c_in = _c_in(x_dt, w_dt, g_dt, precision)
    order = sorted((e for e in range(E) if counts[e]), key=lambda e: counts[e])
    for e in (order[0], order[len(order) // 2], order[-1]):
        a, b = off[e], off[e + 1]
        g64, w64, x64 = gy[a:b].double(), w[e].double(), x[a:b].double()
        ref_x, s_x = g64 @ w64, g64.abs() @ w64.abs()
        bound = _rel(n, c_in, x_dt) * s_x + 1e-30
        assert bool(((dx[a:b].double() - ref_x).abs() <= bound).all()), ("dx", e)
        assert bool(((dx_old[a:b].double() - ref_x).abs() <= bound).all()), ("dx, torch path", e)
        if trained:
            ref_w, s_w = g64.t() @ x64, g64.abs().t() @ x64.abs()
            bound = _rel(b - a, c_in, w_dt) * s_w + 1e-30
            got, got_old = (dws[0][e], dws_old[0][e]) if stacked else (dws[e], dws_old[e])
            assert bool(((got.double() - ref_w).abs() <= bound).all()), ("dW", e)
            assert bool(((got_old.double() - ref_w).abs() <= bound).all()), ("dW, torch path", e)
    if trained:
        for e in range(E):
            if not counts[e]:
                assert (not dws[0][e].any()) if stacked else dws[e] is None


def test_gate_up_one_gradient_bench_shapes():
    """``expert_gate_up`` at one bench MoE layer (16K tokens x top-8, frozen bf16 experts, fp32 LoRA r = 32 on gate
    and up): the rows' gradient from one kernel (triton/expert_gate_up.py) against float64 on the experts with the
    fewest, the median and the most rows (the bound of tests/kernels/triton/test_expert_gate_up.py), bitwise
    deterministic, timed (-s) against the unfused products under autograd (four [M, 2048] gradients, three adds)."""
    from zmrl.kernels_batch_invariant.matmul import LoraUp
    from zmrl.kernels_batch_invariant.moe_gemm import ExpertLoraFactors, expert_gate_up

    gen, m, counts, off, dev_off, x0 = _routed_rows(16384 * 8, seed=3)
    ws = [[(torch.randn(INTER, D, generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(E)] for _ in range(2)]
    fs = [ExpertLoraFactors((torch.randn(E, R, D, generator=gen) * 0.02).to("cuda").requires_grad_(),
                            (torch.randn(E, INTER, R, generator=gen) * 0.02).to("cuda").requires_grad_(), 2.0)
          for _ in range(2)]
    gys = [torch.randn(m, INTER, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]

    def fused():
        x = x0.clone().requires_grad_(True)
        outs = expert_gate_up(x, ws[0], ws[1], dev_off, fs[0], fs[1])
        return torch.autograd.grad(outs, [x, fs[0].a, fs[0].b, fs[1].a, fs[1].b], gys)

    def unfused():
        x = x0.clone().requires_grad_(True)
        outs = [expert_linear(x, w, dev_off, lora=LoraUp(expert_linear(x, f.a, dev_off, out_dtype=torch.float32),
                                                          f.b, f.scale)) for w, f in zip(ws, fs)]
        return torch.autograd.grad(outs, [x, fs[0].a, fs[0].b, fs[1].a, fs[1].b], gys)

    got, again = fused(), fused()
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "not deterministic"
    ref_unfused = unfused()
    t_fused, t_unfused = _timed(fused), _timed(unfused)
    print(f"gate+up with LoRA, forward + backward: one rows gradient {t_fused:.1f} ms, unfused {t_unfused:.1f} ms")
    order = sorted((e for e in range(E) if counts[e]), key=lambda e: counts[e])
    rel = 2 * 2.0 ** -8 + 2 * (2 * INTER + 2 * R) * 2.0 ** -24
    for e in (order[0], order[len(order) // 2], order[-1]):
        a, b = off[e], off[e + 1]
        ref = torch.zeros(b - a, D, dtype=torch.float64, device="cuda")
        s = torch.zeros_like(ref)
        for w, f, gy in zip(ws, fs, gys):
            g = gy[a:b].double()
            dt = f.scale * g @ f.b[e].detach().double()
            ref += g @ w[e].double() + dt @ f.a[e].detach().double()
            s += g.abs() @ w[e].double().abs() + dt.abs() @ f.a[e].detach().double().abs()
        assert bool(((got[0][a:b].double() - ref).abs() <= rel * s).all()), e
        assert bool(((ref_unfused[0][a:b].double() - ref).abs() <= 2 * rel * s).all()), e
    for g, r in zip(got[1:], ref_unfused[1:]):  # the factors' gradients: the unfused products' kernels, same bits
        assert torch.equal(g, r)
