"""Triton ``expert_gate_up`` (triton/expert_gate_up.py): its forward is bitwise the composition of Triton
``expert_linear`` calls it replaces, with and without autograd; its gradients (x's from one kernel over the gate,
up and LoRA A products, the factors', the expert weights') match float64; they are bitwise equal run to run; and
``expert_input_grad`` with one term is the single-product kernel.

Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tiny shapes).

Tolerance of x's gradient, elementwise: |got - float64| <= rel * S + 1e-30 with S the sum over the four products of
|gy| @ |W| (float64, the element's absolute products), rel = 2^-8 (the one rounding to bf16) + 2^-8 (the LoRA
terms: dt is itself a product, scaled; on CUDA its fp32 operands and A's go through TF32, < 2 x 2^-10 each, so
the dt term carries < 2^-8 relative) + 2 L u (fp32 accumulation over L = 2N + 2r products). A term taken from the
wrong expert or dropped errs by O(S); the bound is checked to be below |float64| for most elements. The factors'
gradients are those of the unfused products (tests/kernels/triton/test_expert_grads.py bounds them); here they
are held to the same form with L their row counts.
"""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from zmrl.kernels_batch_invariant.moe_gemm import ExpertLoraFactors, RowGather, expert_gate_up  # noqa: E402
from zmrl.kernels_batch_invariant.triton import triton_impl  # noqa: E402
from zmrl.kernels_batch_invariant.moe_gemm import expert_linear  # noqa: E402
from zmrl.kernels_batch_invariant.matmul import LoraUp  # noqa: E402
from zmrl.kernels_batch_invariant.triton.expert_grads import (  # noqa: E402
    DxTerm, expert_input_grad, expert_linear_grads_triton)

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

U = 2.0 ** -24
K, N, R = 40, 24, 8  # hidden, expert intermediate, LoRA rank: no multiple of a tile
COUNTS = [3, 0, 21, 5, 1]  # 30 rows: 15 tokens x TOP_K with a gather
TOP_K = 2
SCALE = 2.0


def _offsets(counts):
    return [0, *itertools.accumulate(counts)]


def _case(device, stacked, lora, seed=0, gather=False):
    """x, gate/up weights (bf16, frozen under LoRA), LoRA factors (fp32, trainable) on ``lora``'s projections, the
    rows' gather (None, or the MoE's kind: M rows = T tokens x TOP_K, in a random order, with their slots)."""
    g = torch.Generator().manual_seed(seed)
    e, m = len(COUNTS), sum(COUNTS)
    rows = None
    if gather:
        order = torch.randperm(m, generator=g)
        slots = torch.empty_like(order)
        slots[order] = torch.arange(m)
        rows = RowGather(order.to(device), TOP_K, slots.view(m // TOP_K, TOP_K).to(device))
    x = torch.randn(m // TOP_K if gather else m, K, generator=g).to(device, torch.bfloat16).requires_grad_()
    train_w = not lora
    ws = []
    for _ in range(2):
        w = (torch.randn(e, N, K, generator=g) / K ** 0.5).to(device, torch.bfloat16)
        w = w.requires_grad_(train_w) if stacked else [v.clone().requires_grad_(train_w) for v in w.unbind(0)]
        ws.append(w)
    factors = {}
    for proj in ("gate", "up"):
        a = (torch.randn(e, R, K, generator=g) / K ** 0.5).to(device).requires_grad_()
        b = (torch.randn(e, N, R, generator=g) / R ** 0.5).to(device).requires_grad_()
        factors[proj] = ExpertLoraFactors(a, b, SCALE) if proj in lora else None
    grads = [torch.randn(m, N, generator=g).to(device, torch.bfloat16) for _ in range(2)]
    return x, ws, factors, grads, rows


def _leaves(x, ws, factors):
    out = [x]
    for w in ws:
        out += [w] if isinstance(w, torch.Tensor) else list(w)
    for f in factors.values():
        if f is not None:
            out += [f.a, f.b]
    return [t for t in out if t.requires_grad]


def _composition(x, ws, factors, off, rows=None):
    """The unfused calls the op is defined as, through Triton ``expert_linear`` (on the gathered rows)."""
    lin = triton_impl(expert_linear)
    if rows is not None:
        x = x[rows.index // rows.div]

    def product(w, f):
        up = None if f is None else LoraUp(lin(x, f.a, off, out_dtype=torch.float32), f.b, f.scale)
        return lin(x, w, off, lora=up)
    return product(ws[0], factors["gate"]), product(ws[1], factors["up"])


def _run(x, ws, factors, grads, off, rows=None):
    outs = triton_impl(expert_gate_up)(x, ws[0], ws[1], off, factors["gate"], factors["up"], gather=rows)
    leaves = _leaves(x, ws, factors)
    return outs, torch.autograd.grad(outs, leaves, grads, allow_unused=True)  # (experts without rows: None)


def _float64_grads(x, ws, factors, grads, off, rows=None):
    """Gradients and the S = sum |gy| @ |W| of x's elements, from the torch backend in float64 (a gather by plain
    indexing: autograd's own backward)."""
    d = lambda t: t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    x64 = d(x)
    ws64 = [d(w) if isinstance(w, torch.Tensor) else [d(v) for v in w] for w in ws]
    f64 = {p: None if f is None else ExpertLoraFactors(d(f.a), d(f.b), f.scale) for p, f in factors.items()}
    plain = None if rows is None else RowGather(rows.index, rows.div)
    outs = expert_gate_up.impls["torch"](x64, ws64[0], ws64[1], off, f64["gate"], f64["up"], gather=plain)
    g64 = [g.double() for g in grads]
    ref = torch.autograd.grad(outs, _leaves(x64, ws64, f64), g64, allow_unused=True)
    s = torch.zeros(off[-1], x.shape[1], dtype=torch.float64, device=x.device)
    for e, (a, b) in enumerate(zip(off, off[1:])):
        for g, w, f in zip(g64, ws64, (f64["gate"], f64["up"])):
            we = (w[e] if isinstance(w, torch.Tensor) else w[e]).detach()
            s[a:b] += g[a:b].abs() @ we.abs()
            if f is not None:
                dt = f.scale * g[a:b] @ f.b[e].detach()
                s[a:b] += dt.abs() @ f.a[e].detach().abs()
    if rows is not None:  # a source row's S: that of its copies
        s = torch.zeros_like(x64, requires_grad=False).index_add_(0, rows.index // rows.div, s)
    return ref, s


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("lora", [("gate", "up"), ("up",), ()])
@pytest.mark.parametrize("tensor_offsets", [False, True])
@pytest.mark.parametrize("gather", [False, True])
def test_forward_bitwise_and_gradients(device, stacked, lora, tensor_offsets, gather):
    x, ws, factors, grads, rows = _case(device, stacked, lora, gather=gather)
    off = _offsets(COUNTS)
    off_arg = torch.tensor(off, device=device) if tensor_offsets else off
    (gate, up), got = _run(x, ws, factors, grads, off_arg, rows)
    ref_gate, ref_up = _composition(x, ws, factors, off, rows)
    assert torch.equal(gate, ref_gate) and torch.equal(up, ref_up), "the forward is not the composition's bits"
    with torch.no_grad():
        ng, nu = triton_impl(expert_gate_up)(x, ws[0], ws[1], off_arg, factors["gate"], factors["up"], gather=rows)
    assert torch.equal(ng, gate) and torch.equal(nu, up)

    # the factors' and weights' gradients are the unfused products' (same kernels, same operands): same bits
    unfused = torch.autograd.grad((ref_gate, ref_up), _leaves(x, ws, factors), grads, allow_unused=True)
    for g, u in zip(got[1:], unfused[1:]):
        assert (g is None and u is None) or torch.equal(g, u)

    ref, s = _float64_grads(x, ws, factors, grads, off, rows)
    assert len(got) == len(ref)
    # (a gather: each copy's gradient rounded to bf16, then their fp32 sum rounded once more: 2^-8 more)
    rel = (3 if gather else 2) * 2.0 ** -8 + 2 * (2 * N + 2 * R) * U
    err = (got[0].double() - ref[0]).abs()
    assert got[0].dtype == torch.bfloat16 and bool((err <= rel * s + 1e-30).all()), float((err - rel * s).max())
    assert float((ref[0].abs() > rel * s).float().mean()) > 0.8, "the dx bound is vacuous"
    for g, r in zip(got[1:], ref[1:]):
        if r is None:  # an expert without rows, as autograd gives it
            assert g is None
            continue
        # factor / weight gradients: bf16 or fp32 results of dots over an expert's rows (<= 21) and TF32 operands
        tol = (2.0 ** -8 if g.dtype == torch.bfloat16 else 2 * 2.0 ** -9) * r.abs().max() + 1e-6
        assert g.shape == r.shape and float((g.double() - r).abs().max()) <= float(tol)


def test_deterministic(device):
    x, ws, factors, grads, rows = _case(device, False, ("gate", "up"), seed=3, gather=True)
    off = _offsets(COUNTS)
    a = _run(x, ws, factors, grads, off, rows)[1]
    b = _run(x, ws, factors, grads, off, rows)[1]
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_one_term_is_the_single_product_kernel(device):
    g = torch.Generator().manual_seed(4)
    off = _offsets(COUNTS)
    gy = torch.randn(off[-1], N, generator=g).to(device, torch.bfloat16)
    w = [torch.randn(N, K, generator=g).to(device, torch.bfloat16) for _ in COUNTS]
    one = expert_input_grad(DxTerm(gy, w, torch.bfloat16), off, torch.bfloat16)
    ref, _ = expert_linear_grads_triton(gy, None, w, off, True, [False] * len(w), torch.bfloat16)
    assert torch.equal(one, ref)


def test_second_term_needs_stacked_weights(device):
    off = _offsets(COUNTS)
    gy = torch.zeros(off[-1], N, device=device, dtype=torch.bfloat16)
    w = [torch.zeros(N, K, device=device, dtype=torch.bfloat16) for _ in COUNTS]
    with pytest.raises(ValueError, match="stacked weights"):
        expert_input_grad(DxTerm(gy, w, torch.bfloat16), off, torch.bfloat16, DxTerm(gy, w, torch.bfloat16))


@pytest.mark.parametrize("with_lora", [True, False])
def test_moe_training_gather_path_equals_dispatched_copy(device, monkeypatch, with_lora):
    """The MoE layer's training path on the GPU (device dispatch: the gate/up products read the token rows through
    the gather, the down product recomputed for the combine's backward) against the dispatched-copy path (rows
    copied, the down output kept): the same output and every gradient bitwise (the same kernels on the same
    values; only where the rows are read and what is kept differ). Forced on CPU tensors under the interpreter."""
    from zmrl.kernels_batch_invariant.triton import triton_everywhere
    from zmrl.lora import LoraConfig, apply_lora
    from zmrl.model import ModelConfig, build_model
    from zmrl.model.moe import MoE

    model = build_model(ModelConfig.preset("tiny"), seed=0, dtype="bfloat16").to(device)
    if with_lora:
        apply_lora(model, LoraConfig(r=4, alpha=8.0, init_b_std=0.05, init_seed=3))
    else:
        model.requires_grad_(True)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    params = [p for p in moe.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(13, moe.gate.weight.shape[1], generator=g).to(device, torch.bfloat16)
    w = torch.randn(13, x0.shape[1], generator=g).to(device)
    runs = []
    for gathered in (True, False):
        x = x0.clone().requires_grad_(True)
        with monkeypatch.context() as mp, triton_everywhere():
            mp.setattr(MoE, "_device_dispatch", lambda self, x, d=gathered: d)
            y = moe(x)
            grads = torch.autograd.grad((y.float() * w).sum(), [x, *params], allow_unused=True)
        runs.append((y, grads))
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert runs[0][1][0] is not None and runs[0][1][0].abs().sum() > 0
