"""Triton token_logprobs / log_softmax: float64 reference, temperature semantics, NaN/Inf and id
errors (the torch op's), row invariance, gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.logprob import log_softmax, log_softmax_ref, token_logprobs, token_logprobs_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

TEMPS = [0.0, 1.0, 0.6, 1.7]
# |z| <= ~60 here. fp32: z / T one rounding (<= 4e-6 abs), exp/log a few ulp, lane sums of
# V / BLOCK <= 40 terms plus a 4096-lane tree (<= ~1e-5 relative in the sum, so <= 1e-5 in its log),
# and the final subtraction (u * |lse| <= 4e-6). atol 5e-5 leaves margin; a wrong temperature, a
# missing lane rescale or an off-by-one token is >= 1e-3 off.
ATOL = 5e-5


def _logits(t: int, v: int, device, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g) * 4 + torch.randn(t, 1, generator=g) * 10).to(dtype)
    tok = torch.randint(0, v, (t,), generator=g)
    tok[0] = int(logits[0].float().argmax())  # a most likely token (log p near 0)
    return logits.to(device), tok.to(device)


def _vocabs(interpret: bool) -> list[int]:
    # odd, one block, several blocks of 4096 with a ragged tail; on CUDA the bench vocab
    return [7, 2048, 9000] if interpret else [7, 2048, 9000, 50257, 163840]


@pytest.mark.parametrize("temp", TEMPS)
def test_logprobs_match_float64(device, interpret, temp) -> None:
    for v in _vocabs(interpret):
        for dtype in (torch.float32, torch.bfloat16):
            logits, tok = _logits(3 if interpret else 9, v, device, seed=v, dtype=dtype)
            got = triton_impl(token_logprobs)(logits, tok, temp)
            assert got.dtype == torch.float32 and got.shape == tok.shape
            torch.testing.assert_close(got.double(), token_logprobs_ref(logits, tok, temp), rtol=0, atol=ATOL)
            ls = triton_impl(log_softmax)(logits, temp)
            assert ls.dtype == torch.float32 and ls.shape == logits.shape
            torch.testing.assert_close(ls.double(), log_softmax_ref(logits, temp), rtol=0, atol=ATOL)
            # same z and lse: gathering the log-softmax gives the token log-probs bit for bit
            assert torch.equal(ls.gather(1, tok[:, None])[:, 0], got)


def test_temperature_semantics_and_leading_dims(device, interpret) -> None:
    logits, tok = _logits(4, 300, device, seed=1)
    f = triton_impl(token_logprobs)
    assert torch.equal(f(logits, tok, 0.0), f(logits, tok, 1.0))  # T = 0: raw logits
    # T is a true division of the fp32 logits by fp32(T) (a tensor divisor: no reciprocal shortcut)
    z = logits / torch.tensor(0.6, dtype=torch.float32, device=device)
    assert torch.equal(triton_impl(log_softmax)(logits, 0.6), triton_impl(log_softmax)(z, 1.0))
    assert f(logits, tok, 0.6)[0] > f(logits, tok, 1.0)[0]  # sharper at T < 1
    got3 = f(logits.view(2, 2, 300), tok.view(2, 2), 0.6)
    assert got3.shape == (2, 2) and torch.equal(got3.reshape(-1), f(logits, tok, 0.6))
    assert f(logits[:0], tok[:0]).shape == (0,)
    # a strided row view (the engine passes logits[:, :vocab_size] of a padded lm_head)
    wide, _ = _logits(4, 320, device, seed=2)
    wide[:, :300] = logits
    assert torch.equal(f(wide[:, :300], tok, 0.6), f(logits, tok, 0.6))
    assert torch.equal(triton_impl(log_softmax)(wide[:, :300], 0.6), triton_impl(log_softmax)(logits, 0.6))
    if device.type == "cuda":
        assert torch.equal(token_logprobs(logits, tok, 0.6), f(logits, tok, 0.6))  # dispatch


def test_errors_match_torch_op(device, interpret) -> None:
    logits, tok = _logits(4, 7, device, seed=3)
    f = triton_impl(token_logprobs)
    with pytest.raises(ValueError, match="token id 7 at position 1 is outside the vocabulary"):
        f(logits, torch.tensor([0, 7, 1, 2], device=device))
    with pytest.raises(ValueError, match="token id -1 "):
        f(logits, torch.tensor([0, 1, -1, 2], device=device))
    with pytest.raises(ValueError, match="must match logits"):
        f(logits, tok[:3])
    with pytest.raises(ValueError, match="integer tensor"):
        f(logits, tok.float())
    for bad_t in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be finite"):
            f(logits, tok, bad_t)
        with pytest.raises(ValueError, match="temperature must be finite"):
            triton_impl(log_softmax)(logits, bad_t)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = logits.clone()
        x[2, 5] = bad
        with pytest.raises(ValueError, match=r"logits row 2 contains NaN or Inf \(after dividing by temperature 0.6\)"):
            f(x, tok, 0.6)
        with pytest.raises(ValueError, match="logits row 2 contains NaN or Inf"):
            triton_impl(log_softmax)(x, 0.6)
    x = logits.clone().view(2, 2, 7)
    x[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"logits row \(1, 0\) contains"):
        f(x, tok.view(2, 2))
    # finite logits that overflow only after the division by a small temperature
    x = logits.clone()
    x[3, 0] = 3e38
    with pytest.raises(ValueError, match="logits row 3 contains NaN or Inf"):
        f(x, tok, 0.5)


def test_rows_invariant(device, interpret) -> None:
    v = 9000 if interpret else 163840
    n = 4 if interpret else 24
    logits, tok = _logits(n, v, device, seed=5, dtype=torch.bfloat16)
    sizes = batch_sizes(interpret) if interpret else [1, 2, 3, 7, 8, 16, 17, 64, 129]
    for temp in (0.0, 0.6):
        assert_rows_invariant(lambda a, b: triton_impl(token_logprobs)(a, b, temp), [logits, tok], sizes)
        assert_rows_invariant(lambda a: triton_impl(log_softmax)(a, temp), [logits], sizes[:5])


@pytest.mark.parametrize("temp", [0.0, 0.6])
def test_gradients(device, interpret, temp) -> None:
    v = 5000 if interpret else 50257
    logits, tok = _logits(3, v, device, seed=6)
    logits.requires_grad_(True)
    gy = torch.tensor([1.0, -0.5, 2.0], device=device)
    (got,) = torch.autograd.grad(triton_impl(token_logprobs)(logits, tok, temp), logits, gy)
    xd = logits.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(token_logprobs_ref(xd, tok, temp), xd, gy.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    gls = torch.randn(3, v, generator=torch.Generator().manual_seed(0)).to(device)
    (got,) = torch.autograd.grad(triton_impl(log_softmax)(logits, temp), logits, gls)
    (want,) = torch.autograd.grad(log_softmax_ref(xd, temp), xd, gls.double())
    # d z = g - softmax * sum(g): sum(g) ~ sqrt(V) makes the absolute error ~u * sqrt(V) * p
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
