"""Every GEMM launch of one bitwise decode step, timed alone against its bytes bound and the stock kernel,
and (``--sweep``) under other tile configurations with its bits checked.

    python benchmarks/decode_gemms.py [--batches 64,256] [--layers 16] [--lora 32] [--sweep] [--out FILE.json]

The decode step's GEMMs (``_gemm_kernel`` and the split-K sums) take about a third of a graph-replayed step at
batch 256 (benchmarks/results/2026-12-05_h100_summary.md), but the step's profile names the kernel only. This
script runs one eager bitwise step of the bench model (LoRA on every attention projection and expert, as in
RL rollouts) and records every ``_launch`` of zmrl/kernels_batch_invariant/triton/matmul.py with its
arguments and the layer that issued it; then each launch is replayed alone:

* ``ms``: its device time with a cold L2, from CUDA-graph replays (``time_ms``): a decode step's weights are
  never in L2 (the step reads gigabytes), and the engine replays the step as a graph;
* ``bound_ms``: the bytes it must move (x, the weights of the experts it hits, y, the LoRA factors, partials
  of a split K) over the copy bandwidth measured in the same run;
* ``stock_ms``: cuBLAS on the same shapes in bf16 (``torch.mm`` / ``torch._grouped_mm`` for expert
  products): the speed a non-invariant engine gets;
* ``--sweep``: the launch under every configuration of ``SWEEP`` that the product admits (a split operand
  keeps its 64-wide K step; a LoRA epilogue at most a 128 x 128 tile), its output checked ``torch.equal`` to
  the default configuration's (the configuration decides which program computes an element, never its
  bits: the module doc of matmul.py), the fastest with equal bits reported.

Launches with the same signature (issuing site, mode, M, N, K, dtypes) are grouped; the table lists per group
the calls per step and the step's milliseconds under the default and the best configuration. The sum over
groups is the GEMM time of an isolated, cold-cache replay: compare it with the profile's ``[zmrl GEMM]`` row
of decode_throughput.py for the same batch.

``--smoke``: CPU, the tiny preset, the GEMMs under the Triton interpreter (checks the script end to end).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from _common import (build_bench_model, require_interpreter, copy_bandwidth_tb_s, default_out, env, pick_device,
                     setup_logging, table, write_json, _call_site)
from decode_throughput import PAGE, PENDING, fill_store, kda_template, make_seqs
from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.triton import matmul as mm
from zmrl.kernels_batch_invariant.triton import triton_everywhere
from zmrl.model import ModelCache, forward_incremental

log = logging.getLogger("benchmarks.decode_gemms")

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): decode-sized tiles over rows and columns, 64/128-wide K steps
SWEEP = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (32, 32, 128, 4, 4), (32, 64, 128, 4, 4),
         (32, 128, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3),
         (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)]


@dataclass
class Launch:
    """One recorded ``_launch``: its arguments (activations cloned at the call, weights by reference) and
    where it came from."""

    site: str
    args: tuple[Any, ...]  # x3, w3, bias, y3, cfg, m, n, k
    kwargs: dict[str, Any]  # experts, segments, delta, lora
    experts_hit: list[int] | None  # expert mode: the experts with rows (host copy of the offsets)
    segment_widths: list[int] | None  # segment mode: each segment's output columns

    @property
    def cfg(self) -> mm.GemmConfig:
        return self.args[4]

    def signature(self) -> str:
        x3, w3, _, y3, _, m, n, k = self.args
        mode = ("experts" if self.kwargs.get("experts") else
                f"concat{len(self.segment_widths)}" if self.kwargs.get("segments") else
                f"batch{x3.shape[0]}" if x3.shape[0] > 1 else "plain")
        extra = "+lora" if self.kwargs.get("lora") else "+delta" if self.kwargs.get("delta") is not None else ""
        d = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}
        return (f"{self.site} {mode}{extra} M{m} N{n} K{k} {d.get(x3.dtype, x3.dtype)}x{d.get(w3.dtype, w3.dtype)}"
                f"->{d.get(y3.dtype, y3.dtype)}")


def capture(x3, w3, bias, y3, cfg, m, n, k, **kw) -> Launch:  # type: ignore[no-untyped-def]
    """A ``_launch`` call as a replayable ``Launch``: activations, delta and LoRA t cloned (the caller reuses its
    buffers), weights by reference, the expert offsets and segment widths read once."""
    experts, segments, lora, delta = kw.get("experts"), kw.get("segments"), kw.get("lora"), kw.get("delta")
    hit = widths = None
    if experts is not None:
        offs = experts.offsets.tolist()
        hit = [e for e in range(experts.n_experts) if offs[e + 1] > offs[e]]
        experts = dataclasses.replace(experts, offsets=experts.offsets.clone())
    if segments is not None:
        cols = segments.col_offsets.tolist()
        widths = [cols[s + 1] - cols[s] for s in range(segments.n_segments)]
    if lora is not None:
        lora = dataclasses.replace(lora, t=lora.t.clone())
    return Launch(_call_site(), (x3.clone(), w3, bias, torch.empty_like(y3), cfg, m, n, k),
                  {"experts": experts, "segments": segments, "delta": None if delta is None else delta.clone(),
                   "lora": lora}, hit, widths)


def record_step(step: Callable[[], None]) -> list[Launch]:
    """The GEMM launches of one call of ``step``, in order. Under the interpreter ``_launch`` calls itself
    once for a 16-bit output; only the outer call counts."""
    launches: list[Launch] = []
    original = mm._launch
    depth = 0

    def recording(x3, w3, bias, y3, cfg, m, n, k, **kw):  # type: ignore[no-untyped-def]
        nonlocal depth
        if depth == 0:
            launches.append(capture(x3, w3, bias, y3, cfg, m, n, k, **kw))
        depth += 1
        try:
            return original(x3, w3, bias, y3, cfg, m, n, k, **kw)
        finally:
            depth -= 1

    mm._launch = recording
    try:
        step()
    finally:
        mm._launch = original
    return launches


def admits(launch: Launch, cfg: mm.GemmConfig) -> bool:
    """Whether ``_launch`` takes the product under ``cfg`` as the op would: a LoRA epilogue at most
    LORA_MAX_TILE."""
    return launch.kwargs.get("lora") is None or cfg.block_m * cfg.block_n <= mm.LORA_MAX_TILE


def run(launch: Launch, cfg: mm.GemmConfig) -> torch.Tensor:
    """The launch under ``cfg`` (grids resized as the ops size them); returns its output."""
    x3, w3, bias, y3, _, m, n, k = launch.args
    kw = dict(launch.kwargs)
    if kw.get("experts") is not None:
        kw["experts"] = dataclasses.replace(kw["experts"], n_tiles=mm._max_expert_tiles(m, kw["experts"].n_experts,
                                                                                      cfg.block_m))
    if kw.get("segments") is not None:
        kw["segments"] = dataclasses.replace(kw["segments"], n_tiles=sum(mm.cdiv(c, cfg.block_n)
                                                                         for c in launch.segment_widths))
    mm._launch(x3, w3, bias, y3, cfg, m, n, k, **kw)
    return y3


def bytes_moved(launch: Launch) -> int:
    """What the launch must read and write at least: x, the weights it uses (experts hit), bias, y, the LoRA
    t and B rows it uses, a delta, and a split K's fp32 partials (written and read back)."""
    x3, w3, bias, y3, _, m, n, k = launch.args
    kw = launch.kwargs
    es = w3.element_size()
    total = x3.numel() * x3.element_size() + y3.numel() * y3.element_size()
    if kw.get("experts") is not None:
        total += len(launch.experts_hit) * n * k * es
    else:
        total += x3.shape[0] * n * k * es if launch.segment_widths is None or not kw["segments"].x_blocks else \
            sum(launch.segment_widths) * k * es  # block-diagonal: an upper bound (K_s <= k)
    if bias is not None:
        total += bias.numel() * bias.element_size()
    lora = kw.get("lora")
    if lora is not None:
        r = lora.b.shape[-1]
        total += lora.t.numel() * 4 + (len(launch.experts_hit) if kw.get("experts") is not None else 1) * n * r * 4
    if kw.get("delta") is not None:
        total += kw["delta"].numel() * 4
    chunk = mm._k_chunk(x3.dtype, w3.dtype, k)
    if chunk:
        total += 2 * mm.cdiv(k, chunk) * x3.shape[0] * m * n * 4
    return total


def stock(launch: Launch) -> Callable[[], Any] | None:
    """cuBLAS on the launch's shapes in bf16: torch.mm for one product, torch._grouped_mm for expert
    products (where it exists), None for the rest."""
    x3, w3, _, _, _, m, n, k = launch.args
    dev = x3.device
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if launch.kwargs.get("experts") is not None:
        if not hasattr(torch, "_grouped_mm") or dev.type != "cuda":
            return None
        e = launch.kwargs["experts"].n_experts
        w = torch.randn(e, k, n, device=dev, dtype=torch.bfloat16)
        offs = launch.kwargs["experts"].offsets[1:].to(torch.int32)
        try:
            torch._grouped_mm(a, w, offs=offs)
        except Exception as err:  # not on every build / device
            log.info("torch._grouped_mm unavailable: %s", err)
            return None
        return lambda: torch._grouped_mm(a, w, offs=offs)
    g = x3.shape[0]
    b = torch.randn(g, k, n, device=dev, dtype=torch.bfloat16)
    a3 = a.expand(g, m, k).contiguous()
    return (lambda: torch.mm(a, b[0])) if g == 1 else (lambda: torch.bmm(a3, b))


_FLUSH: torch.Tensor | None = None


def time_ms(fn: Callable[[], Any], cuda: bool, reps: int = 20, samples: int = 7) -> float:
    """Device milliseconds of one ``fn`` with a cold L2. CUDA: ``reps`` x (overwrite a 128 MB buffer, ``fn``)
    captured in one graph, minus the same graph without ``fn``, median of ``samples`` replays: replaying
    takes the host out (an eager launch of these kernels costs more host time than the kernel runs, so
    event timing around eager calls measures the launcher), and the buffer write evicts the previous
    call's weights from the 50 MB L2 as a decode step's gigabytes do. CPU (``--smoke``): one wall-clock call."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(32 * 2**20, dtype=torch.float32, device="cuda")

    def graph_of(body: Callable[[], Any] | None) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _FLUSH.zero_()
            if body is not None:
                body()  # warm: allocations and compiles happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                _FLUSH.zero_()
                if body is not None:
                    body()
        return graph

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        times = []
        for _ in range(samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[samples // 2]

    with_fn, flush_only = graph_of(fn), graph_of(None)
    replay_ms(with_fn)  # first replay uploads the graph
    ms = (replay_ms(with_fn) - replay_ms(flush_only)) / reps
    del with_fn, flush_only
    return max(ms, 0.0)


def sweep_launch(launch: Launch, ms: float, configs: list[tuple[int, ...]], cuda: bool) -> dict[str, Any]:
    """``launch`` under every admissible config of ``configs`` (``ms``: its time under its own), each output
    checked ``torch.equal`` to its own config's: the tries, the configs whose bits differ (none expected: the
    module doc of matmul.py), and the fastest config with equal bits (its own if none is faster)."""
    ref = run(launch, launch.cfg).clone()
    tried: list[dict[str, Any]] = []
    for c in map(lambda t: mm.GemmConfig(*t), configs):
        if not admits(launch, c) or c == launch.cfg:
            continue
        try:
            same = torch.equal(run(launch, c), ref)
            t_ms = time_ms(lambda: run(launch, c), cuda) if same else None
        except Exception as err:  # e.g. out of shared memory for this tile
            tried.append({"config": str(c), "error": f"{type(err).__name__}: {err}"[:200]})
            continue
        tried.append({"config": str(c), "equal_bits": same, "ms": t_ms})
    ok = [t for t in tried if t.get("equal_bits") and t["ms"] is not None]
    best = min(ok, key=lambda t: t["ms"], default=None)
    if best is None or best["ms"] >= ms:
        best = {"config": str(launch.cfg), "ms": ms}
    return {"sweep": tried, "differing_bits": [t["config"] for t in tried if t.get("equal_bits") is False],
            "best_config": best["config"], "best_ms": best["ms"]}


def measure(launches: list[Launch], bw: float, cuda: bool, sweep_top: int) -> list[dict[str, Any]]:
    """One row per launch signature: calls per step, times, bounds; the ``sweep_top`` groups of the most step
    time swept over SWEEP (every config is a compile per kernel variant: the sweep stays where the time is)."""
    groups: dict[str, dict[str, Any]] = {}
    first: dict[str, Launch] = {}
    for launch in launches:
        sig = launch.signature()
        if sig in groups:
            groups[sig]["calls"] += 1
            continue
        first[sig] = launch
        row: dict[str, Any] = {"signature": sig, "calls": 1, "config": str(launch.cfg)}
        groups[sig] = row
        row["ms"] = time_ms(lambda: run(launch, launch.cfg), cuda)
        row["bytes"] = bytes_moved(launch)
        row["bound_ms"] = row["bytes"] / (bw * 1e12) * 1e3
        fn = stock(launch) if cuda else None
        row["stock_ms"] = time_ms(fn, cuda) if fn is not None else None
    # batched products (grouped_linear / bmm_fixed: tiles per matrix shape, bmm_config) have no sweep
    sweepable = [r for r in groups.values() if first[r["signature"]].args[0].shape[0] == 1]
    for row in sorted(sweepable, key=lambda r: -r["ms"] * r["calls"])[:sweep_top]:
        row.update(sweep_launch(first[row["signature"]], row["ms"], SWEEP, cuda))
    rows = list(groups.values())
    for r in rows:
        r["step_ms"] = r["ms"] * r["calls"]
        r["step_bound_ms"] = r["bound_ms"] * r["calls"]
        r["frac_bound"] = r["bound_ms"] / r["ms"]
        if r.get("stock_ms"):
            r["stock_over_ms"] = r["stock_ms"] / r["ms"]
        r["step_best_ms"] = r.get("best_ms", r["ms"]) * r["calls"]  # unswept groups keep their config
    rows.sort(key=lambda r: -r["step_ms"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",") if v], default=[256, 64])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024, help="nominal context (GEMMs do not depend on it)")
    ap.add_argument("--lora", type=int, default=32, metavar="R", help="LoRA rank (0 = base model)")
    ap.add_argument("--sweep", type=int, default=0, metavar="N",
                    help="time every admissible SWEEP config, bits checked, for the N groups of the most step time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, the GEMMs interpreted")
    a = ap.parse_args()
    setup_logging()
    dev = pick_device("decode_gemms.py", a.smoke)
    if not a.smoke:
        return measure_batches(a, dev)
    require_interpreter("decode_gemms.py --smoke")
    a.batches, a.context = [3], 192
    with triton_everywhere():  # the Triton backends on CPU tensors, interpreted
        return measure_batches(a, dev)


def measure_batches(a: argparse.Namespace, dev: torch.device) -> int:
    t_start = time.perf_counter()
    torch.manual_seed(a.seed)
    cfg, model = build_bench_model(a.layers, a.smoke, dev, a.lora, a.seed)
    cuda = dev.type == "cuda"
    bw = copy_bandwidth_tb_s(dev, gib=0.25 if a.smoke else 2.0)
    template = kda_template(model, dev)
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    per_batch: dict[str, Any] = {}
    for batch in a.batches:
        ctx_tokens = a.context - PENDING
        pages = batch * -(-(ctx_tokens + 2) // PAGE) + 1
        cache = ModelCache(cfg, num_pages=pages, page_size=PAGE, dtype=model.dtype, device=dev)
        fill_store(cache, gen)
        seqs = make_seqs(cache, template, batch, ctx_tokens, 2)
        tokens = [torch.randint(0, cfg.vocab_size, (1,), device=dev, generator=gen) for _ in range(batch)]
        with kernel_mode("bitwise"):
            launches = record_step(lambda: forward_incremental(model, cache, seqs, tokens, logits_rows="last"))
            rows = measure(launches, bw, cuda, a.sweep)
        total = {k: sum(r.get(k) or 0.0 for r in rows) for k in ("step_ms", "step_bound_ms", "step_best_ms")}
        per_batch[str(batch)] = {"launches": len(launches), "groups": rows, "totals": total}
        cols = [("calls", "calls", "d"), ("config", "config", "s"), ("ms", "ms", ".4f"), ("bound_ms", "bound ms", ".4f"),
                ("frac_bound", "of bound", ".0%"), ("stock_ms", "cuBLAS bf16 ms", ".4f"), ("step_ms", "step ms", ".3f")]
        if a.sweep:
            cols += [("best_config", "best config", "s"), ("step_best_ms", "step ms best", ".3f")]
        print(f"\nGEMM launches of one decode step, batch {batch}, bench preset{' (tiny)' if a.smoke else ''}, "
              f"LoRA r={a.lora}, copy bandwidth {bw:.2f} TB/s: {len(launches)} launches; per step "
              f"{total['step_ms']:.3f} ms (bound {total['step_bound_ms']:.3f} ms"
              + (f", with the best configs of the {a.sweep} swept groups {total['step_best_ms']:.3f} ms" if a.sweep else "")
              + ")")
        print(table(rows, [("signature", "launch", "s"), *cols]))
        del cache, seqs
        # written after every batch: a run cut by its time limit keeps what it measured
        payload = {"benchmark": "decode_gemms", **env(), "preset": "tiny" if a.smoke else "bench", "lora_r": a.lora,
                   "copy_bandwidth_tb_s": bw, "sweep_groups": a.sweep, "batches": per_batch,
                   "wall_s": time.perf_counter() - t_start}
        write_json(a.out or default_out("decode_gemms" + ("_smoke" if a.smoke else "")), payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
