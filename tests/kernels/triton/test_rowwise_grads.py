"""Triton closed-form backwards (zmrl/kernels_batch_invariant/triton/rowwise_grads.py) against autograd of the
float64 references and against the torch closed forms (grads.py) they replace.

Tolerances: both sides compute the same formulas in fp32 with different association (one Triton pass vs
torch's kernels); each gradient element is a handful of fp32 operations plus, for the norms, two row
reductions over <= 2048 elements: a few fp32 roundings (~1e-7 relative) plus a reduction's ~sqrt(D) of them.
2e-5 of each gradient's scale (its max |value|) leaves margin, while any wrong term or a missed window tap is
O(1). bf16 inputs are checked
against float64 of the same (bf16-valued) inputs at 1e-2: the gradient is rounded once to bf16 (2^-8).
"""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from zmrl.kernels_batch_invariant import grads as G  # noqa: E402
from zmrl.kernels_batch_invariant.glu import swiglu  # noqa: E402
from zmrl.kernels_batch_invariant.kda_gate import kda_gate  # noqa: E402
from zmrl.kernels_batch_invariant.l2norm import l2_norm  # noqa: E402
from zmrl.kernels_batch_invariant.norms import rms_norm, rms_norm_gated  # noqa: E402
from zmrl.kernels_batch_invariant.short_conv import causal_short_conv  # noqa: E402
from zmrl.kernels_batch_invariant.triton import rowwise_grads as R  # noqa: E402
from zmrl.kernels_batch_invariant.triton import triton_impl  # noqa: E402

from .rowwise_helpers import randn  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

RTOL = 2e-5


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=device)


def cases(device, interpret: bool):
    """(name, op, torch closed form, Triton closed form, kwargs): every tensor kwarg gets a gradient."""
    t = 21 if interpret else 1000  # ragged: not a multiple of any tile
    d = 24 if interpret else 2048
    c = 40 if interpret else 3 * 2048
    lens = [5, 1, 0, 13, 2] if interpret else [5, 1, 0, 700, 2, 292]
    tc = sum(lens)
    yield "rms_norm", rms_norm, G.rms_norm_grads, R.rms_norm_grads, dict(
        x=randn(t, d, device=device, seed=1), weight=randn(d, device=device, seed=2, scale=0.5) + 1, eps=1e-5)
    yield "rms_norm_no_w", rms_norm, G.rms_norm_grads, R.rms_norm_grads, dict(
        x=randn(3, 7, 40, device=device, seed=3), weight=None, eps=1e-6)
    yield "rms_norm_gated", rms_norm_gated, G.rms_norm_gated_grads, R.rms_norm_gated_grads, dict(
        x=randn(t, 3, 16, device=device, seed=4), gate=randn(t, 3, 16, device=device, seed=5),
        weight=randn(16, device=device, seed=6) + 1, eps=1e-5)
    yield "l2_norm", l2_norm, G.l2_norm_grads, R.l2_norm_grads, dict(x=randn(t, 3, 16, device=device, seed=7), eps=1e-6)
    yield "swiglu", swiglu, G.swiglu_grads, R.swiglu_grads, dict(
        gate=randn(t, d, device=device, seed=8, scale=3.0), up=randn(t, d, device=device, seed=9))
    for lb in (None, -5.0):
        yield f"kda_gate_lb{lb}", kda_gate, G.kda_gate_grads, R.kda_gate_grads, dict(
            z=randn(t, 3 * 8, device=device, seed=10), A_log=randn(3, device=device, seed=11, scale=0.5),
            dt_bias=randn(3 * 8, device=device, seed=12), num_heads=3, lower_bound=lb)
    for act in ("silu", None):
        for with_state in (False, True):
            yield f"short_conv_{act}_state{with_state}", causal_short_conv, G.causal_short_conv_grads, \
                R.causal_short_conv_grads, dict(
                    x=randn(tc, c, device=device, seed=13), weight=randn(c, 1, 4, device=device, seed=14, scale=0.5),
                    cu_seqlens=_cu(lens, device),
                    conv_state=randn(len(lens), 3, c, device=device, seed=15) if with_state else None,
                    activation=act)


def _scale_close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    assert got.shape == want.shape, what
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item() or 1.0
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _call(grads_fn, out_grads, needs, kwargs):
    return grads_fn(out_grads, needs, dict(kwargs))


def _full_kwargs(op, kwargs):
    """The op's arguments by name, defaults filled (what with_analytic_backward hands a grads function)."""
    bound = inspect.signature(op.impls["torch"]).bind(**kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _gradient_inputs(kwargs, params: bool):
    """Names that get a gradient: activations always, the op's parameters only when ``params``."""
    param_names = {"weight", "A_log", "dt_bias", "conv_state"}
    return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
            and (params or k not in param_names)]


@pytest.mark.parametrize("params", [False, True], ids=["activations", "with_params"])
def test_matches_torch_closed_form_and_float64(device, interpret, params) -> None:
    for name, op, torch_fn, triton_fn, kwargs in cases(device, interpret):
        full = _full_kwargs(op, kwargs)
        ref = op.impls["torch"]
        out = ref(**full)
        outs = out if isinstance(out, tuple) else (out,)
        g = torch.Generator().manual_seed(0)
        out_grads = tuple(torch.randn(o.shape, generator=g).to(device) if o.is_floating_point() else None
                          for o in outs)
        if name.startswith("short_conv"):
            out_grads = (out_grads[0], None)  # the trainer discards the new state
        wanted = _gradient_inputs(full, params)
        needs = {k: k in wanted for k in full}
        got = _call(triton_fn, out_grads, needs, full)
        want = _call(torch_fn, out_grads, needs, full)
        # float64 autograd of the torch composition
        leaves = {k: (v.detach().double().requires_grad_(k in wanted) if isinstance(v, torch.Tensor)
                      and v.is_floating_point() else v) for k, v in full.items()}
        o64 = ref(**leaves)
        o64 = o64 if isinstance(o64, tuple) else (o64,)
        pairs = [(o, gr.double()) for o, gr in zip(o64, out_grads) if gr is not None]
        g64 = torch.autograd.grad([o for o, _ in pairs], [leaves[k] for k in wanted], [gr for _, gr in pairs])
        for k, gk in zip(wanted, g64):
            assert got[k] is not None, f"{name}: no gradient for {k}"
            assert got[k].dtype == full[k].dtype, f"{name}: {k} gradient dtype {got[k].dtype}"
            _scale_close(got[k], gk, RTOL, f"{name} d{k} vs float64")
            _scale_close(got[k], want[k], RTOL, f"{name} d{k} vs the torch closed form")
        for k in full:
            if not needs[k] and k in got:
                assert got[k] is None, f"{name}: gradient for {k} that was not asked for"


def test_deterministic(device, interpret) -> None:
    """The same backward twice gives the same bits (no atomics; parameter partials summed in a fixed order)."""
    for name, op, _, triton_fn, kwargs in cases(device, interpret):
        full = _full_kwargs(op, kwargs)
        out = op.impls["torch"](**full)
        outs = out if isinstance(out, tuple) else (out,)
        g = torch.Generator().manual_seed(1)
        out_grads = tuple(torch.randn(o.shape, generator=g).to(device) for o in outs)
        if name.startswith("short_conv"):
            out_grads = (out_grads[0], None)
        wanted = _gradient_inputs(full, params=True)
        needs = {k: k in wanted for k in full}
        a = _call(triton_fn, out_grads, needs, full)
        b = _call(triton_fn, out_grads, needs, full)
        for k in wanted:
            if a[k] is not None:
                assert torch.equal(a[k], b[k]), f"{name}: d{k} differs between two identical backwards"


def test_bf16_through_the_op(device, interpret) -> None:
    """The Triton forwards' autograd uses these backwards: bf16 activations, gradients in bf16, close to
    float64 of the same bf16 values (one bf16 rounding of each gradient)."""
    c = 40 if interpret else 3 * 2048
    lens = [5, 1, 9] if interpret else [300, 1, 723]
    x = randn(sum(lens), c, device=device, seed=20, dtype=torch.bfloat16)
    w = randn(c, 4, device=device, seed=21, scale=0.5)
    cu = _cu(lens, device)
    gy = randn(sum(lens), c, device=device, seed=22)
    conv = triton_impl(causal_short_conv)
    xl = x.clone().requires_grad_(True)
    y, _ = conv(xl, w, cu, None, "silu")
    y.backward(gy.to(y.dtype))
    x64 = x.double().requires_grad_(True)
    y64, _ = causal_short_conv.impls["torch"](x64, w.double(), cu, None, "silu")
    y64.backward(gy.to(torch.bfloat16).double())
    assert xl.grad.dtype == torch.bfloat16
    _scale_close(xl.grad, x64.grad, 1e-2, "short conv bf16 dx")

    d = 24 if interpret else 2048
    xr = randn(7, d, device=device, seed=23, dtype=torch.bfloat16).requires_grad_(True)
    wr = randn(d, device=device, seed=24) + 1
    yr = triton_impl(rms_norm)(xr, wr, 1e-5)
    gr = randn(7, d, device=device, seed=25).to(torch.bfloat16)
    yr.backward(gr)
    x64 = xr.detach().double().requires_grad_(True)
    rms_norm.impls["torch"](x64, wr.double(), 1e-5).backward(gr.double())
    _scale_close(xr.grad, x64.grad, 1e-2, "rms_norm bf16 dx")


def test_fallbacks_take_the_torch_closed_form(device) -> None:
    """What the kernels do not cover gives the torch closed form's result: a conv-state gradient, a
    gradient flowing into the new state, KDA-gate parameter gradients, rows wider than a row block."""
    lens = [3, 4]
    x = randn(7, 8, device=device, seed=30)
    kw = dict(x=x, weight=randn(8, 4, device=device, seed=31), cu_seqlens=_cu(lens, device),
              conv_state=randn(2, 3, 8, device=device, seed=32), activation="silu")
    needs = {k: k in ("x", "conv_state") for k in kw}
    gy = randn(7, 8, device=device, seed=33)
    for out_grads, nd in (((gy, None), needs), ((gy, randn(2, 3, 8, device=device, seed=34)), dict(needs, conv_state=False))):
        got = R.causal_short_conv_grads(out_grads, nd, kw)
        want = G.causal_short_conv_grads(out_grads, nd, kw)
        for k in ("x", "conv_state"):
            if want[k] is not None:
                assert torch.equal(got[k], want[k])
    wide = dict(x=randn(2, R.MAX_ROW_BLOCK + 8, device=device, seed=35), weight=None, eps=1e-6, out_dtype=None)
    g2 = (randn(2, R.MAX_ROW_BLOCK + 8, device=device, seed=36),)
    n2 = {"x": True, "weight": False, "eps": False, "out_dtype": False}
    assert torch.equal(R.rms_norm_grads(g2, n2, wide)["x"], G.rms_norm_grads(g2, n2, wide)["x"])


def test_norm_weight_partials_over_several_tiles_per_program(device, monkeypatch) -> None:
    """With few partial blocks allowed, each program walks several row tiles (the loop the 16K-token trainer
    takes only with a trainable norm weight): the same gradients as the torch closed form."""
    monkeypatch.setattr(R, "MAX_PARTIAL_BLOCKS", 2)
    # rows of 16 (256 per tile) and of 40 (64 per tile): 2 and 4 tiles over the 2 programs
    for xx, d in ((randn(37, 14, 16, device=device, seed=40), 16), (randn(250, 40, device=device, seed=41), 40)):
        w = randn(d, device=device, seed=42) + 1
        gy = randn(*xx.shape, device=device, seed=43)
        args = dict(x=xx, weight=w, eps=1e-5, out_dtype=None)
        needs = {"x": True, "weight": True, "eps": False, "out_dtype": False}
        got = R.rms_norm_grads((gy,), needs, args)
        want = G.rms_norm_grads((gy,), needs, args)
        _scale_close(got["weight"], want["weight"], RTOL, "dweight")
        _scale_close(got["x"], want["x"], RTOL, "dx")
        assert R._tiling(xx.numel() // d, d, partials=True)[2] > 1  # several tiles per program
