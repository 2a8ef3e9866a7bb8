"""swiglu / situ_glu: accuracy against float64, position independence, gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zmrl.kernels_batch_invariant.glu import situ_glu, situ_glu_ref, swiglu, swiglu_ref

from .invariance import THREAD_COUNTS, assert_rows_invariant, num_threads

OPS = {"swiglu": (swiglu, swiglu_ref), "situ_glu": (situ_glu, situ_glu_ref)}


def _gu(t: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(t, d, generator=g) * 4
    up = torch.randn(t, d, generator=g) * 30  # reaches the 25*tanh(u/25) cap
    extremes = torch.tensor([-100.0, -30.0, 30.0, 100.0, 0.0, -0.0, 1e-20, -1e-20])
    m = min(len(extremes), gate.numel())
    gate.view(-1)[:m] = extremes[:m]  # overflow of exp(-g), saturation, signed zeros, tiny values
    return gate.to(dtype), up.to(dtype)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("d", [1, 5, 64, 256, 1000])
def test_matches_float64(name: str, d: int) -> None:
    op, ref = OPS[name]
    gate, up = _gu(11, d, seed=d)
    got = op(gate, up)
    assert got.dtype == torch.float32 and got.shape == gate.shape
    # Each result is a product of factors each within a few ulp (sigmoid = 1/(1+exp(-g)): exp
    # 1 ulp + 2 roundings; tanh ~1-2 ulp; the divisions and multiplies 1 rounding each): <= ~12u
    # ~ 7e-7 relative. rtol 2e-6 leaves margin; a wrong constant (tanh(g/4) vs tanh(g)/4, cap 25 vs
    # 20) or a swapped gate/up is off by >= 1e-2 relative. atol covers silu(-100): ours flushes to
    # -0.0 (exp(100) overflows to inf, 1/inf = 0) where the true value is -3.7e-42.
    torch.testing.assert_close(got.double(), ref(gate, up), rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("name", list(OPS))
def test_bf16_and_out_dtype(name: str) -> None:
    op, ref = OPS[name]
    gate, up = _gu(9, 100, seed=3, dtype=torch.bfloat16)
    got = op(gate, up)
    assert got.dtype == torch.bfloat16
    # computed in fp32 from exact bf16 inputs, rounded once to bf16 (2^-9 relative)
    torch.testing.assert_close(got.double(), ref(gate, up), rtol=2.0**-8, atol=1e-30)
    got32 = op(gate, up, out_dtype=torch.float32)
    assert got32.dtype == torch.float32 and torch.equal(got32.bfloat16(), got)


def test_swiglu_is_silu_times_up() -> None:
    gate, up = _gu(5, 64, seed=0)
    # same math as torch's SiLU (rounding may differ by a couple of ulp; see test_pointwise)
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up, rtol=1e-6, atol=1e-30)


def test_situ_glu_caps() -> None:
    g = torch.tensor([1e4, 1e4, -1e4, 0.0])
    u = torch.tensor([1e4, -1e4, 1e4, 5.0])
    torch.testing.assert_close(situ_glu(g, u), torch.tensor([100.0, -100.0, -0.0, 0.0]))


@pytest.mark.parametrize("beta,linear_beta", [(1.0, None), (2.0, 10.0), (4.0, 25.0)])
def test_situ_glu_betas(beta: float, linear_beta: float | None) -> None:
    """The betas are arguments (Kimi-Linear's defaults are beta 1 and no cap on the up branch)."""
    gate, up = _gu(7, 64, seed=1)
    got = situ_glu(gate, up, beta=beta, linear_beta=linear_beta)
    torch.testing.assert_close(got.double(), situ_glu_ref(gate, up, beta, linear_beta), rtol=2e-6, atol=1e-30)
    if linear_beta is None:  # uncapped: the up branch is u itself, exactly
        a = situ_glu(gate, torch.ones_like(up), beta=beta, linear_beta=None)
        assert torch.equal(got, a * up)
    fast = situ_glu.impls["fast"](gate, up, beta=beta, linear_beta=linear_beta)
    torch.testing.assert_close(fast.double(), situ_glu_ref(gate, up, beta, linear_beta), rtol=2e-6, atol=1e-30)
    with pytest.raises(ValueError, match="beta"):
        situ_glu(gate, up, beta=0.0)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        swiglu(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError):
        situ_glu(torch.randn(3, 4), torch.randn(4, 4))


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("d", [1, 5, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariance(name: str, d: int, dtype: torch.dtype) -> None:
    """Row alone vs inside batches 1..70 (up to 70k elements: SIMD bulk, scalar tail, and the
    thread split all land on different rows)."""
    op, _ = OPS[name]
    gate, up = _gu(80, d, seed=d, dtype=dtype)
    assert_rows_invariant(op, (gate, up), seed=d)


@pytest.mark.parametrize("name", list(OPS))
def test_element_alone_equals_element_in_big_tensor(name: str) -> None:
    op, _ = OPS[name]
    gate, up = _gu(1, 100_003, seed=7)
    gate, up = gate[0], up[0]
    for threads in THREAD_COUNTS:
        with num_threads(threads):
            full = op(gate, up)
            for n in (1, 3, 7):
                for p in [*range(0, 40), *range(50_000, 50_040), *range(100_003 - 40, 100_003 - n)]:
                    assert torch.equal(op(gate[p:p + n].clone(), up[p:p + n].clone()), full[p:p + n]), (n, p)


@pytest.mark.parametrize("name", list(OPS))
def test_gradients(name: str) -> None:
    op, ref = OPS[name]
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 3).requires_grad_()
    up = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 10).requires_grad_()
    assert torch.autograd.gradcheck(op, (gate, up))
    # fp32 gradient vs autograd through the float64 reference
    g32, u32 = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    op(g32, u32).sum().backward()
    gr, ur = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    ref(gr, ur).sum().backward()
    torch.testing.assert_close(g32.grad.double(), gr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u32.grad.double(), ur.grad, rtol=1e-5, atol=1e-6)
