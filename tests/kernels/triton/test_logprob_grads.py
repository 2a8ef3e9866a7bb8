"""The fused logit gradient of the chunked lm_head + log-prob backward (triton/logprob_grads.py) against its
torch composition in kernels_batch_invariant/lm_head_logprobs.py, and the whole backward with it against
float64 autograd. Runs on CUDA, or on CPU under TRITON_INTERPRET=1.

Tolerances. ``softmax_grad`` and the torch composition evaluate the same fp32 formula per element (-g p, plus g
at the token, times 1/T); they differ in the softmax: its max is exact on both sides, but its row sum is taken
in another order, its exp is another implementation, and the GPU fuses z / T - max into one FMA (see
``_fp32_bound``). The bf16 output adds one rounding per side (see ``_bf16_bound``). The end-to-end check
bounds each gradient element by the rounding of its GEMM's sums and of its bf16 operands (``_gemm_bound``).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_lm_head_logprobs import R, SEGMENTS, V, _inputs  # noqa: E402
from zmrl.kernels_batch_invariant import lm_head_logprobs as L  # noqa: E402
from zmrl.kernels_batch_invariant import current_numerics, numerics_scope  # noqa: E402
from zmrl.kernels_batch_invariant.triton._common import MAX_ROW_BLOCK  # noqa: E402
from zmrl.kernels_batch_invariant.triton.logprob_grads import softmax_grad  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

U = 2.0 ** -24  # fp32 unit roundoff
ROWS = 5
# V = 1 (a one-column row: p = 1), ragged within one block, and one block plus a ragged tail
VOCABS = [1, 37, MAX_ROW_BLOCK + 5]


def _problem(vocab: int, scaled: bool, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # padded rows, as ``linear`` writes the logits (row stride > V)
    z = (torch.randn(ROWS, vocab + 11, generator=gen) * 4).to(device)[:, :vocab]
    tok = torch.randint(0, vocab, (ROWS,), generator=gen).to(device)
    g = torch.randn(ROWS, generator=gen).to(device)
    inv_t = (1.0 / (0.4 + torch.rand(ROWS, generator=gen))).to(device) if scaled else None
    return z, tok, g, inv_t


def _assert_within(err, bound, what):
    assert bool((err <= bound).all()), f"{what}: max err / bound {float((err / bound).max()):.3f}"


def _fp32_bound(z, g, inv_t, want):
    """Each exp's argument x = z / T - max may be off by |z / T| + |x| ulps: the GPU fuses the product and the
    subtraction into one FMA (the product's rounding skipped) and evaluates exp as exp2(x log2 e) (the rounding
    of x log2 e: |x| ulps of the result), plus a couple of ulps of exp itself. Call a = |z / T| + |x|. Then
    p = exp(x) / sum differs by (a + 2) ulps in its numerator and by at most the row's largest a plus the sum's
    rounding in its denominator (each lane adds V / BLOCK terms, a fixed tree merges the lanes; torch sums in
    another blocked order: V / BLOCK + log2 BLOCK ulps), so by (a + max_row a + 32) ulps relative. dz differs by
    g / T times that (absolute: at the token, g - g p cancels, but the error is still that of g p), plus the
    roundings of the token's add and of the scale (2 ulps of |dz| per side)."""
    s = 1.0 if inv_t is None else inv_t.double()[:, None]
    scaled = z.double() * s
    x = scaled - scaled.max(-1, keepdim=True).values
    a = scaled.abs() + x.abs()
    rel = (a + a.max(-1, keepdim=True).values + 32) * U
    return rel * (g.double()[:, None] * s).abs() * torch.softmax(x, -1) + 4 * U * want.double().abs()


def _bf16_bound(z, g, inv_t, want):
    """Each side rounds its fp32 dz to bf16 once: to nearest (2^-8 relative) in torch and on the GPU; the
    interpreter truncates (up to one bf16 ulp, 2^-7 relative). So 2^-7 + 2^-8 of |dz| beyond the fp32
    difference."""
    return _fp32_bound(z, g, inv_t, want) + (2.0 ** -7 + 2.0 ** -8) * want.double().abs()


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("scaled", [False, True], ids=["no_temperature", "temperature"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softmax_grad_matches_torch(device, vocab, scaled, out_dtype):
    z, tok, g, inv_t = _problem(vocab, scaled, device, seed=vocab)
    z_before = z.clone()
    got = softmax_grad(z, tok, g, inv_t, out_dtype)
    want = L._softmax_grad_torch(z.clone(), tok, g, inv_t, out_dtype)
    assert got.dtype == out_dtype and got.shape == (ROWS, vocab)
    assert torch.equal(z, z_before), "the kernel leaves the logits alone"
    bound = (_fp32_bound if out_dtype == torch.float32 else _bf16_bound)(z, g, inv_t, want)
    _assert_within((got.double() - want.double()).abs(), bound, "dz")


@pytest.mark.parametrize("vocab", [37, MAX_ROW_BLOCK + 5])
def test_token_at_first_and_last_column(device, vocab):
    """Column 0 opens the first block, column V - 1 is in the ragged tail of the last one."""
    z, _, g, inv_t = _problem(vocab, True, device, seed=1)
    tok = torch.tensor([0, vocab - 1, 0, vocab - 1, 0], device=device)
    g = g.abs() + 0.5  # g > 0: the token's entry is the row's only positive one
    got = softmax_grad(z, tok, g, inv_t, torch.float32)
    want = L._softmax_grad_torch(z.clone(), tok, g, inv_t, torch.float32)
    _assert_within((got.double() - want.double()).abs(), _fp32_bound(z, g, inv_t, want), "dz")
    rows = torch.arange(ROWS, device=device)
    assert bool((got[rows, tok] > 0).all())
    others = got.clone()
    others[rows, tok] = 0
    assert bool((others <= 0).all())
    # sum over the row of (onehot - p) is 0: the positive entry balances the others, to fp32 sums of V terms
    assert bool((got.double().sum(-1).abs() <= 4 * vocab * U * got.double().abs().sum(-1)).all())


def _reference(h, w, b, ids, segments):
    """float64 autograd of the same math; its logit gradient dz (for the error bounds) and dz's one-hot term
    alone (a wrong gradient that the bounds must reject)."""
    leaves = [x.double().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    g_out = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(5)).to(h.device)
    L.lm_head_token_logprobs_ref(*leaves, ids, segments).backward(g_out.double())
    with torch.no_grad():
        z = leaves[0] @ leaves[1].t() + (0 if b is None else leaves[2])
        temps = torch.tensor([t if t > 0 else 1.0 for n, t in segments for _ in range(n)], dtype=torch.float64,
                             device=h.device)
        onehot = torch.nn.functional.one_hot(ids, w.shape[0]).double()
        scale = (g_out.double() / temps)[:, None]
        dz = (onehot - torch.softmax(z / temps[:, None], -1)) * scale
    return g_out, [None if x is None else x.grad for x in leaves], dz, onehot * scale


def _gemm_bound(dz, other, n, dtype):
    """A length-n fp32 sum: <= 4 n u of the sum of |terms| (fp32 logits and dz add a few u per term, in the
    same sum). With bf16 parameters on CUDA, three roundings to bf16 (2^-8 relative each) come on top: of dz
    (the GEMM operand), of the GEMM's bf16 output, of the gradient to the parameter's dtype; 2^-6 covers them.
    The inputs are bf16-valued in the reference too."""
    rel = 4 * n * U + (2.0 ** -6 if dtype == torch.bfloat16 else 0.0)
    return rel * (dz.abs() @ other.abs()) + 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_backward_with_the_kernel_matches_float64(device, interpret, dtype, bias):
    """The lm_head backward through the kernel (bf16 dz on CUDA for bf16 weights; fp32 dz with a bias, which
    is summed from it), with greedy, unit and scaled temperature segments, against float64 autograd."""
    if interpret and dtype == torch.bfloat16:
        pytest.skip("the interpreter computes bf16 dots wrongly (and CPU gradients are fp32 anyway)")
    assert L._softmax_grad(torch.empty(0, device=device)) is softmax_grad  # the kernel runs here
    h, w, b, ids = (x.to(device) if x is not None else None for x in _inputs(dtype, seed=1, bias=bias))
    g_out, ref_grads, dz, token_term = _reference(h, w, b, ids, SEGMENTS)
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    # full-precision fp32 GEMMs: TF32 would round the operands to 2^-11, beyond the fp32 bound
    with numerics_scope(current_numerics().replace(backward_matmul_precision="ieee")):
        L.lm_head_token_logprobs(*leaves, ids, SEGMENTS, 13).backward(g_out)
    dh, dw = leaves[0].grad.double(), leaves[1].grad.double()
    _assert_within((dh - ref_grads[0]).abs(), _gemm_bound(dz, w.double(), V, dtype), "d hidden")
    _assert_within((dw - ref_grads[1]).abs(), _gemm_bound(dz.t(), h.double(), R, dtype), "d weight")
    if bias:  # an fp32 sum of fp32 dz, then (bf16) one rounding to the bias's dtype
        rel = 4 * R * U + (2.0 ** -8 if dtype == torch.bfloat16 else 0.0)
        _assert_within((leaves[2].grad.double() - ref_grads[2]).abs(), rel * dz.abs().sum(0) + 1e-12, "d bias")
    # the bound is not vacuous: a gradient without the softmax term breaks it
    wrong = token_term @ w.double()
    assert not bool(((wrong - ref_grads[0]).abs() <= _gemm_bound(dz, w.double(), V, dtype)).all())


def test_backward_deterministic(device):
    """bf16 parameters: on CUDA the kernel then writes bf16 dz."""
    h, w, _, ids = (x.to(device) if x is not None else None for x in _inputs(torch.bfloat16, seed=4, bias=False))
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(True) for x in (h, w)]
        L.lm_head_token_logprobs(*leaves, None, ids, SEGMENTS, 16).sum().backward()
        grads.append([x.grad for x in leaves])
    for first, second in zip(*grads):
        assert torch.equal(first, second)
    z, tok, g, inv_t = _problem(MAX_ROW_BLOCK + 5, True, device)
    assert torch.equal(softmax_grad(z, tok, g, inv_t, torch.bfloat16), softmax_grad(z, tok, g, inv_t, torch.bfloat16))
