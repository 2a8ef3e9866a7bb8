"""zmrl.model.layers.project: several projections of one input (with or without LoRA adapters) in few GEMM
launches, bitwise ``[lin(x) for lin in linears]``, on the torch backend (CPU) and the Triton backend (CUDA,
or the interpreter with ``TRITON_INTERPRET=1``), with the same gradients up to the backward's rounding."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from zmrl.kernels_batch_invariant import InvariantOp, current_numerics, linear, numerics_scope
from zmrl.kernels_batch_invariant.matmul import resolve_delta
from zmrl.lora import LoraAdapter
from zmrl.model.layers import Linear, joined_columns, project
from tests.kernels.triton.gemm_launches import count_gemm_launches

K, NS, R, M = 40, (24, 8, 33), 8, 5


class _PlainAdapter(nn.Module):
    """An adapter with no A/B factors (called as ``adapter(x)``): a fixed projection, its delta in fp32 or
    (``out_dtype``) another dtype, which Linear.forward adds to the fp32 base in torch."""

    def __init__(self, k: int, n: int, g: torch.Generator, out_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, k, generator=g) * 0.1)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w, out_dtype=self.out_dtype)


def _linears(dtype: torch.dtype, adapters: str, device: torch.device, seed: int = 0) -> list[Linear]:
    """Three projections of one input; ``adapters`` says per projection: L = LoraAdapter (scale 3: not a
    power of two, so the scaling rounds), l = LoraAdapter of scale 0.5, P = _PlainAdapter, H = _PlainAdapter
    with a bf16 delta, - = none."""
    g = torch.Generator().manual_seed(seed)
    lins = []
    for n, kind in zip(NS, adapters):
        lin = Linear(K, n, dtype=dtype)
        lin.weight.data = (torch.randn(n, K, generator=g) / K**0.5).to(dtype)
        if kind in "Ll":
            lin.adapter = LoraAdapter(K, n, R, scale=3.0 if kind == "L" else 0.5)
            lin.adapter.lora_A.data = torch.randn(R, K, generator=g) * 0.3
            lin.adapter.lora_B.data = torch.randn(n, R, generator=g) * 0.3
        elif kind in "PH":
            lin.adapter = _PlainAdapter(K, n, g, torch.float32 if kind == "P" else torch.bfloat16)
        lins.append(lin.to(device))
    return lins


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern (torch.equal takes -0.0 == +0.0: a +0.0 delta on a -0.0 base would pass it)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch) -> tuple[torch.device, bool]:
    """(device, whether the Triton ops run): CPU for torch; CUDA for Triton, or the CPU with the Triton
    ops forced under the interpreter."""
    if request.param == "torch":
        return torch.device("cpu"), False
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda"), True
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend needs CUDA or TRITON_INTERPRET=1")
    real = InvariantOp.backend_for
    monkeypatch.setattr(InvariantOp, "backend_for",
                        lambda self, device: "triton" if "triton" in self.impls else real(self, device))
    return torch.device("cpu"), True


# adapters per projection -> Triton GEMM launches: A concat + base concat with every B product in its epilogue
# (+ the base of the projections without adapter; when scales differ, one B GEMM per adapter and the deltas
# added by the base concat; with a non-LoRA adapter, its GEMM and one blockdiag B GEMM for the LoRA ones)
CASES = {"LLL": 2, "L-L": 3, "--L": 3, "LlL": 5, "LPL": 4, "LHL": 4, "LH-": 5, "---": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adapters", list(CASES))
def test_project_is_bitwise_the_separate_linears(backend, dtype, adapters, monkeypatch):
    """Every output's bits (signed zeros included) equal the projection's own ``Linear.forward``: with
    LoRA adapters of one scale (the fused path), adapters mixed with projections without, adapters of
    different scales and a non-LoRA adapter (per-adapter B products), a non-fp32 delta (added in torch),
    no adapters; under Triton the launch count is the fused one."""
    device, triton_ops = backend
    lins = _linears(dtype, adapters, device, seed=len(adapters) + NS[0])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    with torch.no_grad():
        want = [lin(x) for lin in lins]
        launches = count_gemm_launches(monkeypatch) if triton_ops else None
        got = project(x, lins)
    for y, w in zip(got, want):
        assert y.dtype == w.dtype == dtype and y.shape == w.shape
        assert torch.equal(_bits(y), _bits(w)), adapters
    if launches is not None:
        assert len(launches) == CASES[adapters], launches


def test_project_keeps_negative_zero_of_projections_without_adapter(monkeypatch):
    """Were a base GEMM's fp32 result -0.0, a projection without adapter still gets it (a +0.0 delta would
    make it +0.0: project() gives those projections no delta). The invariant GEMMs start their accumulators
    at +0.0, so the -0.0 is injected into the torch ``linear`` before its delta and rounding."""
    real = linear.impls["torch"]

    def negative_zero_base(x, weight, bias=None, out_dtype=None, delta=None, lora=None):
        delta = resolve_delta(delta, lora, "linear")
        y = real(x, weight, bias, out_dtype=torch.float32)
        y = torch.where(y.abs() < 0.2, torch.full_like(y, -0.0), y)
        return (y if delta is None else y + delta).to(out_dtype or x.dtype)

    monkeypatch.setitem(linear.impls, "torch", negative_zero_base)
    for dtype in (torch.float32, torch.bfloat16):
        lins = _linears(dtype, "-L-", torch.device("cpu"))
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(2)).to(dtype)
        with torch.no_grad():
            want = [lin(x) for lin in lins]
            got = project(x, lins)
        assert all((torch.signbit(w) & (w == 0)).any() for w in (want[0], want[2])), "the injection took"
        for y, w in zip(got, want):
            assert torch.equal(_bits(y), _bits(w))


@pytest.mark.parametrize("adapters", ["LLL", "L-L", "LlL"])
def test_project_gradients(backend, adapters):
    """The trainer differentiates through project(): the gradients of x and of every LoRA factor equal those
    of the separate linears up to the backward's rounding (the same products summed in other groupings:
    fp32 GEMMs of <= 40 terms plus sums of 3 adapters' dX, a few ulps of the largest value, 1e-5 relative),
    and match float64 within the same bound."""
    device, _ = backend
    lins = _linears(torch.float32, adapters, device, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, K, generator=g).to(device).requires_grad_()
    gys = [torch.randn(M, n, generator=g).to(device) for n in NS]
    params = [x, *(p for lin in lins if lin.adapter is not None for p in (lin.adapter.lora_A, lin.adapter.lora_B))]

    def loss(ys):
        return sum((y * gy).sum() for y, gy in zip(ys, gys))

    # IEEE fp32 backward GEMMs (on CUDA the trainer's default is TF32, whose bound is not this one)
    with numerics_scope(current_numerics().replace(backward_matmul_precision="ieee")):
        got = torch.autograd.grad(loss(project(x, lins)), params)
        want = torch.autograd.grad(loss([lin(x) for lin in lins]), params)
    # float64: y_i = x W_i^T + s_i (x A_i^T) B_i^T
    pd = [p.detach().double().requires_grad_() for p in params]
    xd, factors = pd[0], iter(pd[1:])
    ys = []
    for lin in lins:
        y = xd @ lin.weight.detach().double().t()
        if lin.adapter is not None:
            a, b = next(factors), next(factors)
            y = y + lin.adapter.scale * (xd @ a.t()) @ b.t()
        ys.append(y)
    ref = torch.autograd.grad(sum((y * gy.double()).sum() for y, gy in zip(ys, gys)), pd)
    for a, b, r in zip(got, want, ref):
        scale = r.abs().max()
        assert (a - b).abs().max() <= 1e-5 * scale
        assert (a.double() - r).abs().max() <= 1e-5 * scale


def test_joined_columns_keeps_the_parts_gradients(backend):
    """``joined_columns`` of project()'s outputs (how the KDA layer joins q|k|v for its conv): with no gradient
    wanted, a column slice of the fused output (no copy); under autograd, exactly the gradients of
    ``torch.cat`` of the parts. The Triton backend's autograd Function returns a view of its own output buffer,
    whose ``_base`` autograd does not track: a slice of that base cut every part's gradient (found on the
    model: the KDA q/k/v LoRA gradients were zero)."""
    device, _ = backend
    lins = _linears(torch.float32, "LLL", device, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(M, K, generator=g).to(device).requires_grad_()
    gy = torch.randn(M, sum(NS[:2]), generator=g).to(device)
    params = [x, *(p for lin in lins for p in (lin.adapter.lora_A, lin.adapter.lora_B))]

    with torch.no_grad():
        parts = project(x, lins)
        joined = joined_columns(parts[:2])
    assert joined.data_ptr() == parts[0].data_ptr() and torch.equal(joined, torch.cat(parts[:2], dim=-1))

    grads = [torch.autograd.grad((join(project(x, lins)[:2]) * gy).sum(), params, allow_unused=True)
             for join in (joined_columns, lambda ps: torch.cat(ps, dim=-1))]
    for got, want in zip(*grads):
        assert want is None or (got is not None and torch.equal(got, want))
    assert all(grads[0][i] is not None for i in range(5))  # x and both A/B pairs of the joined parts
