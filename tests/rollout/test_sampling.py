"""The rollout sampler: parameter validation, derived seeds, the counter-based noise, greedy and
filtered draws, their distribution, the recorded log-probs, and bitwise row invariance."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from zmrl.kernels_batch_invariant.logprob import log_softmax, token_logprobs
from zmrl.rollout import sampling as S
from zmrl.rollout.sampling import SamplingParams, derive_seed, rollout_seed, sample

from tests.kernels.invariance import num_threads

M64 = (1 << 64) - 1
U32 = 2.0**-24  # unit roundoff of fp32
PINNED_SEED = 451373029970860901  # derive_seed(0, 3, "sample:1"), fixed forever
PINNED_ROLLOUT_SEED = 4578603499915848902  # rollout_seed(0, 0, [1, 2, 3]), fixed forever


def P(**fields: object) -> SamplingParams:
    """SamplingParams with seed 0 unless given (``sample`` needs a resolved seed; the engine draws one)."""
    return SamplingParams(**{"seed": 0, **fields})  # type: ignore[arg-type]


def _key(tag: str) -> int:
    """A 63-bit key from a label (the engine's keys are sample indices; the sampler takes any)."""
    return derive_seed(0, tag)


def draw(logits: torch.Tensor, params: SamplingParams, n: int, tag: str = "d") -> torch.Tensor:
    """n draws of one logits row at n distinct (key, position) pairs: 100 positions per key."""
    keys = [_key(f"{tag}-{i // 100}") for i in range(n)]
    positions = [i % 100 for i in range(n)]
    tokens, _ = sample(logits.expand(n, -1).contiguous(), [params] * n, keys, positions)
    return tokens


def assert_frequencies(tokens: torch.Tensor, p: torch.Tensor) -> None:
    """Empirical frequencies of ``tokens`` match ``p`` (float64, sums to 1) per bin within 4 sigma of
    the binomial count. Under a correct sampler each bin fails with probability ~6e-5 (the test is
    deterministic: the hash is fixed), while the mistakes this guards against (wrong temperature,
    a filter that leaks or over-cuts, biased noise) move some bin by 10+ sigma at n = 20000
    (e.g. T=1 instead of T=0.7 on test_distribution's logits is 34 sigma)."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    assert counts.numel() == p.numel(), "drew a token outside the vocabulary"
    assert (counts[p == 0] == 0).all(), f"drew tokens of zero probability: {counts.tolist()} vs {p.tolist()}"
    sd = (n * p * (1 - p)).sqrt()
    dev = (counts - n * p).abs()
    bad = (dev > 4 * sd) & (p > 0)
    assert not bad.any(), f"frequencies {(counts / n).tolist()} vs expected {p.tolist()}"


# ----------------------------------------------------------------------------- SamplingParams


BAD_PARAMS = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.5), ("top_p", float("nan")), ("top_p", None),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.5), ("top_k", True),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.0),
    ("n", 0), ("n", 1.5),
    ("seed", -1), ("seed", 1.5), ("seed", "1"), ("seed", True),
    ("first_sample_index", -1), ("first_sample_index", 1 << 63), ("first_sample_index", 1.0),
    ("first_sample_index", True),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", "12"), ("stop_token_ids", 5),
    ("stop_token_ids", [True]),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_params_validation_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value) in msg, msg
    assert "must be" in msg, msg  # says what is allowed


def test_params_normalised_and_frozen() -> None:
    p = SamplingParams(temperature=1, top_p=1, top_k=np.int64(5), stop_token_ids=[3, np.int64(4)], seed=7)
    assert p.temperature == 1.0 and type(p.temperature) is float and type(p.top_p) is float
    assert p.top_k == 5 and type(p.top_k) is int
    assert p.stop_token_ids == (3, 4) and all(type(s) is int for s in p.stop_token_ids)
    assert SamplingParams(stop_token_ids=range(2)).stop_token_ids == (0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seed = 3  # type: ignore[misc]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-3).greedy
    d = SamplingParams()
    got = (d.temperature, d.top_p, d.top_k, d.max_tokens, d.seed, d.stop_token_ids, d.n, d.first_sample_index)
    assert got == (1.0, 1.0, -1, 16, None, (), 1, 0)  # no seed: the engine draws one
    assert type(SamplingParams(first_sample_index=np.int64(3)).first_sample_index) is int
    assert str(SamplingParams(temperature=-0.0).temperature) == "0.0"
    assert SamplingParams(seed=1 << 80).seed == 1 << 80  # wide seeds are allowed (folded in the hash)


# ----------------------------------------------------------------------------- seeds


def test_derive_seed_stable_and_63_bit() -> None:
    # Pinned: a derived seed must not change between processes (PYTHONHASHSEED), machines or releases,
    # or a resumed RL run would draw different tokens.
    assert derive_seed(0, 3, "sample:1") == derive_seed(0, 3, "sample:1") == PINNED_SEED
    seeds = {derive_seed(7, i) for i in range(2000)}
    assert len(seeds) == 2000 and all(0 <= s < 1 << 63 for s in seeds)
    assert derive_seed(1, 2) != derive_seed(12) != derive_seed(2, 1)


def test_rollout_seed_is_keyed_on_run_seed_weights_step_and_prompt_tokens() -> None:
    # Pinned like derive_seed: a resumed run, and verl's rollout, must derive the same seed.
    assert rollout_seed(0, 0, [1, 2, 3]) == rollout_seed(0, 0, (np.int64(1), 2, 3)) == PINNED_ROLLOUT_SEED
    seeds = {rollout_seed(base, step, prompt) for base in (0, 1) for step in (0, 1, 2)
             for prompt in ([1, 2, 3], [1, 2], [12, 3], [1, 23], [3, 2, 1])}
    assert len(seeds) == 2 * 3 * 5 and all(0 <= s < 1 << 63 for s in seeds)


def test_sample_needs_a_seed() -> None:
    with pytest.raises(ValueError, match=r"params\[1\]\.seed is None"):
        sample(torch.randn(2, 10), [P(), SamplingParams()], [0, 0], [0, 0])
    sample(torch.randn(1, 10), [SamplingParams(temperature=0)], [0], [0])  # greedy draws nothing


# ----------------------------------------------------------------------------- counter-based noise


def test_mix64_torch_matches_python() -> None:
    """The int64 torch mixer (wrap-around multiply, masked shifts) is bit-exact splitmix64."""
    g = torch.Generator().manual_seed(0)
    vals = [0, 1, 2, (1 << 63) - 1, 1 << 63, M64, 0x9E3779B97F4A7C15]
    vals += [int(v) & M64 for v in torch.randint(-(1 << 63), (1 << 63) - 1, (500,), generator=g).tolist()]
    got = S._mix64_t(torch.tensor([S._signed(v) for v in vals], dtype=torch.int64))
    assert [v & M64 for v in got.tolist()] == [S._mix64(v) for v in vals]
    # splitmix64's published first output for seed 0 (state += GAMMA, then mix): 0xE220A8397B1DCDAF
    assert S._mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_batched_row_states_equal_row_state() -> None:
    """The sampler mixes the positions of a whole batch in with tensor ops: the same states as row_state."""
    g = torch.Generator().manual_seed(3)
    rows = [(0, 0, 0), (1 << 70, M64, (1 << 63) - 1), (M64, 1, 1 << 62), ((1 << 63) - 1, 2, 12345)]
    rows += [(int(s) & M64, int(k) & M64, int(p) & ((1 << 63) - 1))
             for s, k, p in torch.randint(-(1 << 63), (1 << 63) - 1, (300, 3), generator=g).tolist()]
    seeds = [P(seed=s) for s, _, _ in rows]
    got = S.row_states(seeds, [k for _, k, _ in rows], [p for _, _, p in rows])
    assert got.dtype == torch.int64
    assert [v & M64 for v in got.tolist()] == [S.row_state(s, k, p) for s, k, p in rows]
    # the decode graph's way: the per-request part kept per slot, the position mixed in by mix_positions
    parts = torch.tensor([S.seed_key_state(sp, k) for sp, (_, k, _) in zip(seeds, rows)], dtype=torch.int64)
    assert torch.equal(S.mix_positions(parts, torch.tensor([p for _, _, p in rows])), got)
    assert S.seed_key_state(P(temperature=0), 5) == 0


def test_uniform_bits_match_python_reference() -> None:
    g = torch.Generator().manual_seed(1)
    states = [S.row_state(s, k, p) for s, k, p in [(0, 0, 0), (1, _key("a"), 7), (1 << 70, M64, (1 << 63) - 1)]]
    idx = torch.randint(0, 1 << 31, (3, 50), generator=g)
    got = S._uniform_bits(torch.tensor([S._signed(h) for h in states]), idx)
    for r, h in enumerate(states):
        ref = [S._mix64((h + (i + 1) * S._GAMMA) & M64) >> 40 for i in idx[r].tolist()]
        assert got[r].tolist() == ref
    assert int(got.min()) >= 0 and int(got.max()) < 1 << 24


def test_u_is_never_0_or_1_and_gumbel_is_finite() -> None:
    edge = S._gumbel_from_bits(torch.tensor([0, 1, (1 << 24) - 2, (1 << 24) - 1]))
    assert torch.isfinite(edge).all()
    # u = (bits + 0.5) / 2^24 in float64: the extremes are 2^-25 and 1 - 2^-25, so -log(u) > 0.
    assert edge[0] == -math.log(-math.log(2.0**-25))
    assert edge[-1] == pytest.approx(-math.log(-math.log1p(-(2.0**-25))), rel=1e-12)
    assert 17.0 < float(edge[-1]) < 18.0 and -3.0 < float(edge[0]) < -2.8
    # and over a million real draws: finite, uniform bits (16 buckets within 5 sigma).
    states = torch.tensor([S._signed(S.row_state(0, _key(f"u{i}"), i)) for i in range(64)])
    bits = S._uniform_bits(states, torch.arange(16384).expand(64, -1))
    assert torch.isfinite(S._gumbel_from_bits(bits)).all()
    counts = torch.bincount((bits >> 20).reshape(-1), minlength=16).double()
    n = bits.numel()
    assert ((counts - n / 16).abs() <= 5 * math.sqrt(n / 16 * 15 / 16)).all(), counts


def test_no_global_rng() -> None:
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    ps, keys, pos = [P(top_p=0.9)] * 6, list(range(6)), list(range(6))
    torch.manual_seed(0)
    a = sample(x, ps, keys, pos)
    state = torch.get_rng_state()
    torch.manual_seed(12345)
    b = sample(x, ps, keys, pos)
    torch.manual_seed(12345)
    torch.set_rng_state(state)
    sample(x, ps, keys, pos)
    assert torch.equal(torch.get_rng_state(), state), "sample consumed the global RNG"
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_lowest_index_with_exact_logprob() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 33, generator=g)
    x[1, [4, 9, 20]] = 10.0                     # three-way tie -> 4
    x[2] = 0.0
    x[2, 7] = -0.0                              # all equal (with a -0.0) -> 0
    x[3, [31, 32]] = 7.5                        # tie at the end -> 31
    p = P(temperature=0, top_k=3, top_p=0.1, seed=9)  # filters are ignored when greedy
    tok, lp = sample(x, [p] * 5, [11, 12, 13, 14, 15], [0, 5, 6, 7, 8])
    want = [int(torch.argmax(x[0])), 4, 0, 31, int(torch.argmax(x[4]))]
    assert tok.tolist() == want
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(lp, token_logprobs(x, tok, 0.0))
    # greedy does not look at seed, key or position
    tok2, lp2 = sample(x, [P(temperature=0)] * 5, [1, 2, 3, 4, 5], [9, 9, 9, 9, 9])
    assert torch.equal(tok, tok2) and torch.equal(lp, lp2)


# ----------------------------------------------------------------------------- determinism


def test_same_counter_same_token_and_counters_matter() -> None:
    v, n = 64, 200
    x = torch.zeros(n, v)  # uniform: every draw is a fresh 1-in-64 pick
    key = _key("det")

    def run(seed: int, keys: list[int], positions: list[int]) -> torch.Tensor:
        return sample(x, [P(seed=seed)] * n, keys, positions)[0]

    base = run(0, [key] * n, list(range(n)))
    assert torch.equal(base, run(0, [key] * n, list(range(n))))
    # 200 positions of one request: expected ~61 distinct tokens of 64; a position-blind hash gives 1.
    assert len(set(base.tolist())) > 40
    # Changing the seed, the key or the position offset: agreement expected at 1/64 (~3 of 200,
    # sd ~1.8); 20 is > 9 sigma above chance, while ignoring that input agrees 200/200.
    for other in (run(1, [key] * n, list(range(n))), run(1 << 64, [key] * n, list(range(n))),
                  run(0, [_key("det2")] * n, list(range(n))), run(0, [key] * n, list(range(1, n + 1)))):
        assert int((other == base).sum()) < 20
    # distinct keys at a fixed position also spread out
    assert len(set(run(0, [_key(f"k{i}") for i in range(n)], [5] * n).tolist())) > 40


# ----------------------------------------------------------------------------- invariance


def _pool(n: int, v: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams], list[int], list[int]]:
    """Rows of varied scale (peaked and nearly flat: a flat row with top_p 0.95 needs a nucleus of
    > 1024 tokens, so the growing-prefix scan runs) and mixed parameters."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01, 0.3, 1.0, 4.0])[torch.randint(0, 4, (n, 1), generator=g)]
    x = torch.randn(n, v, generator=g) * scale + torch.randn(n, 1, generator=g) * 5
    x[0, :3] = x[0].max() + 1  # ties at the top
    choice = lambda opts: opts[int(torch.randint(0, len(opts), (1,), generator=g))]  # noqa: E731
    params = [P(temperature=choice([0.0, 0.6, 1.0, 1.7]), top_k=choice([-1, -1, 1, 7, 200]),
                             top_p=choice([1.0, 1.0, 0.95, 0.5, 0.05]), seed=choice([0, 1, 12345]))
              for _ in range(n)]
    keys = [int(k) for k in torch.randint(0, 1 << 62, (n,), generator=g).tolist()]
    positions = [int(p) for p in torch.randint(0, 100000, (n,), generator=g).tolist()]
    return x, params, keys, positions


@pytest.mark.parametrize("v", [37, 3000])
def test_rows_invariant_to_batch_size_order_and_threads(v: int) -> None:
    n = 48
    x, params, keys, positions = _pool(n, v, seed=v)

    def run(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(x[idx], [params[i] for i in idx], [keys[i] for i in idx], [positions[i] for i in idx])

    g = torch.Generator().manual_seed(7)
    with num_threads(1):
        alone = [run([i]) for i in range(n)]
    for threads in (1, 2):
        with num_threads(threads):
            for b in [1, 2, 3, 5, 8, 13, 17, 24, 31, 40]:
                idx = torch.randperm(n, generator=g)[:b].tolist()
                tok, lp = run(idx)
                for j, i in enumerate(idx):
                    assert torch.equal(tok[j], alone[i][0][0]), f"token of row {i} at {j} in a batch of {b}"
                    assert torch.equal(lp[j], alone[i][1][0]), f"logprob of row {i} at {j} in a batch of {b}"
    # the draws are real draws: the filters and the recorded log-prob hold in the batch too
    tok, lp = run(list(range(n)))
    for i, p in enumerate(params):
        assert torch.equal(lp[i], token_logprobs(x[i:i + 1], tok[i:i + 1], p.temperature)[0])
        if p.top_k == 1 or p.greedy:
            assert int(tok[i]) == int(torch.argmax(x[i]))


def test_vocab_size_ignores_padding_columns() -> None:
    x, params, keys, positions = _pool(12, 50, seed=5)
    padded = torch.cat([x, torch.full((12, 14), 1e4)], dim=1)  # padding would win every draw
    tok, lp = sample(padded, params, keys, positions, vocab_size=50)
    ref_tok, ref_lp = sample(x, params, keys, positions)
    assert torch.equal(tok, ref_tok) and torch.equal(lp, ref_lp)
    assert int(tok.max()) < 50


def test_bf16_logits_record_token_logprobs_of_the_bf16_row() -> None:
    x, params, keys, positions = _pool(8, 40, seed=6)
    xb = x.to(torch.bfloat16)
    tok, lp = sample(xb, params, keys, positions)
    assert lp.dtype == torch.float32
    ref_tok, _ = sample(xb.float(), params, keys, positions)  # upcasting is exact
    assert torch.equal(tok, ref_tok)
    for i, p in enumerate(params):
        assert torch.equal(lp[i], token_logprobs(xb[i:i + 1], tok[i:i + 1], p.temperature)[0])


# ----------------------------------------------------------------------------- distributions


def test_distribution_matches_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = draw(logits, P(temperature=0.7, seed=3), 20000)
    assert_frequencies(tokens, torch.softmax(logits.double() / 0.7, -1))
    # the check has power: the same draws are far from the untempered distribution
    with pytest.raises(AssertionError):
        assert_frequencies(tokens, torch.softmax(logits.double(), -1))


def test_top_k_draws_only_the_k_best_renormalised() -> None:
    logits = torch.tensor([0.3, -1.0, 1.2, 0.9, -0.2, 1.0, 0.0, -2.0])
    tokens = draw(logits, P(top_k=3), 20000, tag="tk")
    p = torch.softmax(logits.double(), -1)
    p[[0, 1, 4, 6, 7]] = 0  # keep 2, 5, 3
    assert_frequencies(tokens, p / p.sum())
    # ties at the cut go to the lower index
    tied = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0, 3.0])
    assert set(draw(tied, P(top_k=2), 400, tag="t2").tolist()) == {1, 2}
    assert set(draw(tied, P(top_k=3), 400, tag="t3").tolist()) == {1, 2, 3}


def test_top_p_keeps_the_smallest_nucleus_renormalised() -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)
    logits = probs.log().float()
    # sorted: 1 (0.4), 3 (0.3 -> 0.7), 4 (0.15 -> 0.85), 2, 0. top_p 0.75 needs three tokens.
    tokens = draw(logits, P(top_p=0.75), 20000, tag="tp")
    want = probs.clone()
    want[[0, 2]] = 0
    assert_frequencies(tokens, want / want.sum())
    assert set(draw(logits, P(top_p=0.6), 400, tag="a").tolist()) == {1, 3}
    assert set(draw(logits, P(top_p=0.3), 400, tag="b").tolist()) == {1}
    assert set(draw(logits, P(top_p=0.75, top_k=2), 400, tag="c").tolist()) == {1, 3}
    assert set(draw(logits, P(top_p=0.95, top_k=4), 2000, tag="d").tolist()) == {1, 2, 3, 4}
    # probability ties: the lower index enters the nucleus first
    tied = torch.tensor([0.3, 0.3, 0.3, 0.1], dtype=torch.float64).log().float()
    assert set(draw(tied, P(top_p=0.5), 400, tag="e").tolist()) == {0, 1}


def test_wide_nucleus_beyond_the_first_prefix() -> None:
    """A flat row of 5000: top_p 0.5 keeps the 2500 lowest ids (all tie), more than the 1024-wide
    first prefix; computed alone or next to a peaked row, it is the same draw."""
    v = 5000
    flat = torch.zeros(1, v)
    peaked = torch.randn(1, v, generator=torch.Generator().manual_seed(8)) * 10
    p = P(top_p=0.5)
    tokens = draw(flat[0], p, 400, tag="w")
    assert int(tokens.max()) < 2501 and int(tokens.max()) > 2300
    for pos in range(20):
        alone = sample(flat, [p], [77], [pos])
        pair = sample(torch.cat([peaked, flat]), [p, p], [78, 77], [pos, pos])
        assert torch.equal(alone[0], pair[0][1:]) and torch.equal(alone[1], pair[1][1:])


def test_filters_only_restrict_the_same_draw() -> None:
    """Noise belongs to the vocab id, so a filter that keeps the unfiltered winner keeps the token;
    top_k >= V and top_p == 1 are the same as no filter."""
    n, v = 300, 40
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, v, generator=g) * 2
    keys, positions = list(range(n)), [3 * i for i in range(n)]
    free, _ = sample(x, [P()] * n, keys, positions)
    for p in (P(top_k=v), P(top_k=v + 10), P(top_k=v - 1, top_p=1.0)):
        t, _ = sample(x, [p] * n, keys, positions)
        worst = x.argmin(-1)
        same = free != worst if p.top_k < v else torch.ones(n, dtype=torch.bool)
        assert torch.equal(t[same], free[same])
    kept, _ = sample(x, [P(top_k=5)] * n, keys, positions)
    rank = (x > x.gather(1, free[:, None])).sum(-1)  # how many beat the free winner
    assert torch.equal(kept[rank < 5], free[rank < 5])
    assert bool((kept[rank >= 5] != free[rank >= 5]).all())


# ----------------------------------------------------------------------------- recorded log-probs


def test_recorded_logprob_uses_temperature_and_ignores_filters() -> None:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(1, 100, generator=g) * 3
    best = int(torch.argmax(x))
    out = {}
    for t in (0.6, 1.0):
        tok, lp = sample(x, [P(temperature=t, top_k=1)], [1], [2])  # top_k=1 forces the argmax
        assert int(tok) == best
        assert torch.equal(lp, token_logprobs(x, tok, t))
        assert torch.equal(lp[0], log_softmax(x, t)[0, best])
        ref = torch.log_softmax(x.double() / t, -1)[0, best]
        assert abs(float(lp) - float(ref)) < 1e-5  # fp32 log-softmax of O(10) logits: ~1e-6 error
        out[t] = lp
    assert not torch.equal(out[0.6], out[1.0])
    greedy = sample(x, [P(temperature=0)], [1], [2])
    # greedy records the log-softmax of the raw logits (token_logprobs at temperature 0), i.e. T = 1
    assert int(greedy[0]) == best and torch.equal(greedy[1], out[1.0])
    # the same token under filters records the unfiltered (full-vocab) log-prob
    for p in (P(temperature=0.6, top_p=0.3), P(temperature=0.6, top_k=2),
              P(temperature=0.6, top_k=3, top_p=0.5)):
        for pos in range(10):
            tok, lp = sample(x, [p], [1], [pos])
            assert torch.equal(lp, token_logprobs(x, tok, 0.6))
            if int(tok) == best:
                assert torch.equal(lp, out[0.6])


# ----------------------------------------------------------------------------- errors and edges


def test_nonfinite_logits_name_the_row() -> None:
    x = torch.randn(5, 10)
    x[3, 4] = float("nan")
    ps = [P()] * 5
    with pytest.raises(ValueError, match=r"logits row 3 .*non-finite value nan at vocab index 4"):
        sample(x, ps, [1, 2, 3, 4, 5], [0, 0, 0, 0, 0])
    x[3, 4] = 0.0
    x[1, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"logits row 1 "):
        sample(x, [P(temperature=0)] * 5, [1, 2, 3, 4, 5], [0, 0, 0, 0, 0])
    x[1, 0] = 3e38  # finite, but overflows at temperature 0.5
    with pytest.raises(ValueError, match=r"logits row 1 .*overflows .*temperature 0.5"):
        sample(x, [P(temperature=0.5)] * 5, [1, 2, 3, 4, 5], [0, 0, 0, 0, 0])


def test_sample_async_equals_sample_and_flags_nonfinite_rows() -> None:
    """The engine's sync-free draw: every finite row's token and log-prob equal ``sample``'s bit for bit, over
    mixed temperatures (greedy, 1, 0.7), top-k / top-p rows, a strided (vocab_size) view and fp32 and bf16
    logits; rows with NaN/Inf logits, or logits that overflow when divided by their temperature, are flagged
    instead of raising, and do not change the other rows."""
    g = torch.Generator().manual_seed(5)
    ps = [P(), P(temperature=0.7, seed=3), P(temperature=0), P(top_k=4), P(top_p=0.8, seed=9), P(), P(temperature=0.5)]
    keys, positions = [1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16]
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(7, 40, generator=g) * 3).to(dtype)
        for vocab in (None, 33):
            tok, lp = sample(x, ps, keys, positions, vocab_size=vocab)
            tok_a, lp_a, finite = S.sample_async(x, ps, keys, positions, vocab_size=vocab)
            assert finite.all() and torch.equal(tok_a, tok) and torch.equal(lp_a, lp)
        # every row sampled with the same plain params: the whole-batch path
        same = [P(seed=4)] * 7
        assert all(torch.equal(a, b) for a, b in zip(S.sample_async(x, same, keys, positions)[:2],
                                                     sample(x, same, keys, positions)))
        bad = x.float().clone()
        bad[1, 3] = float("nan")  # T = 0.7
        bad[2, 0] = float("-inf")  # greedy
        bad[6, 5] = 3e38  # finite, but overflows at T = 0.5
        tok_a, lp_a, finite = S.sample_async(bad, ps, keys, positions)
        assert finite.tolist() == [True, False, False, True, True, True, False]
        rows = [0, 3, 4, 5]
        tok, lp = sample(bad[rows], [ps[i] for i in rows], [keys[i] for i in rows], [positions[i] for i in rows])
        assert torch.equal(tok_a[rows], tok) and torch.equal(lp_a[rows], lp)


def test_argument_errors_and_empty_batch() -> None:
    x = torch.randn(2, 10)
    ps = [P()] * 2
    with pytest.raises(ValueError, match="2 rows but got 1 params"):
        sample(x, ps[:1], [1, 2], [0, 0])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample(x[0], ps, [1, 2], [0, 0])
    with pytest.raises(ValueError, match="vocab_size"):
        sample(x, ps, [1, 2], [0, 0], vocab_size=11)
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        sample(x, ps, [1, -2], [0, 0])
    with pytest.raises(ValueError, match=r"positions\[0\]"):
        sample(x, ps, [1, 2], [-1, 0])
    with pytest.raises(TypeError, match=r"params\[1\]"):
        sample(x, [ps[0], {"temperature": 1.0}], [1, 2], [0, 0])  # type: ignore[list-item]
    tok, lp = sample(torch.randn(0, 10), [], [], [])
    assert tok.shape == (0,) and tok.dtype == torch.int64 and lp.shape == (0,) and lp.dtype == torch.float32


# ----------------------------------------------------------------------------- fixed-order pieces


@pytest.mark.parametrize("n", [1, 2, 7, 64, 100, 1000, 3001])
def test_inclusive_scan_accuracy_and_prefix_property(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.rand(3, n, generator=g)
    got = S._inclusive_scan(x)
    ref = torch.cumsum(x.double(), -1)
    # each prefix is a tree of depth <= ceil(log2 n) over non-negative terms: |err| <= depth*u*sum;
    # a wrong bracket (a dropped or doubled term) is off by a whole element, ~0.5 on average.
    depth = max(n - 1, 0).bit_length()
    assert ((got.double() - ref).abs() <= depth * U32 * ref + 1e-30).all()
    for p in (1, n // 3, n - 1):
        if p >= 1:
            assert torch.equal(S._inclusive_scan(x[:, :p]), got[:, :p])  # prefix scans are prefixes
    assert torch.equal(S._inclusive_scan(x[1:2]), got[1:2])  # one row alone


def test_order_key_is_z_desc_index_asc() -> None:
    z = torch.tensor([[0.0, -0.0, 1.0, -1.0, -0.0, 1.0, -2.0, 3e38, -3e38, 1e-45, -1e-45, 0.5]])
    g = torch.Generator().manual_seed(11)
    z = torch.cat([z, torch.randint(-3, 4, (1, 12), generator=g).float() / 2])  # many ties
    want = torch.sort(z, dim=-1, descending=True, stable=True).indices
    for w in (1, 5, 12):
        assert torch.equal(S._order_key(z).topk(w, dim=-1, sorted=True).indices, want[:, :w])
