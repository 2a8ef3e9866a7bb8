"""The fused elementwise stages of the MLA backward's bf16 path (triton/mla_attention_bwd.py) against their
torch compositions in kernels_batch_invariant/mla_attention_grads.py, and the whole bf16 backward with them
against float64. Runs on CUDA, or on CPU under TRITON_INTERPRET=1.

Tolerances. The softmax: both sides compute fp32 probabilities (exp, max, sum in different orders: a few
fp32 ulps apart) and round them to bf16, so they differ by at most one bf16 ulp (2^-7 relative to the
value, at a rounding boundary); unlisted keys and rows without keys are exact zeros on both. dS: the dP GEMM
sums in another order than torch's, then the same two fp32 operations and one rounding (test_dp_ds_matches_torch
states the bound). The
end-to-end check is test_mla_attention_grads.py's ``check_bf16_grads`` (2^-5 of the largest gradient).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_mla_attention_grads import check_bf16_grads  # noqa: E402
from tests.kernels.test_mla_attention_grads import problem as problem  # noqa: E402,F401 (fixture)
from zmrl.kernels_batch_invariant import mla_attention_grads as M  # noqa: E402
from zmrl.kernels_batch_invariant.triton.mla_attention_bwd import (  # noqa: E402
    DP_DS_BLOCK_U, SOFTMAX_BLOCK, dp_ds_bf16, masked_softmax_bf16)

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


def _scores(g, h, u, seed, device):
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randn(g * h, u, generator=gen) * 4).to(device)
    listed = (torch.rand(g, u, generator=gen) < 0.6).to(device)
    listed[1] = False  # a query without keys
    listed[2, 1:], listed[2, 0] = False, True  # a query with one key
    return s, listed


@pytest.mark.parametrize("u", [1, 37, SOFTMAX_BLOCK + 5])
def test_masked_softmax_matches_torch(device, u):
    g, h = 5, 3
    s, listed = _scores(g, h, u, seed=u, device=device)
    got = masked_softmax_bf16(s, listed, h)
    want = M._softmax_bf16_torch(s.clone(), listed, h)
    assert got.dtype == torch.bfloat16 and got.shape == s.shape
    off = ~listed.repeat_interleave(h, 0)
    assert not got[off].any() and not want[off].any(), "unlisted keys get exact zeros"
    assert not got[h:2 * h].any(), "a query without keys gets zero probabilities"
    if u > 1:
        assert torch.equal(got[2 * h:3 * h, 0], torch.ones(h, dtype=torch.bfloat16, device=device))
    err = (got.float() - want.float()).abs()
    assert bool((err <= 2.0 ** -7 * want.float().abs()).all()), float(err.max())
    rows = got.float().sum(-1)
    live = listed.any(-1).repeat_interleave(h, 0)
    # probabilities summing to 1, each within one bf16 rounding (2^-7 relative at most), plus fp32 sums
    assert bool(((rows[live] - 1).abs() <= 2.0 ** -7 + u * 2.0 ** -24).all())


@pytest.mark.parametrize("rows, u", [(7, 1), (130, 300), (5, 2 * DP_DS_BLOCK_U + 9)])
def test_dp_ds_matches_torch(device, rows, u):
    """dS = P (dO C^T - delta): the GEMM's fp32 sum over Dc in another order than torch's (at most Dc ulps of the
    sum of |dO||C| terms), then the same subtract, multiply and rounding; one bf16 ulp (2^-7 relative) of slack
    where the shifted sum moves a value across a rounding boundary. C is a strided view (the keys' latent
    columns), as the backward passes it."""
    gen = torch.Generator().manual_seed(5)
    dc = 96
    go16 = torch.randn(rows, dc, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(u, dc + 16, generator=gen).to(device, torch.bfloat16)
    c = k[:, :dc]
    p16 = torch.rand(rows, u, generator=gen).to(device, torch.bfloat16)
    delta = torch.randn(rows, generator=gen).to(device)
    got = dp_ds_bf16(go16, c, p16, delta)
    want = M._dp_ds_bf16_torch(go16, c, p16, delta)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, u)
    sum_err = dc * 2.0 ** -23 * (go16.float().abs() @ c.float().abs().t())
    bound = 2.0 ** -7 * want.float().abs() + p16.float() * sum_err
    assert bool(((got.float() - want.float()).abs() <= bound).all())
    exact = (p16.double() * (go16.double() @ c.double().t() - delta.double()[:, None]))
    assert bool(((got.double() - exact).abs() <= 2.0 ** -7 * exact.abs() + p16.double() * sum_err.double()).all())


def test_query_bf16_matches_torch(device, interpret):
    from zmrl.kernels_batch_invariant.triton.mla_attention_bwd import query_bf16

    gen = torch.Generator().manual_seed(6)
    q_lat = torch.randn(4, 6, 3, 40, generator=gen).to(device)[:, :, 1]  # strided [G, H, Dc]
    q_pe = torch.randn(4, 6, 16, generator=gen).to(device)
    got = query_bf16(q_lat, q_pe, 0.07)
    want = M._query_bf16_torch(q_lat, q_pe, 0.07)
    assert got.shape == want.shape == (24, 56) and got.dtype == torch.bfloat16
    if interpret:  # the interpreter truncates fp32 -> bf16: one bf16 ulp
        assert bool(((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs()).all())
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_bf16_backward_with_the_kernels_matches_float64(device, problem, kind):  # noqa: F811
    assert M._bf16_stages(device).softmax is masked_softmax_bf16  # the kernels run here (CUDA, or the interpreter)
    check_bf16_grads(problem, kind, device)
