"""Multi-process driver for the parallel parity tests (CPU, gloo).

``launch(world, layouts, out)`` spawns ``world`` processes (one GPU each over NCCL when the machine
has that many GPUs, else CPU over gloo); each initialises the process group once and then,
for every layout in turn, builds the tiny model (same seed, LoRA with a non-zero B), shards it for
that layout, runs engine rollouts (chunked prefill, prefix-cache hits, several requests in flight)
and the trainer's packed recompute of the same sequences, and optionally one backward. Rank 0 writes
``{layout name: result}`` to ``out`` (plain dicts of tensors and numbers, read back with
``weights_only=True``: nothing is unpickled); the test compares layouts.
"""
from __future__ import annotations

import logging
import os
import socket
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPT_LENS = (70, 9)  # 70 > one 64-token KDA chunk and page; 9 rides along
PREFIX_EXTRA = 5  # a later request shares the first 64 tokens of prompt 0 (prefix-cache hit)
MAX_TOKENS = 4


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    ep: int = 1
    virtual_shards: int = 1
    dtype: str = "float32"
    reduce: str = "tree"
    grads: bool = False
    engine: bool = True
    megatron: bool = True  # False: the torch.distributed fallback groups (as without megatron-core)


@dataclass
class Result:
    tokens: list[list[int]] = field(default_factory=list)  # prompt ++ response per request
    prompt_lens: list[int] = field(default_factory=list)
    engine_lp: list[torch.Tensor] = field(default_factory=list)
    trainer_lp: list[torch.Tensor] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # full (unsharded-piece) LoRA grads
    prefix_hits: int = 0
    full_lora_ok: bool | None = None  # gather_full_state of the LoRA == the unsharded model's LoRA


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    ps = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    ps.append(ps[0][:64] + torch.randint(0, vocab, (PREFIX_EXTRA,), generator=g).tolist())
    return ps


def _collect_grads(model) -> dict[str, torch.Tensor]:
    """This rank's LoRA gradients under every alias name; expert-parallel slices keyed with their offset."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.grad is None:
            continue
        off = getattr(p, "_zmrl_expert_offset", None)
        out[name if off is None else f"{name}@{off}"] = _cpu(p.grad)
    return out


def _merge_grads(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for d in per_rank:
        for k, g in d.items():
            if "@" in k:
                name, off = k.rsplit("@", 1)
                slices.setdefault(name, {})[int(off)] = g
            else:
                if k in merged and not torch.equal(merged[k], g):
                    raise AssertionError(f"replicated gradient {k} differs between ranks")
                merged[k] = g
    for name, parts in slices.items():
        merged[name] = torch.cat([parts[o] for o in sorted(parts)])
    return merged


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone()


def run_layout(layout: Layout, device: torch.device = torch.device("cpu")) -> Result:
    from zmrl.lora import LoraConfig, apply_lora
    from zmrl.model import ModelConfig, build_model
    from zmrl.parallel import ParallelConfig, destroy_parallel, gather_full_state, init_parallel, shard_model
    from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
    from zmrl.trainer import compute_logprobs

    if layout.megatron:
        os.environ.pop("ZMRL_PARALLEL_GROUPS", None)
    else:
        os.environ["ZMRL_PARALLEL_GROUPS"] = "torch"
    init_parallel(ParallelConfig(tp=layout.tp, ep=layout.ep, virtual_shards=layout.virtual_shards,
                                 reduce=layout.reduce, backend="nccl" if device.type == "cuda" else "gloo"))
    try:
        if layout.tp == layout.ep == 1 and dist.get_rank() != 0:
            return Result()  # a data-parallel replica of rank 0's work: nothing to add (saves a core)
        cfg = ModelConfig.preset("tiny")
        model = build_model(cfg, seed=0, dtype=layout.dtype, device=device)
        apply_lora(model, LoraConfig(r=4, alpha=8, init_b_std=0.02, init_seed=3))
        full_lora = {n: _cpu(p) for n, p in model.named_parameters() if "lora_" in n}
        shard_model(model)
        gathered = gather_full_state(model, keep=lambda n: "lora_" in n)
        res_full_ok = sorted(gathered) == sorted(full_lora) and all(torch.equal(gathered[n], full_lora[n])
                                                                  for n in full_lora)
        res = Result(full_lora_ok=res_full_ok)
        prompts = _prompts(cfg.vocab_size)
        if layout.engine:
            engine = RolloutEngine(model, EngineConfig(block_size=64, num_blocks=16, max_num_seqs=8,
                                                       max_num_batched_tokens=40, enable_prefix_caching=True))
            params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seed=s)
                      for s, t in zip(range(10, 20), (1.0, 0.7, 1.0, 1.0))]
            n = len(PROMPT_LENS)
            outs = engine.generate(prompts[:n], params[:n], request_ids=[f"r{i}" for i in range(n)])
            outs += engine.generate(prompts[n:], params[n:len(prompts)], request_ids=["prefix"])  # hits prompt 0's first block
            res.prefix_hits = engine.blocks.hits
            for o in outs:
                res.tokens.append(list(o.prompt_token_ids) + list(o.token_ids))
                res.prompt_lens.append(len(o.prompt_token_ids))
                res.engine_lp.append(_cpu(o.logprobs))
            temps = [o.temperature for o in outs]
        else:
            g = torch.Generator().manual_seed(99)
            res.tokens = [p + torch.randint(0, cfg.vocab_size, (MAX_TOKENS,), generator=g).tolist() for p in prompts]
            res.prompt_lens = [len(p) for p in prompts]
            temps = [1.0] * len(prompts)
        model.train()
        lps = compute_logprobs(model, res.tokens, res.prompt_lens, temperature=temps, micro_batch_tokens=96,
                               order=list(reversed(range(len(res.tokens)))))
        res.trainer_lp = [_cpu(lp) for lp in lps]
        if layout.grads:
            coef = torch.Generator().manual_seed(7)
            loss = sum((lp * torch.randn(lp.shape, generator=coef).to(lp.device)).sum() for lp in lps)
            loss.backward()
            if layout.tp == layout.ep == 1:
                res.grads = _merge_grads([_collect_grads(model)])
            else:
                per_rank: list = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, _collect_grads(model))
                res.grads = _merge_grads(per_rank)
        return res
    finally:
        destroy_parallel()


def _main(rank: int, world: int, port: int, layouts: list[Layout], out: str, cuda: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    # A bug that leaves one rank out of a collective fails after 10 minutes instead of hanging the
    # suite (rank 1 waits in the next layout's group creation while rank 0 runs a TP=1 layout alone).
    timeout = timedelta(seconds=600)
    if cuda:  # one GPU per rank, NCCL (NVLink multicast off)
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        results = {}
        for layout in layouts:
            results[layout.name] = run_layout(layout, device)
        if rank == 0:
            torch.save({name: asdict(r) for name, r in results.items()}, out)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def launch(world: int, layouts: list[Layout], out: str) -> dict[str, Result]:
    """Spawn ``world`` ranks: one GPU each over NCCL when there are enough GPUs, else CPU over gloo."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    logging.getLogger(__name__).info("parallel test: world %d on %s", world, "CUDA/NCCL" if cuda else "CPU/gloo")
    mp.spawn(_main, args=(world, free_port(), layouts, out, cuda), nprocs=world, join=True)
    return {name: Result(**fields) for name, fields in torch.load(out, weights_only=True).items()}
