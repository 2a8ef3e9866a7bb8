"""Bitwise rollout/trainer parity on the GPU at the bench preset's real kernel shapes.

``ModelConfig.preset("bench")`` in bf16 on CUDA (random init, fixed seed) with its head/latent/
indexer/expert shapes intact (64 MLA heads, kv_lora 512, rope 64, indexer 32x128 top-2048 with
Hadamard, KDA 16x128, 64 experts top-8 + shared, vocab 163840) but fewer layers by default (the
KDA,KDA,KDA,MLA+DSA pattern repeated), LoRA r=32 with a non-zero B on every attention projection
and expert. The engine generates for one long prompt (32K tokens, chunked prefill, far past
index_topk so the DSA selection is sparse) plus short ones of mixed sampling settings; the trainer
recomputes every response token's log-prob under two micro-batch layouts with autograd enabled;
``torch.equal`` must hold on every token.

Sizes come from environment variables so the run can be shrunk (e.g. while some ops still run the
slow torch fallback on CUDA):

    ZMRL_GPU_BENCH_LAYERS   decoder layers (default 4: KDA x3 + MLA/DSA; 16 = the full preset)
    ZMRL_GPU_BENCH_LONG     long prompt tokens (default 32768; 0 = no long prompt)
    ZMRL_GPU_BENCH_SHORT    comma-separated short prompt lengths (default 7,300,2100,4097)
    ZMRL_GPU_BENCH_NEW      new tokens per short request (default 12; the long one gets 4)
    ZMRL_GPU_BENCH_BUDGET   engine max_num_batched_tokens (default 8192: the long prompt is chunked)
    ZMRL_GPU_BENCH_MICRO    trainer micro_batch_tokens of the second layout (default 4096)

Run: ``python -m pytest -q -m gpu tests/bitwise/test_parity_gpu_bench.py`` on a CUDA machine.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time

import pytest
import torch

from zmrl.lora import LoraConfig, apply_lora
from zmrl.model import ModelConfig, build_model
from zmrl.model.config import LinearAttnConfig
from zmrl.parity import compare_logprobs
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import compute_logprobs

from tests.device import TEST_DECODE_GRAPHS

pytestmark = [pytest.mark.gpu]

log = logging.getLogger(__name__)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return value


def _env_lengths(name: str, default: str) -> list[int]:
    raw = os.environ.get(name, default)
    try:
        lens = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be comma-separated integers") from None
    if any(n < 1 for n in lens):
        raise ValueError(f"{name}={raw!r}: every length must be >= 1")
    return lens


LAYERS = _env_int("ZMRL_GPU_BENCH_LAYERS", 4)
LONG = _env_int("ZMRL_GPU_BENCH_LONG", 32768)
SHORT = _env_lengths("ZMRL_GPU_BENCH_SHORT", "7,300,2100,4097")
NEW = max(1, _env_int("ZMRL_GPU_BENCH_NEW", 12))
BUDGET = max(64, _env_int("ZMRL_GPU_BENCH_BUDGET", 8192))
MICRO = max(1, _env_int("ZMRL_GPU_BENCH_MICRO", 4096))
BLOCK = 64


def bench_config(num_layers: int) -> ModelConfig:
    """The bench preset with ``num_layers`` layers: every 4th (1-based) is MLA+DSA, the rest KDA
    (the preset's own pattern); fewer than 4 layers end with one MLA+DSA layer."""
    cfg = ModelConfig.preset("bench")
    if num_layers < 1:
        raise ValueError(f"ZMRL_GPU_BENCH_LAYERS must be >= 1, got {num_layers}")
    if num_layers == cfg.num_hidden_layers:
        return cfg
    full = [i for i in range(1, num_layers + 1) if i % 4 == 0] or [num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    la = dataclasses.replace(cfg.linear_attn_config, kda_layers=kda, full_attn_layers=full)
    assert isinstance(la, LinearAttnConfig)
    return dataclasses.replace(cfg, num_hidden_layers=num_layers, linear_attn_config=la).validate()


# the sampling mix: (temperature, top_p, top_k)
MIX = [(1.0, 1.0, -1), (0.6, 0.9, -1), (0.0, 1.0, -1), (1.0, 1.0, 20), (0.7, 0.95, 50)]


def run_parity(model: torch.nn.Module, lengths: list[int], long_first: bool, budget: int, micro: int,
               new_tokens: int, seed: int = 1234) -> dict:
    """Engine rollouts (on a deepcopy of ``model``) for prompts of ``lengths``, then the trainer's
    log-probs under two layouts. Device-agnostic (the test runs it on CUDA)."""
    cfg = model.config
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    params = []
    for i, n in enumerate(lengths):
        t, p, k = MIX[i % len(MIX)]
        params.append(SamplingParams(temperature=t, top_p=p, top_k=k, seed=100 + i,
                                     max_tokens=4 if (long_first and i == 0) else new_tokens))
    need = sum(-(-(n + sp.max_tokens) // BLOCK) for n, sp in zip(lengths, params))
    engine = RolloutEngine(copy.deepcopy(model), EngineConfig(
        block_size=BLOCK, num_blocks=need + 8, max_num_seqs=len(prompts), max_num_batched_tokens=budget,
        enable_prefix_caching=True, decode_graphs=TEST_DECODE_GRAPHS))
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    t_engine = time.perf_counter() - t0

    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    plens = [len(o.prompt_token_ids) for o in outs]
    temps = [o.temperature for o in outs]
    layouts = {
        "one packed micro-batch": dict(micro_batch_tokens=None, order=None),
        f"micro {micro} tokens, reversed": dict(micro_batch_tokens=micro, order=list(range(len(seqs)))[::-1]),
    }
    lps, t_train = {}, {}
    for name, kw in layouts.items():
        sync()
        t0 = time.perf_counter()
        with torch.enable_grad():
            got = compute_logprobs(model, seqs, plens, temps, **kw)
        assert all(lp.requires_grad for lp in got), "trainer log-probs must carry autograd"
        lps[name] = [lp.detach() for lp in got]
        del got
        sync()
        t_train[name] = time.perf_counter() - t0
    log.info("parity run: prompts %s, engine %.1fs (%d steps), trainer %s", lengths, t_engine, engine.num_steps,
             ", ".join(f"{k} {v:.1f}s" for k, v in t_train.items()))
    return dict(cfg=cfg, outs=outs, lps=lps, engine=engine, lengths=lengths)


@pytest.fixture(scope="module")
def bench_run():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = bench_config(LAYERS)
    assert (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (64, 512, 64)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    assert (cfg.linear_attn_config.num_heads, cfg.linear_attn_config.head_dim, cfg.n_routed_experts) == (16, 128, 64)
    t0 = time.perf_counter()
    model = build_model(cfg, seed=0, dtype="bfloat16", device="cuda")
    apply_lora(model, LoraConfig(r=32, alpha=32.0, init_b_std=0.02, init_seed=1))
    log.info("bench model (%d layers) built in %.1fs", LAYERS, time.perf_counter() - t0)
    lengths = ([LONG] if LONG else []) + SHORT
    return run_parity(model, lengths, bool(LONG), BUDGET, MICRO, NEW)


def test_bench_rollouts_finished(bench_run):
    outs, lengths = bench_run["outs"], bench_run["lengths"]
    assert [len(o.prompt_token_ids) for o in outs] == lengths
    for o in outs:
        assert o.finish_reason in ("length", "stop") and o.error is None, f"{o.request_id}: {o.error}"
        assert o.logprobs.dtype == torch.float32 and o.logprobs.numel() == len(o.token_ids) >= 1
        assert torch.isfinite(o.logprobs).all(), f"{o.request_id}: non-finite log-probs"
    if LONG:
        # the long prompt was prefilled in several chunks, and its DSA selection is sparse
        assert bench_run["engine"].num_steps >= -(-LONG // BUDGET)
        assert LONG > bench_run["cfg"].index_topk


@pytest.mark.parametrize("layout", ["one packed micro-batch", f"micro {MICRO} tokens, reversed"])
def test_bench_parity(bench_run, layout):
    outs, lps = bench_run["outs"], bench_run["lps"][layout]
    report = compare_logprobs([o.logprobs for o in outs], lps, scenario=f"bench x{LAYERS} layers / {layout}")
    bad = []
    for o, lp in zip(outs, lps):
        what = f"request {o.request_id} (prompt {len(o.prompt_token_ids)}, T={o.temperature})"
        if lp.shape != o.logprobs.shape:
            bad.append(f"{what}: {lp.numel()} trainer vs {o.logprobs.numel()} rollout tokens")
        elif not torch.equal(lp, o.logprobs):
            bad.append(f"{what}: {int((lp != o.logprobs).sum())}/{lp.numel()} tokens differ")
    assert not bad, "log-prob mismatch\n  " + "\n  ".join(bad) + "\n" + report.table()
    assert report.ok and report.kl_k3 == 0.0
