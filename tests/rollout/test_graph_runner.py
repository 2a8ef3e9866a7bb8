"""Decode through the fixed-shape path (zmrl/rollout/graph_runner.py) gives the same tokens and
log-probs, bit for bit, as the eager varlen path, however the batch is padded, whether a 64-token
KDA chunk completes during static decode, across preemption, prefix-cache hits, forks and
staggered arrivals.

``decode_graphs="static"`` runs the captured code without capture (CPU CI); on a GPU the same tests
run with ``"cuda"`` (capture + replay), selected by ``ZMRL_TEST_DEVICE=cuda``.
"""
from __future__ import annotations

import pytest
import torch

from zmrl.model import ModelConfig, build_model
from zmrl.model.context import KDASeqState, SequenceState
from zmrl.model.kda_pool import KDAStatePool
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.rollout.graph_runner import DecodeGraphRunner, buckets, bucket_of

from tests.device import ON_CUDA, TEST_DEVICE
from tests.rollout.trainer_recompute import assert_trainer_logprobs_equal

GRAPHS = "cuda" if ON_CUDA else "static"
MAX_TOKENS = 70  # crosses a 64-token chunk boundary while decoding for every prompt below


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return build_model(ModelConfig.preset("tiny"), seed=0, dtype=request.param, device=TEST_DEVICE).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 2048, (130,), generator=g).tolist()
    # 1 token (decode from the first step), a chunk boundary right at the prompt end (64), mid-chunk
    # lengths, longer than index_topk (sparse DSA), and a shared 128-token prefix
    return [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (1, 64, 37, 100)] + [
        base, base[:128] + torch.randint(0, 2048, (9,), generator=g).tolist()]


def _params(n: int, max_tokens: int = MAX_TOKENS) -> list[SamplingParams]:
    kinds = [dict(temperature=1.0), dict(temperature=0.6, top_p=0.9), dict(temperature=0.0),
             dict(temperature=1.0, top_k=20)]
    return [SamplingParams(max_tokens=max_tokens, seed=10 + i, **kinds[i % len(kinds)]) for i in range(n)]


def _run(model, prompts, params, ids=None, **cfg) -> tuple[dict, RolloutEngine]:
    cfg.setdefault("num_blocks", 48)
    engine = RolloutEngine(model, EngineConfig(**cfg))
    outs = engine.generate(prompts, params, request_ids=ids)
    return {o.request_id: (o.token_ids, o.logprobs, o.finish_reason) for o in outs}, engine


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][2] == b[rid][2], f"request {rid}: finish reason differs"
        assert a[rid][0] == b[rid][0], f"request {rid}: tokens differ"
        assert torch.equal(a[rid][1], b[rid][1]), f"request {rid}: log-probs differ"


@pytest.fixture(scope="module")
def eager(model, prompts):
    out, _ = _run(model, prompts, _params(len(prompts)), decode_graphs="off")
    return out


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_of(3, buckets(6)) == 4 and bucket_of(5, buckets(6)) == 6
    # chosen sizes: those below the limit, sorted and unique, then the limit itself
    assert buckets(256, [24, 8, 1, 16, 8, 300, 256]) == [1, 8, 16, 24, 256]
    assert buckets(6, [4]) == [4, 6] and bucket_of(2, buckets(6, [4])) == 4


def test_static_decode_equals_eager(model, prompts, eager):
    out, engine = _run(model, prompts, _params(len(prompts)), decode_graphs=GRAPHS)
    _assert_same(eager, out)
    assert engine.graphs.free_slots and not engine.graphs.slot_of  # every slot given back


def test_padding_buckets_and_alone(model, prompts, eager):
    """max_num_seqs 3 gives buckets 1, 2, 3 (batches padded to them as requests finish) and queues the rest;
    one request at a time runs batch 1 only: both equal the eager batch."""
    out, _ = _run(model, prompts, _params(len(prompts)), decode_graphs=GRAPHS, max_num_seqs=3)
    _assert_same(eager, out)
    for i, p in enumerate(prompts[:2]):
        alone, _ = _run(model, [p], _params(len(prompts))[i:i + 1], ids=[str(i)], decode_graphs=GRAPHS)
        _assert_same({str(i): eager[str(i)]}, alone)


def test_chosen_batch_buckets(model, prompts, eager):
    """EngineConfig.decode_graph_batch_sizes: batches run at the chosen buckets (here 2 and 5, a one-row batch
    padded to 2), with the eager batch's tokens and log-probs."""
    out, engine = _run(model, prompts, _params(len(prompts)), decode_graphs=GRAPHS, max_num_seqs=5,
                       decode_graph_batch_sizes=(2,))
    assert engine.graphs.batch_sizes == [2, 5]
    assert sorted(engine.graphs._inputs) == [2, 5]  # both buckets ran
    _assert_same(eager, out)


def test_preemption_forks_and_staggered_arrivals(model, prompts):
    """A cache too small for everything (preemption by recompute), n = 2 forks, prefix-cache hits and
    requests arriving while others decode (mixed prefill + static-decode steps)."""
    params = [SamplingParams(max_tokens=40, seed=7, n=2, temperature=1.0)] + _params(3, 40)
    chosen = [prompts[4], prompts[5], prompts[2], prompts[0]]

    def drive(graphs: str) -> tuple[dict, RolloutEngine]:
        engine = RolloutEngine(model, EngineConfig(num_blocks=6, decode_graphs=graphs, max_num_batched_tokens=64))
        outs, step, nxt = [], 0, 0
        while nxt < len(chosen) or engine.has_unfinished_requests():
            if nxt < len(chosen) and step >= 2 * nxt:
                engine.add_request(str(nxt), chosen[nxt], params[nxt])
                nxt += 1
            outs += engine.step()
            step += 1
        return {o.request_id: (o.token_ids, o.logprobs, o.finish_reason) for o in outs}, engine

    ref, ref_engine = drive("off")
    out, engine = drive(GRAPHS)
    _assert_same(ref, out)
    assert engine.num_preemptions > 0, "the scenario must preempt"
    assert not engine.graphs.slot_of and len(engine.graphs.free_slots) == engine.config.max_num_seqs


def test_logprobs_equal_trainer_forward(model, prompts, eager):
    """The trainer's packed forward recomputes every static-decode log-prob bit for bit."""
    engine = RolloutEngine(model, EngineConfig(num_blocks=48, decode_graphs=GRAPHS))
    assert_trainer_logprobs_equal(model, engine.generate(prompts, _params(len(prompts))), TEST_DEVICE)


def test_pool_load_store_round_trip(model):
    cfg = model.config
    pool = KDAStatePool(model, num_slots=2, device=TEST_DEVICE)
    g = torch.Generator().manual_seed(0)
    seq = SequenceState(num_tokens=64 * 3 + 5)
    for key, lp in pool.layers.items():
        rnd = lambda t: torch.randn(t.shape[1:], generator=g).to(t)  # noqa: E731
        seq.kda[key] = KDASeqState(conv=rnd(lp.conv), state=rnd(lp.state),
                                   pending=tuple(rnd(b)[:5] for b in lp.pending))
    before = {k: (s.conv.clone(), s.state.clone(), tuple(t.clone() for t in s.pending)) for k, s in seq.kda.items()}
    pool.load(seq, 1)
    seq.kda.clear()
    pool.store(seq, 1)
    for k, (conv, state, pending) in before.items():
        s = seq.kda[k]
        assert torch.equal(s.conv, conv) and torch.equal(s.state, state)
        assert all(torch.equal(a, b) for a, b in zip(s.pending, pending))
    bad = SequenceState(num_tokens=3, kda={next(iter(pool.layers)): KDASeqState(pending=before[k][2])})
    with pytest.raises(RuntimeError, match="pending rows"):
        pool.load(bad, 0)
    assert cfg.num_hidden_layers > len(pool.layers) > 0


def test_config_validation():
    with pytest.raises(ValueError, match="decode_graphs"):
        EngineConfig(decode_graphs="yes").validate()
    for sizes in ((), (0, 4), (2.5,), (True,), 16, (65,)):  # 65 > max_num_seqs (64)
        with pytest.raises(ValueError, match="decode_graph_batch_sizes"):
            EngineConfig(decode_graph_batch_sizes=sizes).validate()
    tiny = build_model(ModelConfig.preset("tiny"), seed=0, device=TEST_DEVICE)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA device"):
            RolloutEngine(tiny, EngineConfig(decode_graphs="cuda"))
    # "auto" (the default): graphs for a model on a GPU, eager decode on CPU
    engine = RolloutEngine(tiny, EngineConfig())
    assert (engine.graphs is not None and engine.graphs.mode == "cuda") if ON_CUDA else engine.graphs is None
    # models sharded by zmrl.parallel decode eagerly: "auto" turns graphs off, an explicit mode is refused
    tiny.parallel_config = object()
    try:
        assert RolloutEngine(tiny, EngineConfig()).graphs is None
        with pytest.raises(ValueError, match="sharded by zmrl.parallel"):
            RolloutEngine(tiny, EngineConfig(decode_graphs="static"))
    finally:
        del tiny.parallel_config


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("latent_format", ["native", "fp8"])
def test_static_step_has_no_host_sync(prompts, latent_format):
    """What CUDA-graph capture needs: the fixed-shape step (sparse DSA past index_topk, MoE, KDA) runs
    with synchronising CUDA calls turned into errors."""
    model = build_model(ModelConfig.preset("tiny"), seed=0, dtype="bfloat16", device="cuda").eval()
    engine = RolloutEngine(model, EngineConfig(num_blocks=48, decode_graphs="static", latent_format=latent_format))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, seed=i))
    while engine.waiting or any(r.num_computed < r.num_tokens - 1 for r in engine.running):
        engine.step()
    engine.step()  # one static step: every running request now holds a pool slot
    reqs = engine.running
    assert reqs and all(r.request_id in engine.graphs.slot_of for r in reqs)
    runner = engine.graphs
    bs = bucket_of(len(reqs), runner.batch_sizes)
    pages = bucket_of(max(len(r.seq.pages) for r in reqs), runner.page_counts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            runner._forward(bs, pages)
            runner._forward(bs, pages, 1.0)  # with the in-graph draw and its log-probs
            runner._forward(bs, pages, 0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_static_inputs_equal_a_rebuild_from_the_requests():
    """The decode step's static buffers (ids, positions, cache slots, pool slots, block table) are written
    incrementally (persistent per-slot block-table rows, one tensor per field): over random steps with page
    appends, page lists replaced, requests leaving and joining and bucket changes, they equal the buffers
    rebuilt from scratch from the requests."""
    import random

    from zmrl.model.cache import latent_store
    from zmrl.rollout.request import Request

    model = build_model(ModelConfig.preset("tiny"), seed=0, dtype="float32").eval()
    ps, scratch, max_seqs, max_pages = 64, 200, 6, 10
    store = latent_store(model.config, scratch + 1, ps)
    runner = DecodeGraphRunner(model, store, scratch_page=scratch, max_num_seqs=max_seqs, max_pages=max_pages,
                               mode="static")
    runner.pool.load = lambda seq, slot: None  # pool contents are not what this test is about
    seen = {}
    runner._forward = lambda bs, pages, temperature: seen.update(bs=bs, pages=pages) or (torch.zeros(bs, 4), None)
    rng = random.Random(0)
    free_pages = list(range(scratch))
    rng.shuffle(free_pages)

    def new_request(i):
        r = Request(f"r{i}", [rng.randrange(2048) for _ in range(rng.randrange(1, 300))], SamplingParams())
        r.output = [rng.randrange(2048) for _ in range(rng.randrange(0, 5))]
        r.seq = SequenceState(num_tokens=r.num_tokens - 1)
        ahead = rng.choice([0, 0, 1, 2])  # pages allocated ahead of the position (a prefill budget)
        r.seq.pages.extend(free_pages.pop() for _ in range(-(-r.num_tokens // ps) + ahead))
        return r

    live = [new_request(i) for i in range(3)]
    for step in range(120):
        op = rng.random()
        if op < 0.15 and len(live) > 1:  # a request leaves (finished / preempted) and gives its pages back
            gone = live.pop(rng.randrange(len(live)))
            runner.release(gone.request_id)
            free_pages.extend(gone.seq.pages)
        elif op < 0.3 and len(live) < max_seqs:
            live.insert(rng.randrange(len(live) + 1), new_request(step + 10))
        elif op < 0.4:  # a page list replaced by a new list, as long or shorter (down to the pages in use)
            r = rng.choice(live)
            old = r.seq.pages
            r.seq.pages = [free_pages.pop() for _ in range(rng.randint(-(-r.num_tokens // ps), len(old)))]
            free_pages.extend(old)
        batch = [r for r in live if len(r.seq.pages) <= max_pages]
        if not batch or not runner.accepts(batch):
            continue
        runner.run(batch)
        bs, pages = seen["bs"], seen["pages"]
        want = torch.tensor([[0, 0, scratch * ps, runner.pool.scratch_slot]] * bs).T.contiguous()
        want_bt = torch.full((bs, pages), scratch, dtype=torch.int64)
        for i, r in enumerate(batch):
            pos = r.num_computed
            want[:, i] = torch.tensor([r.token_at(pos), pos, r.seq.pages[pos // ps] * ps + pos % ps,
                                       runner.slot_of[r.request_id]])
            want_bt[i, : len(r.seq.pages)] = torch.tensor(r.seq.pages)
        assert torch.equal(runner._static_inputs(bs)[:4], want), f"step {step}: static inputs differ"
        assert torch.equal(runner._block_tables[(bs, pages)][0], want_bt), f"step {step}: block table differs"
        for r in batch:  # the step's token is computed; the sampled one is appended, pages grow when full
            r.seq.num_tokens += 1
            r.output.append(rng.randrange(2048))
            if r.num_tokens > len(r.seq.pages) * ps:
                r.seq.pages.append(free_pages.pop())


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_in_graph_draw_equals_eager(model, prompts, temperature):
    """RL-shaped requests (one temperature, no top-k / top-p, n = 2 forks, prefix caching) draw inside the decode
    graph (EngineConfig.sample_in_graph): the same tokens and log-probs as the eager engine, and the graph did
    draw them. (Temperature 1 takes the same path without the division; the other tests here run the graph
    with the eager sampler, their mixed requests not sharing one plain temperature.)"""
    # prompts of 37 and 100 tokens: both cross a 64-token chunk boundary while decoding
    params = [SamplingParams(max_tokens=36, seed=20 + i, temperature=temperature, n=2) for i in range(2)]
    chosen = prompts[2:4]
    ref, _ = _run(model, chosen, params, decode_graphs="off")
    engine = RolloutEngine(model, EngineConfig(num_blocks=48, decode_graphs=GRAPHS, sample_in_graph=True))
    drawn = []
    run = engine.graphs.run
    engine.graphs.run = lambda reqs, t=None: drawn.append(t) or run(reqs, t)
    outs = engine.generate(chosen, params)
    _assert_same(ref, {o.request_id: (o.token_ids, o.logprobs, o.finish_reason) for o in outs})
    assert drawn and all(t == temperature for t in drawn), drawn
