"""Decode throughput of the bench preset (bf16, H200): bitwise vs fast kernels, side by side.

    python benchmarks/decode_throughput.py [--batches 1,16,64,256] [--contexts 1024,8192,32768]
        [--layers 16] [--modes bitwise,graph,fast] [--iters 5] [--profile-ctx 8192] [--out FILE.json]

What is timed: one decode step of the model as the engine runs it, CUDA events around the whole
step (host work included), median of ``--iters`` steps after ``--warmup`` steps; sampling is not
included. Modes:

* ``bitwise`` / ``fast``: the eager step (``forward_incremental``: the batch context with block
  tables, the forward over one new token per sequence, the fp32 logits of those tokens) with the
  batch-invariant kernels / the stock kernels;
* ``graph``: the engine's CUDA-graph decode (``DecodeGraphRunner``, bitwise kernels): static
  buffers filled from the host, then one graph replay (captured during the warm-up steps).

The context is built cheaply instead of prefilling millions of tokens: each sequence gets
``context`` cache slots whose MLA latents, FP8 index keys and scales are random values written
straight into the paged store, and KDA states cloned from a 32-token template prefill (so every
sequence sits 32 rows into a 64-token KDA chunk, which bitwise decode re-runs each step: the
average case). ``context`` is the nominal length; the cache holds ``context - 32`` tokens.

At batch 1 the script also reports the HBM-bandwidth bound: bytes one decode step must read (the
active weights: one embedding row, attention, router, shared expert, the top-k routed experts and
lm_head; plus the DSA index keys of the whole context, the latents of the top-k selected keys and
the KDA states) divided by a device-to-device copy bandwidth measured in the same run, and a
torch.profiler breakdown of where the time goes (top 15 kernels by device time).
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch

from _common import (build_bench_model, OOM_ERRORS, parse_mla_launches, copy_bandwidth_tb_s, cuda_time_ms, decode_weight_bytes,
                     default_out, empty_cache, env, free_gib, kv_state_bytes_per_seq, pick_device,
                     op_profile, print_op_profile, print_profile, profile_step, setup_logging, table, write_json)
from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.model import ModelCache, SequenceState, forward_incremental
from zmrl.model.context import KDASeqState
from zmrl.rollout.engine import Request
from zmrl.rollout.graph_runner import DecodeGraphRunner
from zmrl.rollout.sampling import SamplingParams

log = logging.getLogger("benchmarks.decode")

PAGE = 64
PENDING = 32  # KDA rows already in the current chunk (of 64) at every timed step's start


def note(row: dict[str, Any], key: str, msg: str) -> None:
    row[key] = f"{row[key]}; {msg}" if row.get(key) else msg


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def kda_template(model, device: torch.device) -> dict[int, KDASeqState]:
    """KDA states of one sequence after a real ``PENDING``-token prefill: the exact structure
    (conv tails, fp32 state, pending chunk rows) a decoding sequence carries."""
    cfg = model.config
    cache = ModelCache(cfg, num_pages=1, page_size=PAGE, dtype=model.dtype, device=device)
    seq = SequenceState()
    ids = torch.randint(0, cfg.vocab_size, (PENDING,), device=device)
    forward_incremental(model, cache, [seq], [ids], logits_rows="last")
    assert all(s.num_pending == PENDING for s in seq.kda.values()), "template: unexpected KDA pending rows"
    return seq.kda


def fill_store(cache: ModelCache, gen: torch.Generator) -> None:
    """Random latents, FP8 index keys (never the NaN codes 0x7F/0xFF) and positive key scales."""
    st = cache.store
    for layer, kv in st.kv.items():
        kv.normal_(0.0, 1.0, generator=gen)
        if layer in st.k8:
            u = st.k8[layer].view(torch.uint8)
            u.copy_(torch.randint(0, 255, u.shape, dtype=torch.uint8, device=u.device, generator=gen))
            u[u == 0x7F] = 0
            st.kscale[layer].uniform_(1e-3, 1e-2, generator=gen)


def make_seqs(cache: ModelCache, template: dict[int, KDASeqState], batch: int, ctx_tokens: int,
              extra: int) -> list[SequenceState]:
    seqs = []
    for _ in range(batch):
        s = SequenceState(kda={k: v.clone() for k, v in template.items()}, num_tokens=0)
        cache.allocate(s, ctx_tokens + extra)  # room for every timed step: no allocation inside the timing
        s.num_tokens = ctx_tokens
        seqs.append(s)
    return seqs


def reset_seqs(seqs: list[SequenceState], template: dict[int, KDASeqState], ctx_tokens: int) -> None:
    for s in seqs:
        s.kda = {k: v.clone() for k, v in template.items()}
        s.num_tokens = ctx_tokens


def cache_bytes(cfg, pages: int) -> int:
    n_mla = sum(1 for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i))
    per_token = 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.index_head_dim + 4
    return pages * PAGE * per_token * n_mla


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=_ints, default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=_ints, default=[1024, 8192, 32768])
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16 = the full bench preset)")
    ap.add_argument("--modes", default="bitwise,graph,fast",
                    help="bitwise (eager), graph (bitwise + CUDA-graph decode), fast (eager, stock kernels)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--profile-ctx", type=int, default=8192, help="context of the profiles (0 = no profile)")
    ap.add_argument("--profile-batches", type=_ints, default=[1, 256],
                    help="batches whose graph-replayed step is profiled (at --profile-ctx)")
    ap.add_argument("--op-census", type=_ints, default=[], metavar="BATCHES",
                    help="batches whose eager bitwise step (at --profile-ctx) is timed per op call: op, argument "
                         "shapes, issuing site (which GEMMs, norms, attention calls a step spends its time in)")
    ap.add_argument("--mem-fraction", type=float, default=0.85, help="skip combos needing more of the free memory")
    ap.add_argument("--time-budget-s", type=float, default=170.0, help="skip the remaining combos after this")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="LoRA rank on every attention projection and expert, as in RL rollouts (0 = base model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON result (default benchmarks/results/<date>_decode_throughput_h200.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny shapes: checks the script runs")
    ap.add_argument("--mla-launch", default=None, metavar="HxWxS",
                    help="run the sparse MLA kernel under this launch (heads x warps x stages) instead of its "
                         "kernel_config's (the form is Numerics.mla_mma_rows, e.g. ZMRL_MLA_MMA_ROWS=keys)")
    a = ap.parse_args()
    setup_logging()
    if a.mla_launch is None:
        return run(a)
    from zmrl.kernels_batch_invariant.triton import mla_attention as tmla

    (launch,) = parse_mla_launches(a.mla_launch)
    with tmla.launch_override(*launch):
        return run(a)


def run(a: argparse.Namespace) -> int:
    dev = pick_device("decode_throughput.py", a.smoke)
    if a.smoke:
        a.batches, a.contexts, a.profile_ctx, a.iters, a.warmup = [1, 3], [192], 192, 2, 1
        a.profile_batches = [1, 3]
        a.op_census = [3]
    modes = [m for m in a.modes.split(",") if m]
    t_start = time.perf_counter()
    torch.manual_seed(a.seed)

    cfg, model = build_bench_model(a.layers, a.smoke, dev, a.lora, a.seed)
    log.info("bench model: %d layers, LoRA r=%d, %.2f B params, built in %.1fs", cfg.num_hidden_layers, a.lora,
             sum(p.numel() for p in model.parameters()) / 1e9, time.perf_counter() - t_start)
    bw = copy_bandwidth_tb_s(dev, gib=0.25 if a.smoke else 2.0)
    log.info("device-to-device copy bandwidth %.2f TB/s", bw)
    def weight_bytes_at(batch: int) -> int:
        return decode_weight_bytes(model, batch)

    weight_bytes = weight_bytes_at(1)
    template = kda_template(model, dev)
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    steps = a.warmup + a.iters

    results: list[dict[str, Any]] = []
    profile: list[dict[str, Any]] | None = None
    profile_graph: dict[int, list[dict[str, Any]]] = {}  # graph-replayed steps, by batch
    op_census: dict[int, list[dict[str, Any]]] = {}  # eager steps per op call, by batch
    for ctx in sorted(a.contexts):
        ctx_tokens = ctx - PENDING
        if ctx_tokens < PAGE or ctx_tokens + steps + 1 > cfg.max_position_embeddings:
            log.warning("context %d out of range, skipped", ctx)
            continue
        for batch in sorted(a.batches):
            row: dict[str, Any] = {"batch": batch, "context": ctx}
            results.append(row)
            if time.perf_counter() - t_start > a.time_budget_s:
                row["skipped"] = "time budget"
                continue
            pages = batch * -(-(ctx_tokens + steps + 1) // PAGE) + 1
            need_gib = (cache_bytes(cfg, pages) + batch * kv_state_bytes_per_seq(cfg, ctx, PENDING)) / 2**30 + 2.0
            if need_gib > a.mem_fraction * free_gib():
                row["skipped"] = f"needs ~{need_gib:.0f} GiB, {free_gib():.0f} GiB free"
                log.info("batch %d context %d: %s", batch, ctx, row["skipped"])
                continue
            cache = seqs = None
            try:
                cache = ModelCache(cfg, num_pages=pages, page_size=PAGE, dtype=model.dtype, device=dev)
                fill_store(cache, gen)
                seqs = make_seqs(cache, template, batch, ctx_tokens, steps + 1)
                tokens = [torch.randint(0, cfg.vocab_size, (1,), device=dev, generator=gen) for _ in range(batch)]

                def step() -> None:
                    forward_incremental(model, cache, seqs, tokens, logits_rows="last")

                def graph_step() -> None:
                    runner.run(reqs)
                    for s in seqs:
                        s.num_tokens += 1

                # The engine's view of the same sequences: one shared token list (the runner reads token i
                # of a request with token_at, nothing is copied), page tables as allocated above.
                shared_prompt = [int(tokens[0])] * (ctx_tokens + steps + 2)
                reqs = []
                for i, s in enumerate(seqs):
                    r = Request(str(i), shared_prompt, SamplingParams())
                    r.seq = s
                    reqs.append(r)
                runner = None

                # host-side batch description (block tables, positions, slots) alone: part of every step
                t0 = time.perf_counter()
                for _ in range(3):
                    cache.context(seqs, [1] * batch)
                row["context_build_ms"] = (time.perf_counter() - t0) / 3 * 1e3

                for mode in modes:
                    try:  # one mode failing (e.g. a kernel error) must not hide the other
                        reset_seqs(seqs, template, ctx_tokens)
                        if mode == "graph":
                            # the spare last page of the cache is the runner's scratch page
                            assert cache.free_pages == [pages - 1], "benchmark cache layout changed"
                            runner = DecodeGraphRunner(
                                model, cache.store, scratch_page=pages - 1, max_num_seqs=batch,
                                max_pages=max(len(s.pages) for s in seqs),
                                mode="cuda" if dev.type == "cuda" else "static")
                            t0 = time.perf_counter()
                            graph_step()  # the first step captures the graph
                            row["graph_capture_s"] = time.perf_counter() - t0
                            with kernel_mode("bitwise"):
                                t = cuda_time_ms(graph_step, warmup=a.warmup, iters=a.iters)
                                if batch in a.profile_batches and ctx == a.profile_ctx:
                                    reset_seqs(seqs, template, ctx_tokens)
                                    for r in reqs:  # reload the reset states into the pool
                                        runner.release(r.request_id)
                                    graph_step()  # untimed: the pool reload happens outside the profile
                                    profile_graph[batch] = profile_step(graph_step, dev.type == "cuda")
                            del runner
                        else:
                            with kernel_mode(mode):
                                t = cuda_time_ms(step, warmup=a.warmup, iters=a.iters)
                    except OOM_ERRORS:
                        note(row, "error", f"{mode}: out of memory")
                        empty_cache()
                        continue
                    except Exception as e:
                        note(row, "error", f"{mode}: {type(e).__name__}: {e}"[:300])
                        log.exception("batch %d context %d, %s mode failed", batch, ctx, mode)
                        continue
                    row[f"{mode}_ms"] = t["median_ms"]
                    row[f"{mode}_tok_s"] = batch / (t["median_ms"] * 1e-3)
                    # The step's HBM bound: the weights it must read once plus every sequence's cache and
                    # KDA state bytes, over the copy bandwidth measured in this run.
                    bound_ms = (weight_bytes_at(batch) + batch * kv_state_bytes_per_seq(cfg, ctx, PENDING)) / (bw * 1e12) * 1e3
                    row["hbm_bound_ms"] = bound_ms
                    row[f"{mode}_frac_hbm"] = bound_ms / t["median_ms"]
                    # the eager profile at batch 1 (the graph mode has its own replay profile above)
                    eager_modes = [m for m in modes if m != "graph"]
                    if batch == 1 and ctx == a.profile_ctx and eager_modes and mode == eager_modes[0] and profile is None:
                        reset_seqs(seqs, template, ctx_tokens)
                        with kernel_mode(mode):
                            profile = profile_step(step, dev.type == "cuda")
                if batch in a.op_census and ctx == a.profile_ctx:
                    reset_seqs(seqs, template, ctx_tokens)
                    with kernel_mode("bitwise"):
                        step()  # warm: the eager path's first call
                        reset_seqs(seqs, template, ctx_tokens)
                        op_census[batch] = op_profile(step, dev.type == "cuda")
                if "bitwise_ms" in row and "fast_ms" in row:
                    # throughput ratio (bitwise tok/s / fast tok/s): the targets are >= 0.95 decode, >= 0.90 training
                    row["bitwise_over_fast"] = row["fast_ms"] / row["bitwise_ms"]
                if "graph_ms" in row and "fast_ms" in row:
                    row["graph_over_fast"] = row["fast_ms"] / row["graph_ms"]
                log.info("batch %d context %d: %s", batch, ctx,
                         ", ".join(f"{m} {row.get(m + '_ms', float('nan')):.2f} ms" for m in modes))
            except OOM_ERRORS:
                note(row, "skipped", "out of memory")
                log.warning("batch %d context %d: out of memory", batch, ctx)
            except Exception as e:  # keep going: one broken combo must not hide the others
                note(row, "error", f"{type(e).__name__}: {e}"[:300])
                log.exception("batch %d context %d failed", batch, ctx)
            finally:
                del cache, seqs
                empty_cache()

    cols = [("batch", "batch", "d"), ("context", "context", "d")]
    for m in modes:
        cols += [(f"{m}_ms", f"{m} ms/step", ".2f"), (f"{m}_tok_s", f"{m} tok/s", ".0f")]
    cols += [("bitwise_over_fast", "bitwise/fast tok/s", ".2f"), ("graph_over_fast", "graph/fast tok/s", ".2f"),
             ("hbm_bound_ms", "HBM bound ms", ".3f")]
    cols += [(f"{m}_frac_hbm", f"{m} %HBM", ".1%") for m in modes]
    cols += [("context_build_ms", "host ctx ms", ".2f"), ("skipped", "note", "s"), ("error", "error", "s")]
    print(f"\nDecode step, {'tiny (smoke)' if a.smoke else 'bench'} preset ({cfg.num_hidden_layers} layers) bf16"
          f"{f', LoRA r={a.lora}' if a.lora else ''}, "
          f"copy bandwidth {bw:.2f} TB/s, weights read per token at batch 1: {weight_bytes / 1e9:.2f} GB")
    print(table(results, cols))
    if profile:
        step_ms = next((r.get(f"{modes[0]}_ms") for r in results if r["batch"] == 1 and r["context"] == a.profile_ctx),
                       None)
        busy = profile[-1]["ms_per_step"]
        print_profile(f"Where the time goes: batch 1, context {a.profile_ctx}, {modes[0]} mode (device time per step; "
                      f"kernels busy {busy:.2f} ms" + (f" of a {step_ms:.2f} ms step: the rest is host time / launch "
                                                        f"gaps)" if step_ms else ")"), profile)
    for b, prof in sorted(profile_graph.items()):
        step_ms = next((r.get("graph_ms") for r in results if r["batch"] == b and r["context"] == a.profile_ctx), None)
        print_profile(f"Graph-replayed step, batch {b}, context {a.profile_ctx} (kernels busy "
                      f"{prof[-1]['ms_per_step']:.2f} ms" + (f" of a {step_ms:.2f} ms step)" if step_ms else ")"), prof)
    for b, rows in sorted(op_census.items()):
        print_op_profile(f"Eager bitwise step per op call, batch {b}, context {a.profile_ctx}", rows)
    payload = {"benchmark": "decode_throughput", **env(), "preset": "tiny" if a.smoke else "bench",
               "layers": cfg.num_hidden_layers,
               "dtype": "bfloat16", "copy_bandwidth_tb_s": bw, "weight_bytes_per_token_batch1": weight_bytes,
               "lora_r": a.lora, "pending_kda_rows": PENDING, "warmup": a.warmup, "iters": a.iters, "results": results,
               "profile_batch1": profile,
               "profile_graph": {str(b): p for b, p in profile_graph.items()}, "profile_context": a.profile_ctx,
               "op_census": {str(b): p for b, p in op_census.items()},
               "wall_s": time.perf_counter() - t_start}
    write_json(a.out or default_out("decode_throughput" + ("_smoke" if a.smoke else "")), payload)
    return 0 if any(f"{m}_ms" in r for r in results for m in modes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
