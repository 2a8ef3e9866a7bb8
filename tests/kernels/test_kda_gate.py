"""KDA forget gate: both variants against the float64 reference, invariance, gradients."""
from __future__ import annotations

import math

import pytest
import torch

from zmrl.kernels_batch_invariant.kda_gate import kda_gate, kda_gate_ref

H, DK = 3, 12  # 36 features a row: not a multiple of the SIMD width


def params(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a_log = torch.log(torch.empty(H).uniform_(1.0, 16.0, generator=gen))
    dt = torch.exp(torch.empty(H * DK).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    return a_log, dt_bias, gen


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("t", [1, 7, 37, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(lower_bound, t, dtype):
    a_log, dt_bias, gen = params(t)
    # z spans the whole softplus range, past its linear threshold (20) and deep negative
    z = (torch.randn(t, H * DK, generator=gen) * 8.0).to(dtype)
    g = kda_gate(z, a_log, dt_bias, H, lower_bound=lower_bound)
    assert g.shape == (t, H, DK) and g.dtype == torch.float32
    ref = kda_gate_ref(z, a_log, dt_bias, H, lower_bound=lower_bound)
    # fp32 composition of exp/log1p/divide: a few ulp (~1e-7 relative); the softplus threshold
    # switch (same as torch's) costs at most exp(-20) ~ 2e-9. A wrong head broadcast, a missing
    # dt_bias or the wrong variant are O(1) relative errors.
    torch.testing.assert_close(g.double(), ref, rtol=1e-5, atol=1e-7)
    assert (g <= 0).all()
    if lower_bound is not None:
        assert (g >= lower_bound).all()


def test_hf_shaped_a_log():
    a_log, dt_bias, gen = params(1)
    z = torch.randn(9, H * DK, generator=gen)
    assert torch.equal(kda_gate(z, a_log.view(1, 1, H, 1), dt_bias, H), kda_gate(z, a_log, dt_bias, H))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_invariant_to_batch(lower_bound):
    """Each row alone and at other positions of other-sized batches: bitwise equal. 37 rows x 36
    features puts a row's elements in both the SIMD bulk and the scalar tail depending on the
    call, which is where torch's own sigmoid/softplus differ in the last ulp."""
    a_log, dt_bias, gen = params(2)
    z = torch.randn(37, H * DK, generator=gen) * 4.0
    g = kda_gate(z, a_log, dt_bias, H, lower_bound=lower_bound)
    for i in range(37):
        assert torch.equal(kda_gate(z[i : i + 1], a_log, dt_bias, H, lower_bound=lower_bound), g[i : i + 1])
        assert torch.equal(kda_gate(z[i:], a_log, dt_bias, H, lower_bound=lower_bound), g[i:])
    perm = torch.randperm(37, generator=gen)
    assert torch.equal(kda_gate(z[perm], a_log, dt_bias, H, lower_bound=lower_bound), g[perm])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gradcheck(lower_bound):
    a_log, dt_bias, gen = params(3)
    z = torch.randn(5, H * DK, generator=gen, dtype=torch.float64)
    inputs = [t.detach().double().requires_grad_() for t in (z, a_log, dt_bias)]

    def f(z, a, b):
        return kda_gate(z, a, b, H, lower_bound=lower_bound)

    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)
