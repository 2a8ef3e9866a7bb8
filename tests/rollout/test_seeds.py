"""Sampling is keyed on what the user controls: (seed, sample index within the request, position).
The same request with the same seed samples the same tokens and log-probs alone or anywhere among
other requests (whatever request id the engine gives it); the n samples of a request differ by their
index; a request without a seed gets one drawn by the engine, recorded on the output, and replaying
with it repeats the tokens."""
from __future__ import annotations

import pytest
import torch

from zmrl.model import ModelConfig, build_model
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams

from tests.device import TEST_DEVICE


@pytest.fixture(scope="module")
def engine():
    model = build_model(ModelConfig.preset("tiny"), seed=0, device=TEST_DEVICE)
    return RolloutEngine(model, EngineConfig(num_blocks=64, max_num_seqs=16))


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_same_seed_same_tokens_wherever_the_request_sits(engine):
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    target = torch.randint(0, vocab, (7,), generator=g).tolist()
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6, seed=1234)
    others = [(torch.randint(0, vocab, (int(n),), generator=g).tolist(),
               SamplingParams(temperature=0.8, max_tokens=int(m), seed=int(s), n=int(k)))
              for n, m, s, k in zip([3, 12, 7, 5, 20], [2, 6, 4, 8, 3], [1234, 5, 6, 7, 8], [1, 2, 1, 1, 3])]
    alone = engine.generate([target], [sp])[0]
    assert len(alone.token_ids) == 6 and alone.seed == 1234
    for count in (1, 2, len(others)):
        for where in ("first", "last", "middle"):
            rest = others[:count]
            at = {"first": 0, "last": count, "middle": count // 2}[where]
            batch = rest[:at] + [(target, sp)] + rest[at:]
            outs = engine.generate([p for p, _ in batch], [s for _, s in batch])
            mine = [o for o in outs if o.request_id == str(at)]
            assert len(mine) == 1 and _same(mine[0], alone), (count, where)


def test_n_samples_differ_by_index_and_sample_zero_is_the_single_request(engine):
    prompt = [5, 9, 2, 7]
    outs = engine.generate([prompt], [SamplingParams(max_tokens=8, seed=77, n=4)])
    assert [o.sample_index for o in outs] == [0, 1, 2, 3] and {o.seed for o in outs} == {77}
    assert len({tuple(o.token_ids) for o in outs}) > 1, "the n samples must not share their noise"
    single = engine.generate([prompt], [SamplingParams(max_tokens=8, seed=77)])[0]
    assert _same(single, outs[0])
    again = engine.generate([[1, 2], prompt], [SamplingParams(max_tokens=3, seed=1),
                                                SamplingParams(max_tokens=8, seed=77, n=4)])
    assert all(_same(a, b) for a, b in zip(again[1:], outs))


def test_a_group_as_one_request_or_one_request_per_sample_samples_the_same(engine):
    """n samples in one request (zmrl's RL loop) == n one-sample requests with the same seed and
    first_sample_index 0 .. n-1 (verl's rollout sends one request per sample), in any order."""
    prompt = [4, 8, 15, 16, 23]
    group = engine.generate([prompt], [SamplingParams(max_tokens=8, seed=91, n=4)])
    assert len({tuple(o.token_ids) for o in group}) > 1
    singles = engine.generate([prompt] * 4, [SamplingParams(max_tokens=8, seed=91, first_sample_index=j)
                                             for j in (2, 0, 3, 1)])
    by_index = {o.sample_index: o for o in singles}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert all(_same(by_index[j], group[j]) for j in range(4))
    # an offset group continues the numbering: samples 2, 3 of the group of 4
    tail = engine.generate([prompt], [SamplingParams(max_tokens=8, seed=91, n=2, first_sample_index=2)])
    assert [o.sample_index for o in tail] == [2, 3] and all(_same(a, b) for a, b in zip(tail, group[2:]))


def test_no_seed_draws_one_and_replaying_it_repeats(engine):
    prompt = [3, 1, 4, 1, 5]
    first, second = engine.generate([prompt, prompt], SamplingParams(max_tokens=6))
    assert isinstance(first.seed, int) and 0 <= first.seed < 1 << 63
    assert first.seed != second.seed, "each request without a seed gets its own"
    for out in (first, second):
        replay = engine.generate([[8, 8], prompt], [SamplingParams(max_tokens=2, seed=3),
                                                    SamplingParams(max_tokens=6, seed=out.seed)])[1]
        assert _same(replay, out) and replay.seed == out.seed
