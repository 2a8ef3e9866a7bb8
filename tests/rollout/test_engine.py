"""The engine's contract: a request's tokens and log-probs are bitwise identical whatever else ran
with it, however its prefill was chunked, whether it was preempted or served from the prefix cache,
and every recorded log-prob equals the trainer-side sequence forward's."""
import pytest
import torch

from zmrl.kernels_batch_invariant.logprob import token_logprobs
from zmrl.model import ModelConfig, build_model, cu_seqlens_from_lens, forward_packed
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return build_model(ModelConfig.preset("tiny"), seed=0, dtype=request.param).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    base = torch.randint(0, 2048, (150,), generator=g).tolist()
    # lengths: crossing a block boundary while decoding, straddling a KDA chunk, longer than
    # index_topk, and two sharing a 128-token prefix
    return [
        torch.randint(0, 2048, (60,), generator=g).tolist(),
        torch.randint(0, 2048, (70,), generator=g).tolist(),
        base,
        base[:128] + torch.randint(0, 2048, (33,), generator=g).tolist(),
    ]


SAMPLING = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3),
            SamplingParams(temperature=0.6, top_p=0.9, max_tokens=MAX_TOKENS, seed=4),
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=MAX_TOKENS, seed=5)]


def _key(outs):
    return {o.request_id: (o.token_ids, o.logprobs) for o in outs}


def _assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for rid in a:
        assert a[rid][0] == b[rid][0], f"{what}: request {rid} tokens differ"
        assert torch.equal(a[rid][1], b[rid][1]), f"{what}: request {rid} log-probs differ"


@pytest.fixture(scope="module")
def alone(model, prompts):
    out = {}
    for i, (p, sp) in enumerate(zip(prompts, SAMPLING)):
        engine = RolloutEngine(model, EngineConfig(num_blocks=32, enable_prefix_caching=False))
        out.update(_key(engine.generate([p], [sp], request_ids=[str(i)])))
    return out


def test_together_equals_alone(model, prompts, alone):
    engine = RolloutEngine(model, EngineConfig(num_blocks=32))
    outs = engine.generate(prompts, SAMPLING)
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    _assert_same(_key(outs), alone, "batched")


def test_staggered_arrivals_and_chunked_prefill(model, prompts, alone):
    engine = RolloutEngine(model, EngineConfig(num_blocks=32, max_num_batched_tokens=37, enable_prefix_caching=False))
    outs, pending = [], list(enumerate(zip(prompts, SAMPLING)))[::-1]
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, (p, sp) = pending.pop()
            engine.add_request(str(i), p, sp)
        outs += engine.step()
        step += 1
    _assert_same(_key(outs), alone, "staggered + chunked prefill (budget 37)")


def test_preemption_recompute(model, prompts, alone):
    # 9 blocks of 64 hold all four prompts (1 + 2 + 3 + 3); the 60-token one needs a 10th block
    # when its decode crosses position 64, so the newest request is preempted and recomputed.
    engine = RolloutEngine(model, EngineConfig(num_blocks=9, enable_prefix_caching=False))
    outs = engine.generate(prompts, SAMPLING)
    assert engine.num_preemptions > 0
    _assert_same(_key(outs), alone, "preemption")


def test_prefix_cache_hits(model, prompts, alone):
    engine = RolloutEngine(model, EngineConfig(num_blocks=32, enable_prefix_caching=True))
    first = engine.generate([prompts[2]], [SAMPLING[2]], request_ids=["2"])
    hits_before = engine.blocks.hits
    second = engine.generate([prompts[3], prompts[2]], [SAMPLING[3], SAMPLING[2]], request_ids=["3", "2"])
    assert engine.blocks.hits - hits_before >= 3  # 2 blocks of the shared prefix + 2 of the repeat
    _assert_same(_key(first), {"2": alone["2"]}, "first run")
    _assert_same(_key(second), {k: alone[k] for k in ("2", "3")}, "served from the prefix cache")


def test_recorded_logprobs_equal_sequence_forward(model, prompts):
    engine = RolloutEngine(model, EngineConfig(num_blocks=32))
    outs = engine.generate(prompts, SAMPLING)
    seqs = [torch.tensor(o.prompt_token_ids + o.token_ids[:-1]) for o in outs]
    with torch.no_grad():
        logits = forward_packed(model, torch.cat(seqs), cu_seqlens_from_lens([s.numel() for s in seqs]))
    for o, rows in zip(outs, logits.split([s.numel() for s in seqs])):
        resp = rows[len(o.prompt_token_ids) - 1:]
        lp = token_logprobs(resp, torch.tensor(o.token_ids), o.temperature)
        assert torch.equal(lp, o.logprobs), f"request {o.request_id}"


def test_n_samples_share_prompt(model, prompts):
    engine = RolloutEngine(model, EngineConfig(num_blocks=32))
    outs = engine.generate([prompts[1]], [SamplingParams(temperature=1.0, max_tokens=6, seed=1, n=3)])
    assert [o.request_id for o in outs] == ["0-0", "0-1", "0-2"]
    assert len({tuple(o.token_ids) for o in outs}) > 1, "siblings drew identical samples"
    assert [o.sample_index for o in outs] == [0, 1, 2]
    # sample 0 is the request with n = 1; each sibling is the same sample of the request run again in a
    # fresh engine under another request id (randomness is keyed on seed and sample index, not ids)
    solo = RolloutEngine(model, EngineConfig(num_blocks=32)).generate(
        [prompts[1]], [SamplingParams(temperature=1.0, max_tokens=6, seed=1)], request_ids=["other"])[0]
    assert solo.token_ids == outs[0].token_ids and torch.equal(solo.logprobs, outs[0].logprobs)
    again = RolloutEngine(model, EngineConfig(num_blocks=32)).generate(
        [prompts[1]], [SamplingParams(temperature=1.0, max_tokens=6, seed=1, n=3)], request_ids=["x"])
    for o, a in zip(outs, again):
        assert a.token_ids == o.token_ids and torch.equal(a.logprobs, o.logprobs)


def test_stop_tokens(model, prompts):
    engine = RolloutEngine(model, EngineConfig(num_blocks=32))
    ref = engine.generate([prompts[0]], [SamplingParams(temperature=0.0, max_tokens=8)])[0]
    stop = ref.token_ids[3]
    out = engine.generate([prompts[0]], [SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop,))])[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: ref.token_ids.index(stop) + 1]


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1, 2, 99999], SamplingParams(), "token id 99999 is out of range"),
    ([1] * 5000, SamplingParams(), "prompt has 5000 tokens"),
])
def test_bad_input(model, prompt, params, match):
    engine = RolloutEngine(model, EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt], [params])


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_that_never_fits_errors_alone(model, prompts):
    engine = RolloutEngine(model, EngineConfig(num_blocks=3, enable_prefix_caching=False))
    outs = engine.generate([prompts[0], prompts[2]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=100)])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 2
    assert outs[1].finish_reason == "error" and "num_blocks=3" in outs[1].error


def test_nonfinite_logits_finish_that_request_only(model, prompts, alone, monkeypatch):
    """A request whose logits row turns non-finite finishes with an error at that step; the others' tokens and
    log-probs are what they are alone (the step's draw is fetched in one transfer, the flags with it)."""
    engine = RolloutEngine(model, EngineConfig(num_blocks=32, enable_prefix_caching=False, decode_graphs="off"))
    real = model.compute_logits
    calls = {"n": 0}

    def poisoned(hidden):
        logits = real(hidden)
        calls["n"] += 1
        if calls["n"] == 4:  # a decode step with every request running: request "1" is row 1 (arrival order)
            logits = logits.clone()
            logits[1, 7] = float("nan")
        return logits

    monkeypatch.setattr(model, "compute_logits", poisoned)
    outs = {o.request_id: o for o in engine.generate(prompts, SAMPLING)}
    bad = outs["1"]
    assert bad.finish_reason == "error" and "non-finite logits for request '1'" in bad.error
    assert bad.token_ids == alone["1"][0][: len(bad.token_ids)] and len(bad.token_ids) < MAX_TOKENS
    for rid in ("0", "2", "3"):
        assert outs[rid].finish_reason == "length"
        assert outs[rid].token_ids == alone[rid][0] and torch.equal(outs[rid].logprobs, alone[rid][1])
