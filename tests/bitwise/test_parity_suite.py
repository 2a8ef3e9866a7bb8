"""The bitwise parity suite (docs/numerics.md): every log-prob the rollout engine records equals, bit for
bit, the one the trainer recomputes with autograd enabled, however the engine scheduled the request
and however the trainer packs its micro-batches.

Set-up: the tiny preset in fp32 and bf16, LoRA r=32 with a non-zero B on every attention projection
and expert; the engine runs on a deepcopy of the trainer's model (two objects, as in a real
deployment). Each engine scenario runs once per dtype; all their sequences form one pool that the
trainer recomputes under several micro-batch sizes, packing orders and thread counts (one pass per
variant over the whole pool, which is what a trainer step sees: other scenarios' sequences become
micro-batch neighbours). Each scenario's test then checks its own sequences in every variant.

The mixed-sampling, greedy and long-prompt checks are per-request properties, so they ride on the
16-request batch (which mixes them) rather than paying for separate engine runs.

The device comes from ``ZMRL_TEST_DEVICE`` (tests/device.py; default cpu): with ``cuda`` the whole
suite runs on the GPU, through the Triton backend wherever an op has one. The thread-count test is
CPU-only.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from zmrl.lora import LoraConfig, apply_lora, lora_state_dict
from zmrl.model import ModelConfig, build_model
from zmrl.parity import compare_logprobs
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import compute_logprobs, make_optimizer

from tests.device import TEST_DECODE_GRAPHS, TEST_DEVICE, cpu_only

MAX_TOKENS = 8
BLOCK = 64
CFG = ModelConfig.preset("tiny")
TOPK = CFG.index_topk  # 64: prompts longer than this make the DSA selection sparse
VOCAB = CFG.vocab_size

# the sampling mix: (temperature, top_p, top_k)
PLAIN, NUCLEUS, TOPK20, GREEDY, BOTH = (1.0, 1.0, -1), (0.6, 0.9, -1), (1.0, 1.0, 20), (0.0, 1.0, -1), (0.6, 0.9, 20)
MIX = [PLAIN, NUCLEUS, TOPK20, GREEDY, BOTH]


def sp(kind: tuple, seed: int, n: int = 1, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    t, p, k = kind
    return SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=max_tokens, seed=seed, n=n)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# ----------------------------------------------------------------------------- engine scenarios


@dataclass
class Run:
    outs: list = field(default_factory=list)
    params: dict = field(default_factory=dict)  # request id -> SamplingParams
    engine: RolloutEngine | None = None
    error: BaseException | None = None


def _engine(model, **cfg) -> RolloutEngine:
    cfg.setdefault("num_blocks", 48)
    cfg.setdefault("decode_graphs", TEST_DECODE_GRAPHS)
    return RolloutEngine(copy.deepcopy(model), EngineConfig(**cfg))


def _params_by_id(ids: list[str], params: list[SamplingParams]) -> dict:
    out = {}
    for rid, p in zip(ids, params):
        for j in range(p.n):
            out[rid if p.n == 1 else f"{rid}-{j}"] = p
    return out


def _generate(engine, prompts, params, ids=None) -> Run:
    ids = ids or [str(i) for i in range(len(prompts))]
    outs = engine.generate(prompts, params, request_ids=ids)
    return Run(outs, _params_by_id(ids, params), engine)


def scenario_single(model) -> Run:
    # 97 tokens: past the first KDA chunk / cache block, and longer than index_topk
    return _generate(_engine(model), _prompts(1, [97]), [sp(PLAIN, 11)])


BATCH16_LENGTHS = [1, 3, 17, 33, 50, 63, 64, 65, 90, 110, 127, 128, 129, 160, 185, 200]


def batch16_params() -> list[SamplingParams]:
    return [sp(MIX[i % len(MIX)], 100 + i) for i in range(len(BATCH16_LENGTHS))]


def scenario_batch16(model) -> Run:
    return _generate(_engine(model), _prompts(2, BATCH16_LENGTHS), batch16_params())


def _drive(engine, prompts, params, arrivals) -> Run:
    """Submit request i at engine step ``arrivals[i]`` (continuous batching with staggered arrivals)."""
    ids = [str(i) for i in range(len(prompts))]
    outs, step, nxt = [], 0, 0
    while nxt < len(prompts) or engine.has_unfinished_requests():
        while nxt < len(prompts) and arrivals[nxt] <= step:
            engine.add_request(ids[nxt], prompts[nxt], params[nxt])
            nxt += 1
        outs += engine.step()
        step += 1
    return Run(sorted(outs, key=lambda o: int(o.request_id)), _params_by_id(ids, params), engine)


def scenario_staggered(model) -> Run:
    prompts = _prompts(3, [40, 75, 20, 130, 66])
    params = [sp(MIX[i], 200 + i) for i in range(5)]
    return _drive(_engine(model), prompts, params, arrivals=[0, 1, 3, 4, 7])


def _chunked(model, budget: int, lengths: list[int], seed: int) -> Run:
    prompts = _prompts(seed, lengths)
    return _generate(_engine(model, max_num_batched_tokens=budget), prompts,
                     [sp(MIX[i + 1], seed * 10 + i) for i in range(len(prompts))])


def scenario_chunked13(model) -> Run:
    return _chunked(model, 13, [30, 70, 101], seed=4)


def scenario_chunked37(model) -> Run:
    return _chunked(model, 37, [45, 99, 150], seed=5)


def scenario_prefix(model) -> Run:
    base, extra = _prompts(6, [140, 60])
    prompts = [base + extra[:10], base[:130] + extra[10:30], base + extra[30:35], base[:128] + extra[35:36]]
    params = [sp(MIX[i], 300 + i) for i in range(4)]
    engine = _engine(model, enable_prefix_caching=True)
    first = _generate(engine, prompts[:1], params[:1], ids=["0"])  # publishes the shared blocks
    rest = _generate(engine, prompts[1:], params[1:], ids=["1", "2", "3"])
    return Run(first.outs + rest.outs, {**first.params, **rest.params}, engine)


def scenario_preemption(model) -> Run:
    # 1 + 2 + 3 + 3 = 9 blocks of 64 hold the four prompts; the 60-token one needs a 10th block when
    # its decode reaches position 64, so a running request is preempted and recomputed later
    prompts = _prompts(7, [60, 70, 150, 161])
    params = [sp(MIX[i], 400 + i) for i in range(4)]
    return _generate(_engine(model, num_blocks=9), prompts, params)


def scenario_fork(model) -> Run:
    prompts = _prompts(8, [70, 20])
    return _generate(_engine(model), prompts, [sp(PLAIN, 500, n=3), sp(TOPK20, 501, n=2)])


def scenario_fp8(model) -> Run:
    prompts = _prompts(9, [30, 70, 130, 190])
    params = [sp(MIX[i], 600 + i) for i in range(4)]
    return _generate(_engine(model, latent_format="fp8"), prompts, params)


NATIVE_SCENARIOS: dict[str, Callable] = {
    "single": scenario_single, "batch16": scenario_batch16, "staggered": scenario_staggered,
    "chunked13": scenario_chunked13, "chunked37": scenario_chunked37, "prefix": scenario_prefix,
    "preemption": scenario_preemption, "fork": scenario_fork,
}
FP8_SCENARIOS: dict[str, Callable] = {"fp8": scenario_fp8}


# ----------------------------------------------------------------------------- trainer variants


@dataclass
class Variant:
    name: str
    micro_batch_tokens: int | None
    order: str  # natural | reversed | shuffled
    threads: int | None = None  # torch.set_num_threads during the trainer pass (None: leave as is)


VARIANTS = [
    Variant("one packed batch", None, "natural"),
    Variant("micro 37, reversed", 37, "reversed"),
    Variant("one sequence per batch, shuffled", 1, "shuffled"),
]
# the engine runs single-threaded (see _one_thread); this trainer pass uses two threads
OTHER_THREADS = Variant("one packed batch, shuffled, 2 threads", None, "shuffled", threads=2)


def _order(n: int, how: str, seed: int) -> list[int]:
    order = list(range(n))
    if how == "reversed":
        order.reverse()
    elif how == "shuffled":
        random.Random(seed).shuffle(order)
    return order


def trainer_pass(model, outs, variant: Variant, latent_format: str = "native", seed: int = 0) -> list[torch.Tensor]:
    """compute_logprobs (autograd enabled, as in training) over ``outs``; detached results."""
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    old = torch.get_num_threads()
    if variant.threads is not None:
        torch.set_num_threads(variant.threads)
    try:
        with torch.enable_grad():
            lps = compute_logprobs(model, seqs, [len(o.prompt_token_ids) for o in outs],
                                   [o.temperature for o in outs], micro_batch_tokens=variant.micro_batch_tokens,
                                   order=_order(len(seqs), variant.order, seed), latent_format=latent_format)
        assert all(lp.requires_grad for lp in lps), "trainer log-probs must carry autograd"
        return [lp.detach() for lp in lps]
    finally:
        torch.set_num_threads(old)


def assert_parity(outs, lps, what: str) -> None:
    """torch.equal on every sequence; the message names each differing sequence and first token."""
    assert len(outs) == len(lps), f"{what}: {len(outs)} rollouts vs {len(lps)} trainer results"
    bad = []
    for o, lp in zip(outs, lps):
        assert o.logprobs.dtype == torch.float32 and lp.dtype == torch.float32, f"{what}: dtypes"
        if lp.shape != o.logprobs.shape:
            bad.append(f"request {o.request_id}: {lp.numel()} trainer vs {o.logprobs.numel()} rollout tokens")
        elif not torch.equal(lp, o.logprobs):
            diff = (lp != o.logprobs).nonzero().reshape(-1)
            j = int(diff[0])
            bad.append(f"request {o.request_id} (prompt {len(o.prompt_token_ids)}, T={o.temperature}): "
                       f"{diff.numel()}/{lp.numel()} tokens differ, first token {j}: "
                       f"rollout {o.logprobs[j].item()!r} trainer {lp[j].item()!r}")
    if bad:
        report = compare_logprobs([o.logprobs for o in outs], lps, scenario=what)
        pytest.fail(f"{what}: log-prob mismatch\n  " + "\n  ".join(bad) + "\n" + report.table())


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Run the suite single-threaded. The ops are tiny, so a second intra-op thread buys nothing,
    and on a shared 2-core machine every op's thread rendezvous makes it several times slower.
    Parity across thread counts is still checked: test_other_thread_count uses two."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@dataclass
class World:
    dtype: str
    model: torch.nn.Module  # the trainer's model (never touched by an engine)
    runs: dict[str, Run]
    lps: dict[str, dict[str, list[torch.Tensor] | BaseException]]  # variant -> scenario -> per-sequence lps


def _run_all(model, scenarios: dict[str, Callable]) -> dict[str, Run]:
    runs = {}
    for name, fn in scenarios.items():
        try:
            runs[name] = fn(model)
        except Exception as e:  # reported by that scenario's test; the others still run
            runs[name] = Run(error=e)
    return runs


def _pool_variants(model, runs: dict[str, Run], latent_format: str) -> dict:
    names = [n for n, r in runs.items() if r.error is None]
    pool = [o for n in names for o in runs[n].outs]
    result: dict = {}
    for k, v in enumerate(VARIANTS):
        try:
            lps = trainer_pass(model, pool, v, latent_format, seed=k)
        except Exception as e:
            result[v.name] = {n: e for n in names}
            continue
        result[v.name], i = {}, 0
        for n in names:
            m = len(runs[n].outs)
            result[v.name][n] = lps[i:i + m]
            i += m
    return result


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def world(request) -> World:
    model = build_model(CFG, seed=0, dtype=request.param, device=TEST_DEVICE)
    apply_lora(model, LoraConfig(r=32, alpha=32.0, init_b_std=0.02))
    runs = _run_all(model, NATIVE_SCENARIOS)
    fp8_runs = _run_all(model, FP8_SCENARIOS)
    lps = _pool_variants(model, runs, "native")
    for vname, per in _pool_variants(model, fp8_runs, "fp8").items():
        lps[vname].update(per)
    return World(request.param, model, {**runs, **fp8_runs}, lps)


def _check_scenario(world: World, name: str, select: Callable | None = None) -> list:
    run = world.runs[name]
    if run.error is not None:
        raise run.error
    keep = [i for i, o in enumerate(run.outs) if select is None or select(o, run.params[o.request_id])]
    assert keep, f"{name}: the selection is empty"
    outs = [run.outs[i] for i in keep]
    for o in outs:
        assert o.finish_reason in ("length", "stop") and o.error is None, f"{name}: {o.request_id} {o.error}"
        assert len(o.token_ids) == o.logprobs.numel() >= 1
    for v in VARIANTS:
        got = world.lps[v.name][name]
        if isinstance(got, BaseException):
            raise got
        assert_parity(outs, [got[i] for i in keep], f"{world.dtype} {name} / trainer {v.name}")
    return outs


# ----------------------------------------------------------------------------- scenario tests


def test_one_request(world):
    outs = _check_scenario(world, "single")
    assert len(outs) == 1 and len(outs[0].token_ids) == MAX_TOKENS


def test_sixteen_together(world):
    outs = _check_scenario(world, "batch16")
    assert [o.request_id for o in outs] == [str(i) for i in range(16)]


@pytest.mark.parametrize("kind", [NUCLEUS, TOPK20, BOTH, PLAIN], ids=["T0.6-top_p0.9", "T1.0-top_k20",
                                                                     "T0.6-top_p0.9-top_k20", "T1.0"])
def test_temperature_top_p_top_k(world, kind):
    t, p, k = kind
    outs = _check_scenario(world, "batch16",
                           lambda o, prm: (prm.temperature, prm.top_p, prm.top_k) == (t, p, k))
    assert all(o.temperature == t for o in outs)


def test_greedy(world):
    outs = _check_scenario(world, "batch16", lambda o, prm: prm.greedy)
    assert len(outs) >= 3 and all(o.temperature == 0.0 for o in outs)


def test_prompts_longer_than_index_topk(world):
    outs = _check_scenario(world, "batch16", lambda o, prm: len(o.prompt_token_ids) > TOPK)
    assert max(len(o.prompt_token_ids) for o in outs) >= 200 and len(outs) >= 6


def test_staggered_arrivals(world):
    outs = _check_scenario(world, "staggered")
    assert len(outs) == 5


@pytest.mark.parametrize("name, budget", [("chunked13", 13), ("chunked37", 37)])
def test_chunked_prefill_odd_budget(world, name, budget):
    outs = _check_scenario(world, name)
    prefill = sum(len(o.prompt_token_ids) for o in outs)
    # the prompts alone need more steps than the budget allows in one: prefill really was chunked
    assert max(len(o.prompt_token_ids) for o in outs) > budget
    assert world.runs[name].engine.num_steps >= -(-prefill // budget)


def test_prefix_cache_hits(world):
    outs = _check_scenario(world, "prefix")
    assert all(o.prompt_token_ids[:128] == outs[0].prompt_token_ids[:128] for o in outs)
    assert world.runs["prefix"].engine.blocks.hits > 0


def test_forced_preemption(world):
    outs = _check_scenario(world, "preemption")
    assert world.runs["preemption"].engine.num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)


def test_n_samples(world):
    outs = _check_scenario(world, "fork")
    assert [o.request_id for o in outs] == ["0-0", "0-1", "0-2", "1-0", "1-1"]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1, "siblings drew identical samples"


def test_fp8_latent_cache(world):
    outs = _check_scenario(world, "fp8")
    # negative control: the native-latent trainer does not match an FP8-cache rollout, so the
    # equality above really depends on the trainer quantising exactly like the cache
    with torch.no_grad():
        native = trainer_pass(world.model, outs, VARIANTS[0], latent_format="native")
    report = compare_logprobs([o.logprobs for o in outs], native)
    assert not report.ok and report.sequences_mismatched == len(outs), report.table()


@cpu_only
def test_other_thread_count(world):
    """The trainer on two threads reproduces rollouts the engine made on one."""
    outs = [o for n in ("single", "fork") for o in world.runs[n].outs]
    assert_parity(outs, trainer_pass(world.model, outs, OTHER_THREADS, seed=3), f"{world.dtype} {OTHER_THREADS.name}")


# ----------------------------------------------------------------------------- negative controls


def _control_outs(world) -> list:
    b16 = world.runs["batch16"]
    if b16.error is not None:
        raise b16.error
    return world.runs["single"].outs + b16.outs[5:10]  # T = 1.0, 0.6 and 0 all present


def test_assert_parity_detects_one_ulp(world):
    """The equality check itself can fail: one token moved by one ulp is caught and named."""
    outs = world.runs["single"].outs
    lps = [o.logprobs.clone() for o in outs]
    lps[0][3] = torch.nextafter(lps[0][3], torch.zeros((), device=lps[0].device))
    with pytest.raises(pytest.fail.Exception, match="request 0 .*1/8 tokens differ, first token 3"):
        assert_parity(outs, lps, "one-ulp control")


def test_negative_control_other_temperature(world):
    outs = _control_outs(world)
    assert {o.temperature for o in outs} >= {0.0, 0.6, 1.0}
    # greedy records raw-logit log-probs; T=1 is the same distribution, so perturb it to 0.5 instead
    temps = [0.5 if o.temperature == 0 else o.temperature * 1.05 for o in outs]
    with torch.no_grad():
        lps = compute_logprobs(world.model, [o.prompt_token_ids + o.token_ids for o in outs],
                               [len(o.prompt_token_ids) for o in outs], temps)
    for o, lp in zip(outs, lps):
        assert not torch.equal(lp, o.logprobs), f"request {o.request_id}: temperature did not matter"
    report = compare_logprobs([o.logprobs for o in outs], lps)
    assert not report.ok and report.bitwise_equal_frac < 0.5 and report.max_abs_dlogp > 0, report.table()


def test_negative_control_lora_b_zeroed(world):
    outs = _control_outs(world)
    base = copy.deepcopy(world.model)
    with torch.no_grad():
        n = 0
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.zero_()
                n += 1
        assert n > 0
        lps = compute_logprobs(base, [o.prompt_token_ids + o.token_ids for o in outs],
                               [len(o.prompt_token_ids) for o in outs], [o.temperature for o in outs])
    for o, lp in zip(outs, lps):
        assert not torch.equal(lp, o.logprobs), f"request {o.request_id}: the LoRA adapter did not matter"
    report = compare_logprobs([o.logprobs for o in outs], lps)
    assert not report.ok and report.bitwise_equal_frac < 0.5 and report.kl_k3 > 0, report.table()


# ----------------------------------------------------------------------------- after weight updates


TRAIN_IDS = [str(i) for i in range(8)]


@dataclass
class Updated:
    before: list
    after: list
    step_lps: list[list[torch.Tensor]]
    version: int
    trainer: torch.nn.Module  # the trainer's model after the two steps


@pytest.fixture(scope="module")
def updated(world) -> Updated:
    """Two AdamW steps on a REINFORCE loss through the trainer's log-probs, pushed to the (idle, live)
    16-request engine with update_weights, then the same requests generated again."""
    run = world.runs["batch16"]
    if run.error is not None:
        raise run.error
    engine = run.engine  # every native run already happened (the world fixture), so reusing it is safe
    trainer = copy.deepcopy(world.model)  # leave world.model at the rollout weights for other tests
    before = [o for o in run.outs if o.request_id in TRAIN_IDS]
    opt = make_optimizer(trainer, lr=1e-2)
    adv = torch.randn(len(before), generator=torch.Generator().manual_seed(0))
    seqs = [o.prompt_token_ids + o.token_ids for o in before]
    plens = [len(o.prompt_token_ids) for o in before]
    step_lps = []
    for step in range(2):
        lps = compute_logprobs(trainer, seqs, plens, [o.temperature for o in before], micro_batch_tokens=300)
        step_lps.append([lp.detach() for lp in lps])
        n_tok = sum(lp.numel() for lp in lps)
        loss = -sum(a * lp.sum() for a, lp in zip(adv.tolist(), lps)) / n_tok
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    version = engine.update_weights(lora_state_dict(trainer))
    prompts = [o.prompt_token_ids for o in before]
    params = [run.params[o.request_id] for o in before]
    after = engine.generate(prompts, params, request_ids=TRAIN_IDS)
    return Updated(before, after, step_lps, version, trainer)


def test_parity_after_weight_updates(world, updated):
    # the first training forward (rollout weights) matched the rollout; the second saw new weights
    assert_parity(updated.before, updated.step_lps[0], f"{world.dtype} training step 1 forward")
    assert all(not torch.equal(a, b) for a, b in zip(updated.step_lps[0], updated.step_lps[1])), \
        "the first optimizer step did not change the log-probs"
    assert updated.version == 1 and all(o.weights_version == 1 for o in updated.after)
    for k, v in enumerate((VARIANTS[0], VARIANTS[2])):
        lps = trainer_pass(updated.trainer, updated.after, v, seed=10 + k)
        assert_parity(updated.after, lps, f"{world.dtype} after 2 updates / trainer {v.name}")


def test_weight_update_changed_the_rollouts(world, updated):
    for b, a in zip(updated.before, updated.after):
        assert a.request_id == b.request_id and a.prompt_token_ids == b.prompt_token_ids
        assert not torch.equal(a.logprobs, b.logprobs), f"request {a.request_id}: log-probs unchanged by the update"
    # and the old rollouts no longer match the updated trainer (the pushed weights are really new)
    lps = trainer_pass(updated.trainer, updated.before, VARIANTS[0])
    assert not compare_logprobs([o.logprobs for o in updated.before], lps).ok
