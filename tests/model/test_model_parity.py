"""Model-level bitwise parity (docs/numerics.md): the logits of every token are identical between the trainer
path (packed varlen, any order, alone or together) and the engine path (token by token, random
prefill chunks straddling 64-token boundaries, staggered arrivals)."""
import pytest
import torch

from zmrl.kernels_batch_invariant.logprob import token_logprobs
from zmrl.model import ModelConfig, build_model

from .parity_utils import assert_all_equal, incremental_logits, make_sequences, packed_logits, random_chunks

# Lengths 1..300: inside one chunk, exactly one chunk, straddling, and longer than index_topk=64 (the
# sparse selection is active from position 64 on); the last sequence shares 150 tokens with another.
LENS = [1, 9, 64, 65, 131, 300]
SHARED = (5, 150, 41)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return build_model(ModelConfig.preset("tiny"), seed=0, dtype=request.param).eval()


@pytest.fixture(scope="module")
def seqs(model):
    return make_sequences(model.config.vocab_size, LENS, seed=1, shared_prefix=SHARED)


@pytest.fixture(scope="module")
def reference(model, seqs):
    return packed_logits(model, seqs)


def test_logits_are_sane(model, reference):
    for x in reference:
        assert torch.isfinite(x).all()
    allrows = torch.cat(reference)
    assert allrows.std(dim=-1).min() > 1e-3, "degenerate (constant) logits"
    assert allrows.argmax(-1).unique().numel() > 10, "every position predicts the same token"


def test_packed_alone_vs_together(model, seqs, reference):
    alone = [packed_logits(model, [s])[0] for s in seqs]
    assert_all_equal(alone, reference, "alone vs packed")


def test_packed_order(model, seqs, reference):
    order = [3, 6, 0, 5, 2, 4, 1]
    assert_all_equal(packed_logits(model, seqs, order=order), reference, "shuffled packing")


def test_token_by_token(model, seqs, reference):
    got = incremental_logits(model, seqs, chunk_sizes=lambda i, step: 1)
    assert_all_equal(got, reference, "token-by-token decode")


@pytest.mark.parametrize("seed", [0, 1])
def test_random_prefill_chunks_and_arrivals(model, seqs, reference, seed):
    arrivals = [0, 3, 1, 0, 5, 2, 4] if seed else None
    got = incremental_logits(model, seqs, chunk_sizes=random_chunks(seed), arrivals=arrivals)
    assert_all_equal(got, reference, f"random prefill chunks (seed {seed})")


def test_prefill_then_decode_page_128(model, seqs, reference):
    # prompt in one shot, then decode; a different page size must not change anything
    got = incremental_logits(model, seqs, chunk_sizes=lambda i, step: 70 if step == 0 else 1, page_size=128)
    assert_all_equal(got, reference, "prefill + decode, page 128")


def test_logprobs_bitwise(model, seqs, reference):
    got = incremental_logits(model, seqs, chunk_sizes=random_chunks(7, 1, 40))
    for s, a, b in zip(seqs, got, reference):
        if s.numel() < 2:
            continue
        for temp in (1.0, 0.6):
            assert torch.equal(token_logprobs(a[:-1], s[1:], temp), token_logprobs(b[:-1], s[1:], temp))


def test_fp8_latent_cache_parity(model, seqs):
    ref = packed_logits(model, seqs, latent_format="fp8")
    got = incremental_logits(model, seqs, chunk_sizes=random_chunks(3), latent_format="fp8")
    assert_all_equal(got, ref, "fp8 latent cache")
    native = packed_logits(model, seqs)
    assert any(not torch.equal(a, b) for a, b in zip(ref, native)), "fp8 fake-quant changed nothing"


def test_bad_token_id(model):
    with pytest.raises(ValueError, match="token id 5000 is out of range"):
        packed_logits(model, [torch.tensor([1, 2, 5000])])


def _k3_variant() -> ModelConfig:
    """Every K3 flag on, plus rotary MLA/indexer and the Hadamard-rotated FP8 index keys."""
    cfg = ModelConfig.preset("tiny")
    cfg.gate_lower_bound, cfg.use_full_rank_gate, cfg.mla_use_output_gate = -5.0, True, True
    cfg.moe_latent_size, cfg.moe_glu, cfg.attn_res_block_size = 96, "situ", 2
    cfg.mla_use_nope, cfg.index_use_hadamard = False, True
    return cfg.validate()


def test_k3_flags_parity():
    model = build_model(_k3_variant(), seed=2).eval()
    seqs = make_sequences(model.config.vocab_size, [1, 70, 150], seed=5, shared_prefix=(2, 100, 20))
    ref = packed_logits(model, seqs)
    assert all(torch.isfinite(x).all() for x in ref)
    assert_all_equal(packed_logits(model, seqs, order=[3, 1, 0, 2]), ref, "K3 flags: shuffled packing")
    assert_all_equal(incremental_logits(model, seqs, chunk_sizes=random_chunks(11)), ref, "K3 flags: random chunks")
    # the flags change the function (they are not silently ignored)
    plain = build_model(ModelConfig.preset("tiny"), seed=2).eval()
    assert not torch.equal(packed_logits(plain, seqs[:1])[0], ref[0])
