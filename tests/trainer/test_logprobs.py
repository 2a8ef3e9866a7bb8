"""zmrl.trainer: micro-batch packing, and the log-prob forward (docs/numerics.md): it equals token_logprobs
over one plain packed forward, bitwise, whatever the micro-batching and packing order; per-sequence
temperatures; argument errors; gradients that reach the LoRA parameters only."""
from __future__ import annotations

import copy

import pytest
import torch

from zmrl.kernels_batch_invariant.logprob import token_logprobs
from zmrl.lora import LoraConfig, apply_lora, lora_parameters
from zmrl.model import ModelConfig, build_model, cu_seqlens_from_lens, forward_packed
from zmrl.trainer import compute_logprobs, pack_micro_batches

# A long sequence crossing KDA chunks and tiny's index_topk=64 (sparse selection on), one whose
# response is empty (prompt_len == len), a 1-token sequence, and a few short ones.
LENS = [97, 33, 5, 1, 70]
PROMPTS = [40, 33, 2, 1, 5]


# ----------------------------------------------------------------------------- pack_micro_batches
def _check_packing(lengths, limit, batches, order):
    assert [i for b in batches for i in b] == list(order), "every sequence once, in the given order"
    for b in batches:
        assert b, "no empty micro-batch"
        assert len(b) == 1 or sum(lengths[i] for i in b) <= limit, f"{b} exceeds {limit} tokens"


def test_pack_limits_and_greedy():
    lengths = [5, 7, 3, 10, 2]
    got = pack_micro_batches(lengths, 12)
    assert got == [[0, 1], [2], [3, 4]]  # greedy: 5+7 = 12 fits exactly; 12+3 does not; 3+10 does not
    _check_packing(lengths, 12, got, range(5))
    assert pack_micro_batches(lengths, None) == [[0, 1, 2, 3, 4]]
    assert pack_micro_batches(lengths, 1) == [[0], [1], [2], [3], [4]]
    assert pack_micro_batches(lengths, 1000) == [[0, 1, 2, 3, 4]]
    assert pack_micro_batches([], 8) == [] and pack_micro_batches([], None) == []


def test_pack_long_sequence_alone():
    lengths = [4, 50, 4, 4]
    got = pack_micro_batches(lengths, 10)
    assert got == [[0], [1], [2, 3]]  # 50 > 10 gets a micro-batch of its own; it is not split or dropped
    _check_packing(lengths, 10, got, range(4))


@pytest.mark.parametrize("limit", [None, 1, 6, 11, 100])
def test_pack_order(limit):
    lengths = [5, 7, 3, 10, 2, 6]
    order = [4, 1, 5, 0, 3, 2]
    got = pack_micro_batches(lengths, limit, order)
    _check_packing(lengths, limit or 10 ** 9, got, order)


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [0, 1, 2, 3], [1, 2, 3], [-1, 0, 1]])
def test_pack_order_must_be_a_permutation(order):
    with pytest.raises(ValueError, match="permutation"):
        pack_micro_batches([3, 4, 5], 8, order)


@pytest.mark.parametrize("limit", [0, -5])
def test_pack_rejects_non_positive_limit(limit):
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_micro_batches([3, 4], limit)


# ----------------------------------------------------------------------------- compute_logprobs
@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny")
    # init_b_std > 0: every adapter (A and B) is non-trivial, so the LoRA path is really exercised
    return apply_lora(build_model(cfg, seed=0), LoraConfig(r=8, alpha=16.0, init_b_std=0.02, init_seed=1))


@pytest.fixture(scope="module")
def seqs(model):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in LENS]


@pytest.fixture(scope="module")
def full_logits(model, seqs):
    """One plain packed forward over every sequence: the reference the trainer must reproduce."""
    with torch.no_grad():
        logits = forward_packed(model, torch.cat(seqs), cu_seqlens_from_lens(LENS))
    return logits.split(LENS)


def _reference(full_logits, seqs, temps):
    return [token_logprobs(lg[p - 1:-1], s[p:], t) for lg, s, p, t in zip(full_logits, seqs, PROMPTS, temps)]


def _assert_equal(got, want, what):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape == (LENS[i] - PROMPTS[i],), f"{what}: sequence {i} shape {tuple(a.shape)}"
        assert a.dtype == torch.float32
        assert torch.equal(a, b), f"{what}: sequence {i} max |diff| {float((a - b).abs().max()):.3e}"


@pytest.fixture(scope="module")
def reference(full_logits, seqs):
    ref = _reference(full_logits, seqs, [1.0] * len(LENS))
    assert all(torch.isfinite(r).all() and (r <= 0).all() for r in ref)
    return ref


def test_equals_token_logprobs_over_forward_packed(model, seqs, reference):
    with torch.no_grad():
        got = compute_logprobs(model, seqs, PROMPTS)
    _assert_equal(got, reference, "compute_logprobs")
    # accepts plain lists of ids too
    with torch.no_grad():
        got = compute_logprobs(model, [s.tolist() for s in seqs], PROMPTS)
    _assert_equal(got, reference, "list input")


@pytest.mark.parametrize("mbt", [None, 1, 37, 200])
@pytest.mark.parametrize("order", [None, [4, 2, 0, 3, 1]], ids=["in-order", "permuted"])
def test_invariant_to_micro_batching_and_order(model, seqs, reference, mbt, order):
    with torch.no_grad():
        got = compute_logprobs(model, seqs, PROMPTS, micro_batch_tokens=mbt, order=order)
    _assert_equal(got, reference, f"micro_batch_tokens={mbt}, order={order}")


def test_fp8_latents_invariant_to_micro_batching(model, seqs, reference):
    with torch.no_grad():
        a = compute_logprobs(model, seqs, PROMPTS, latent_format="fp8")
        b = compute_logprobs(model, seqs, PROMPTS, latent_format="fp8", micro_batch_tokens=37, order=[3, 1, 4, 0, 2])
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert any(not torch.equal(x, r) for x, r in zip(a, reference)), "fp8 latents had no effect"


def test_per_sequence_temperature(model, seqs, full_logits):
    temps = [1.0, 0.7, 0.0, 1.3, 2.0]
    want = _reference(full_logits, seqs, temps)
    with torch.no_grad():
        got = compute_logprobs(model, seqs, PROMPTS, temperature=temps, micro_batch_tokens=37)
        got_tuple = compute_logprobs(model, seqs, PROMPTS, temperature=tuple(temps))
        alone = [compute_logprobs(model, [s], [p], temperature=t)[0] for s, p, t in zip(seqs, PROMPTS, temps)]
    _assert_equal(got, want, "temperature list")
    _assert_equal(got_tuple, want, "temperature tuple")
    _assert_equal(alone, want, "each sequence alone with its scalar temperature")
    # the temperatures really differ in effect (0.7 and 2.0 vs 1.0 on sequences 4 and 0)
    assert not torch.equal(got[4], _reference(full_logits, seqs, [1.0] * 5)[4])


def test_argument_errors(model, seqs):
    with pytest.raises(ValueError, match="prompt_len 0"):
        compute_logprobs(model, seqs[:2], [0, 3])
    with pytest.raises(ValueError, match="prompt_len 34"):
        compute_logprobs(model, seqs[:2], [3, 34])  # longer than the 33-token sequence
    with pytest.raises(ValueError, match="prompt_lens"):
        compute_logprobs(model, seqs[:2], [3])
    with pytest.raises(ValueError, match="temperature"):
        compute_logprobs(model, seqs[:2], [3, 3], temperature=[1.0])
    with pytest.raises(ValueError, match="temperature"):
        compute_logprobs(model, seqs[:2], [3, 3], temperature=[1.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="temperature"):
        compute_logprobs(model, seqs[:2], [3, 3], temperature=-1.0)
    with pytest.raises(ValueError, match="permutation"):
        compute_logprobs(model, seqs[:2], [3, 3], order=[0, 0])
    with pytest.raises(ValueError, match="vocab"):
        compute_logprobs(model, [torch.tensor([1, 2, model.config.vocab_size])], [1])
    assert compute_logprobs(model, [], []) == []


def test_gradients_reach_lora_only(model, seqs):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    lps = compute_logprobs(m, seqs, PROMPTS, micro_batch_tokens=64)
    assert all(lp.requires_grad for lp in lps if lp.numel())
    loss = sum((lp * torch.randn(lp.shape, generator=g)).sum() for lp in lps)  # advantage-weighted
    loss.backward()
    lora = {id(p) for p in lora_parameters(m)}
    for name, p in m.named_parameters():
        if id(p) not in lora:
            assert not p.requires_grad and p.grad is None, f"base parameter {name} got a gradient"
        elif ".indexer." in name:
            # The DSA indexer only chooses which keys MLA attends to (a discrete top-k over FP8 scores),
            # so the policy loss has no gradient path to its adapters: they are trained by nothing here.
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().max() > 0, f"LoRA parameter {name} got an all-zero gradient"


# ----------------------------------------------------------------------------- chunked lm_head + log-prob
@pytest.mark.parametrize("chunk", [1, 5, 64, None])
def test_invariant_to_logprob_chunking(model, seqs, full_logits, chunk):
    """The lm_head + log-prob runs ``chunk`` response rows at a time (only the rows that predict a
    response token); every token's log-prob keeps the bits of the full [T, V] logits path."""
    temps = [1.0, 0.7, 0.0, 1.3, 0.7]
    want = _reference(full_logits, seqs, temps)
    with torch.no_grad():
        got = compute_logprobs(model, seqs, PROMPTS, temperature=temps, micro_batch_tokens=100,
                               logprob_chunk_tokens=chunk)
    _assert_equal(got, want, f"logprob_chunk_tokens={chunk}")
    with torch.enable_grad():  # recorded for backward: the same bits
        got = compute_logprobs(copy.deepcopy(model), seqs, PROMPTS, temperature=temps, logprob_chunk_tokens=chunk)
    _assert_equal([g.detach() for g in got], want, f"logprob_chunk_tokens={chunk}, autograd on")


def test_logprob_chunk_rejects_non_positive(model, seqs):
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        compute_logprobs(model, seqs[:2], [3, 3], logprob_chunk_tokens=0)


def test_chunked_gradients_match_full_logits_path(model, seqs):
    """LoRA gradients through the chunked lm_head (closed-form backward, logits recomputed per chunk) vs
    autograd through the full-logits path (forward_packed + token_logprobs), both fp32. Tolerance: the two
    differ only in how the log-softmax gradient is rounded (closed form vs autograd of the tree-sum
    composition) and in GEMM summation order, each a few fp32 ulps relative, amplified by the backward
    through 4 layers; 1e-4 relative (Frobenius) leaves room for that and is far below a wrong gradient's
    O(1). Also: two chunked backward passes are bitwise equal."""
    temps = [1.0, 0.7, 0.0, 1.3, 2.0]
    g = torch.Generator().manual_seed(7)
    coef = [torch.randn(n - p, generator=g) for n, p in zip(LENS, PROMPTS)]

    def grads(chunked: bool) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model)
        if chunked:
            lps = compute_logprobs(m, seqs, PROMPTS, temperature=temps, logprob_chunk_tokens=16)
        else:
            logits = forward_packed(m, torch.cat(seqs), cu_seqlens_from_lens(LENS)).split(LENS)
            lps = _reference(logits, seqs, temps)
        sum((lp * c).sum() for lp, c in zip(lps, coef)).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    chunked, again, full = grads(True), grads(True), grads(False)
    assert chunked.keys() == full.keys() and chunked
    worst = 0.0
    for name in chunked:
        assert torch.equal(chunked[name], again[name]), f"{name}: backward not deterministic"
        err = float((chunked[name] - full[name]).norm() / full[name].norm().clamp_min(1e-30))
        assert err < 1e-4, f"{name}: relative error {err:.2e}"
        worst = max(worst, err)
    print(f"worst relative error {worst:.2e}")
