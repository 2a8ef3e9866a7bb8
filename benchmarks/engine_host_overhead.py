"""Host (CPU) cost of one engine decode step, without the model: what the GPU waits for between graph replays.

    python benchmarks/engine_host_overhead.py [--batches 1,64,256] [--contexts 1024,8192] [--iters 20]
        [--baseline BEFORE.json] [--out FILE.json]

Runs the real ``RolloutEngine`` step (scheduler, model runner, fixed-shape decode runner in "static" mode,
sampler, output bookkeeping) on the CPU over the tiny preset, with the model's forward replaced by a
fixed logits table, so every millisecond measured is host work the engine does per step on any device:

* ``schedule``: ``Scheduler.schedule`` (budget, page growth);
* ``decode ctx``: ``DecodeGraphRunner.run`` without the forward: pool slots, token ids, positions,
  cache slots, KDA slots and the block table written into the static input buffers (on a GPU this is
  followed by one host->device copy and a graph replay);
* ``runner``: the rest of ``ModelRunner.run`` (picking the decode rows, the sampler's per-row counter states
  when the graph draws, advancing the sequences, and the prefix-cache snapshot of the KDA state of each
  sequence that completes a 64-token block: tensor copies, kernels on a GPU);
* ``sample``: the sampler driver: with the draw inside the decode graph (``EngineConfig.sample_in_graph``, the
  default, taken by these plain temperature-1 requests) ``sampler.fetch`` (the draws read back, stubbed here
  as token 0), else ``sampler.draw`` (argument checks, the per-row noise states, the draw and its log-probs
  over a 32-token vocabulary: on the CPU this includes the draw's arithmetic, which a GPU runs as kernels);
* ``bookkeep``: prefix-cache registration, forks, appending the draws, finishing;
* ``step``: all of ``RolloutEngine.step``;
* ``eager ctx``: ``paged_context`` for the same decode batch (the eager builder that prefill and mixed
  batches use; the "host ctx ms" column of benchmarks/decode_throughput.py times this builder).

Every sequence decodes with a context of about ``context`` tokens (staggered over one page, so page
appends are spread over the steps as in a real rollout), page size 64. Milliseconds are CPU time of the
engine's thread (torch single-threaded), medians over ``--iters`` steps after ``--warmup``, the fastest of
``--rounds``. ``--baseline`` adds the same figures from an earlier JSON of this script (e.g. run against
another commit) as "before" columns.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from _common import env, table, write_json
from zmrl.model import ModelConfig, build_model
from zmrl.model.context import paged_context
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.rollout import engine as engine_module
from zmrl.rollout import model_runner as model_runner_module

PAGE = 64
# Logits width of the stub forward: small, so that the draw's own arithmetic (device work on a GPU, a few
# elementwise ops over batch x vocab) stays small next to the sampler's host work on the CPU.
VOCAB = 32
# The CPU time of this thread, not wall time: the host this runs on is shared, and a step's own work is what
# is measured (torch runs single-threaded here, so every op's work is on this thread).
clock = time.thread_time
PARTS = ("schedule", "decode_ctx", "runner", "sample", "bookkeep")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


class StubStore:
    """The page pool's host face (page size, page copies) without the pages: the forward is stubbed."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size

    def copy_page(self, src: int, dst: int) -> None:
        pass


class Timers:
    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = clock()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (clock() - t0) * 1e3

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)
        return timed


def build_engine(batch: int, context: int, steps: int, seed: int, sample_in_graph: bool = True
                 ) -> tuple[RolloutEngine, Timers, torch.Tensor]:
    """An engine over the tiny preset whose forward is a fixed logits table, with ``batch`` requests prefilled
    to about ``context`` tokens each (the prefill runs through the eager path, forward stubbed)."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), max_position_embeddings=context + steps + 2 * PAGE)
    model = build_model(cfg, seed=seed, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, VOCAB, generator=gen)
    model.forward = lambda ids, ctx: torch.zeros(ids.shape[0], 1)  # type: ignore[method-assign]
    model.compute_logits = lambda hidden: logits[: hidden.shape[0]]  # type: ignore[method-assign]
    # prompts of context - 63 .. context tokens: page appends spread over the timed steps
    lens = [context - int(x) for x in torch.randint(0, PAGE, (batch,), generator=gen)]
    num_blocks = sum(-(-(n + steps + 1) // PAGE) for n in lens) + 1
    saved = model_runner_module.latent_store
    model_runner_module.latent_store = lambda cfg, num_pages, page_size, dtype, device: StubStore(num_pages, page_size)
    try:
        engine = RolloutEngine(model, EngineConfig(
            block_size=PAGE, num_blocks=num_blocks, max_num_seqs=batch,
            max_num_batched_tokens=sum(lens),  # the whole prefill in one step
            decode_graphs="static", max_model_len=cfg.max_position_embeddings, sample_in_graph=sample_in_graph))
    finally:
        model_runner_module.latent_store = saved
    graphs = engine.runner.graphs
    # the replay's stand-in; with an in-graph draw (EngineConfig.sample_in_graph), token 0 with log-prob 0 per row
    drawn = torch.zeros(3, batch, dtype=torch.float64)
    drawn[2] = 1.0  # finite
    graphs._forward = lambda bs, pages, temperature: (logits[:bs], None if temperature is None else drawn[:, :bs])
    # a copy once per request, not per step (and the stubbed prefill leaves no KDA state to load); the pool's
    # prefix-cache snapshots at 64-token boundaries do run (small tensor copies of the tiny preset's KDA state)
    graphs.pool.load = lambda seq, slot: None
    for i, n in enumerate(lens):
        prompt = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, max_tokens=steps + 2, seed=seed + i))
    while engine.waiting or any(r.num_computed < r.num_tokens - 1 for r in engine.running):
        engine.step()  # prefill (stubbed forward); the step that finishes a prompt samples its first token

    timers = Timers()
    sch, runner = engine.scheduler, engine.runner
    sch.schedule = timers.wrap("schedule", sch.schedule)
    run_decode = timers.wrap("decode_ctx", graphs.run)

    def run_decode_and_eager_context(reqs, *sampling):
        # the eager builder over the same batch, pages already grown by schedule(); not part of the step
        seqs = [r.seq for r in reqs]
        with timers.part("eager_ctx"):
            pages = [s.page_array() if hasattr(s, "page_array") else s.pages for s in seqs]  # older commits: lists
            paged_context(pages, [s.num_tokens for s in seqs], [1] * len(seqs),
                          engine.runner.store, kda_states=seqs)
        return run_decode(reqs, *sampling)

    graphs.run = run_decode_and_eager_context
    runner.run = timers.wrap("runner", runner.run)
    engine_module.draw = timers.wrap("sample", engine_module.draw)
    engine_module.fetch = timers.wrap("sample", engine_module.fetch)
    return engine, timers, logits


def measure(batch: int, context: int, warmup: int, iters: int, seed: int, sample_in_graph: bool = True) -> dict[str, Any]:
    original_draw, original_fetch = engine_module.draw, engine_module.fetch  # build_engine wraps them with timers
    per: dict[str, list[float]] = {k: [] for k in (*PARTS, "step", "eager_ctx")}
    try:
        engine, timers, _ = build_engine(batch, context, warmup + iters, seed, sample_in_graph)
        for it in range(warmup + iters):
            reqs = list(engine.running)
            timers.ms.clear()
            t0 = clock()
            done = engine.step()
            ms = dict(timers.ms)
            step_ms = (clock() - t0) * 1e3 - ms["eager_ctx"]
            assert not done and engine.num_steps, "a request finished inside the timed window"
            assert len(engine.running) == batch and all(r.num_computed == r.num_tokens - 1 for r in reqs)
            if it < warmup:
                continue
            ms["runner"] -= ms["decode_ctx"] + ms["eager_ctx"]
            ms["bookkeep"] = step_ms - sum(ms[k] for k in ("schedule", "runner", "decode_ctx", "sample"))
            for k in PARTS:
                per[k].append(ms[k])
            per["step"].append(step_ms)
            per["eager_ctx"].append(ms["eager_ctx"])
    finally:
        engine_module.draw, engine_module.fetch = original_draw, original_fetch
    return {"batch": batch, "context": context, **{f"{k}_ms": statistics.median(v) for k, v in per.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=_ints, default=[1, 64, 256])
    ap.add_argument("--contexts", type=_ints, default=[1024, 8192])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="measure each cell this many times, keep the fastest")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None, help="an earlier JSON of this script: its step figures as 'before'")
    ap.add_argument("--out", default=None, help="JSON result (default: print only)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script runs")
    ap.add_argument("--eager-sampling", action="store_true",
                    help="EngineConfig.sample_in_graph=False: the eager sampler after the decode graph")
    a = ap.parse_args()
    if a.smoke:
        a.batches, a.contexts, a.warmup, a.iters, a.rounds = [1, 3], [192], 1, 2, 1
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    results = []
    for ctx in a.contexts:
        for batch in a.batches:
            # the host is shared: keep the round with the lowest median step (each round a fresh engine)
            row = min((measure(batch, ctx, a.warmup, a.iters, a.seed, not a.eager_sampling) for _ in range(a.rounds)),
                      key=lambda r: r["step_ms"])
            results.append(row)
            print(f"batch {batch:4d} context {ctx:6d}: step {row['step_ms']:.3f} ms, decode ctx "
                  f"{row['decode_ctx_ms']:.3f} ms, eager ctx {row['eager_ctx_ms']:.3f} ms", flush=True)
    cols = [("batch", "batch", "d"), ("context", "context", "d")]
    if a.baseline:
        with open(a.baseline) as f:
            baseline = json.load(f)
        before = {(r["batch"], r["context"]): r for r in baseline["results"]}
        for r in results:
            b = before.get((r["batch"], r["context"]))
            if b is None:
                continue
            for k in (*PARTS, "step", "eager_ctx"):
                r[f"before_{k}_ms"] = b[f"{k}_ms"]
        cols += [("before_step_ms", "step ms (before)", ".3f")]
    cols += [("step_ms", "step ms", ".3f")] + [(f"{k}_ms", k.replace("_", " "), ".3f") for k in PARTS]
    if a.baseline:
        cols += [("before_decode_ctx_ms", "decode ctx (before)", ".3f"),
                 ("before_eager_ctx_ms", "eager ctx (before)", ".3f")]
    cols += [("eager_ctx_ms", "eager ctx ms", ".3f")]
    print(f"\nHost work per engine decode step (CPU, forward stubbed, page {PAGE}, median of {a.iters} steps)")
    print(table(results, cols))
    if a.out:
        write_json(a.out, {"benchmark": "engine_host_overhead", **env(), "device": "cpu (host work only)",
                           "page_size": PAGE, "vocab": VOCAB, "warmup": a.warmup, "iters": a.iters,
                           "rounds": a.rounds, "sample_in_graph": not a.eager_sampling,
                           "torch_threads": torch.get_num_threads(), "results": results,
                           "baseline_commit": baseline.get("commit") if a.baseline else None,
                           "wall_s": time.perf_counter() - t_start})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
