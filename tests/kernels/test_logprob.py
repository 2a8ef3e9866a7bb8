"""token_logprobs / log_softmax: accuracy against float64, temperature semantics, input errors,
bitwise row invariance, gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.logprob import (
    log_softmax,
    log_softmax_ref,
    token_logprobs,
    token_logprobs_ref,
)

from .invariance import BATCHES, assert_rows_invariant

VOCABS = [7, 2048, 50257]
TEMPS = [0.6, 1.0, 0.0]


def _logits(t: int, v: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g) * 4 + torch.randn(t, 1, generator=g) * 10).to(dtype)
    tok = torch.randint(0, v, (t,), generator=g)
    tok[0] = int(logits[0].float().argmax())  # include a most-likely token (log p near 0)
    return logits, tok


# |z| <= ~40 here. fp32 error: z / T is one rounding (u|z| <= 2.4e-6), exp ~1 ulp, the tree of
# log2(V) <= 16 adds (<= 16u relative in the sum, so <= 1e-6 absolute in its log), log and the
# two final subtractions (u * |lse| each). Total <= ~6e-6; atol 2e-5 leaves margin. A wrong
# temperature (e.g. multiplying), a missing max shift, an off-by-one token, or a wrong lse are
# all >= 1e-3 off.
ATOL = 2e-5


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("temp", TEMPS)
def test_token_logprobs_matches_float64(v: int, temp: float) -> None:
    logits, tok = _logits(9, v, seed=v)
    got = token_logprobs(logits, tok, temp)
    assert got.dtype == torch.float32 and got.shape == (9,)
    torch.testing.assert_close(got.double(), token_logprobs_ref(logits, tok, temp), rtol=0, atol=ATOL)
    ls = log_softmax(logits, temp)
    assert ls.shape == (9, v)
    torch.testing.assert_close(ls.double(), log_softmax_ref(logits, temp), rtol=0, atol=ATOL)
    # same arithmetic: gathering the full log-softmax gives the same bits
    assert torch.equal(ls.gather(1, tok[:, None])[:, 0], got)


def test_temperature_semantics() -> None:
    logits, tok = _logits(5, 300, seed=1)
    # 0 means greedy: the raw distribution, bit for bit the same as T = 1
    assert torch.equal(token_logprobs(logits, tok, 0.0), token_logprobs(logits, tok, 1.0))
    # T is applied as a true division of the fp32 logits (what the sampler does), not a multiply
    z = logits / 0.6
    assert torch.equal(log_softmax(logits, 0.6), log_softmax(z, 1.0))
    assert torch.equal(log_softmax(logits, 0.6), log_softmax(logits / torch.tensor(0.6), 1.0))
    # sharper at T < 1: the argmax token is more likely
    assert token_logprobs(logits, tok, 0.6)[0] > token_logprobs(logits, tok, 1.0)[0]
    # probabilities sum to 1 (each log-prob is within u*|lse| ~ 4e-6 of exact here)
    total = log_softmax(logits, 0.6).double().exp().sum(-1)
    torch.testing.assert_close(total, torch.ones(5, dtype=torch.float64), rtol=0, atol=1e-5)


def test_bf16_logits_and_leading_dims() -> None:
    logits, tok = _logits(12, 2048, seed=2, dtype=torch.bfloat16)
    got = token_logprobs(logits, tok)
    assert got.dtype == torch.float32
    assert torch.equal(got, token_logprobs(logits.float(), tok))  # bf16 -> fp32 is exact
    torch.testing.assert_close(got.double(), token_logprobs_ref(logits, tok), rtol=0, atol=ATOL)
    got3 = token_logprobs(logits.view(3, 4, 2048), tok.view(3, 4), 0.6)
    assert got3.shape == (3, 4)
    assert torch.equal(got3.reshape(-1), token_logprobs(logits, tok, 0.6))


def test_errors() -> None:
    logits, tok = _logits(4, 7, seed=3)
    with pytest.raises(ValueError, match="token id 7 "):
        token_logprobs(logits, torch.tensor([0, 7, 1, 2]))
    with pytest.raises(ValueError, match="token id -1 "):
        token_logprobs(logits, torch.tensor([0, 1, -1, 2]))
    with pytest.raises(ValueError, match="must match"):
        token_logprobs(logits, tok[:3])
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(logits, tok.float())
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[2, 5] = bad
        with pytest.raises(ValueError, match="row 2 "):
            token_logprobs(broken, tok)
        with pytest.raises(ValueError, match="row 2 "):
            log_softmax(broken)
    for t in (-0.5, -1e-9, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(logits, tok, t)
        with pytest.raises(ValueError, match="temperature"):
            log_softmax(logits, t)
    # overflow created by the temperature division is caught too
    with pytest.raises(ValueError, match="row 0 "):
        log_softmax(torch.tensor([[3e38, 0.0]]), 0.5)


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("temp", [0.6, 1.0])
def test_row_invariance(v: int, temp: float) -> None:
    """A row's log-probs are the same bits alone and in any batch, at any position, with 1 or 2
    threads. (For V = 50257 with 2 threads, torch.sum splits a lone row across threads on this
    CPU, so a stock reduction in place of tree_sum fails this.)"""
    n = 80 if v < 50257 else 24
    logits, tok = _logits(n, v, seed=v + 1)
    # Every other row peaked (one token 2 nats above the rest) and shifted so its max is exactly
    # 0: then lse = log(S) with S ~ 1.2, small enough that the final rounding resolves every ulp
    # of S, so a reduction whose order changed with the batch or thread count would show. (With
    # max ~ 20, the final m + log(S) rounds most such differences away and a broken op could pass
    # by luck; measured: torch.sum in place of tree_sum fails only with these rows.)
    peaked = logits[::2].clone()
    peaked[torch.arange(len(peaked)), tok[::2]] = peaked.amax(-1) + 2
    logits[::2] = peaked - peaked.amax(-1, keepdim=True)
    sizes = BATCHES if v < 50257 else [1, 2, 3, 15, 16, 17, 24]
    stride = 9 if v < 50257 else 1  # a lone long row is where a stock reduction splits across threads
    assert_rows_invariant(lambda lg, t: token_logprobs(lg, t, temp), (logits, tok), sizes, seed=v, alone_stride=stride)
    if v < 50257:
        assert_rows_invariant(lambda lg: log_softmax(lg, temp), (logits,), sizes[::7], seed=v)


def test_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=g, dtype=torch.float64, requires_grad=True)
    tok = torch.tensor([0, 5, 10])
    assert torch.autograd.gradcheck(lambda lg: token_logprobs(lg, tok, 0.6), (logits,))
    assert torch.autograd.gradcheck(lambda lg: log_softmax(lg, 1.0), (logits,))
    # fp32: d logp(tok) / d z = onehot(tok) - softmax(z), scaled by 1/T
    l32 = logits.detach().float().requires_grad_()
    token_logprobs(l32, tok, 0.6).sum().backward()
    z = logits.detach() / 0.6
    want = (torch.nn.functional.one_hot(tok, 11).double() - torch.softmax(z, -1)) / 0.6
    torch.testing.assert_close(l32.grad.double(), want, rtol=1e-5, atol=1e-6)
