"""Benchmark 1: the batch-invariant Triton GEMM vs cuBLAS on the bench model's projection shapes.

For every projection of ``ModelConfig.preset("bench")`` (KDA q/k/v and o_proj, MLA q_a/q_b/kv_a/o_proj,
indexer wq_b, lm_head, the MoE experts as one grouped GEMM over 64 experts with top-8 routing) and
M in {1, 8, 64, 256, 1024, 4096} tokens, times (triton.testing.do_bench, median, L2 flushed between
runs) the invariant Triton kernel and the stock one it replaces in fast mode (cuBLAS ``F.linear``,
bf16; for the experts ``torch._grouped_mm`` where this torch has it, else one ``F.linear`` per
expert), and prints a table: shape, M, invariant us, cuBLAS us, ratio, TFLOP/s and GB/s of the
invariant kernel. Results go to ``--out`` as JSON (date, git commit, GPU, torch/triton versions,
the config used per shape, every row).

Grouped expert rows also time the capture-safe form of ``expert_linear`` (row offsets as a device
tensor, as ``MoE.forward`` passes them on CUDA; docs/cuda_graph_decode.md item 7): its per-call time,
its host time per call (wall time of back-to-back calls without synchronising: the Python + launch
cost the GPU cannot hide at decode sizes), its CUDA-graph replay time, and whether its output equals
the host-offsets path bitwise; host times of the host-offsets path and of the baseline are reported
next to it (JSON keys ``device_offsets_*``, ``host_us``, ``baseline_host_us``; additive).

    python benchmarks/gemm_invariant_vs_cublas.py [--out PATH] [--ms 1,8,64] [--shapes lm_head,moe_up]
        [--config 64x32x64/w4/s4]   # force one launch config for every shape (try alternatives)
        [--sweep]                   # also time candidate configs per shape at M = 256, 4096
        [--sweep-decode]            # ... and decode configs at M = 1, 16, 64 (CUDA-graph replay device time)

Needs a CUDA GPU; finishes in well under 2 minutes on an H200 (``--sweep`` adds about a minute).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("gemm_bench")

DEFAULT_MS = (1, 8, 64, 256, 1024, 4096)
SWEEP_MS = (128, 256, 4096)
SWEEP_CONFIGS = ("128x128x64/w8/s3", "128x128x64/w4/s4", "128x256x64/w8/s3", "256x128x64/w8/s3",
                 "64x256x64/w4/s4", "128x64x64/w4/s4",
                 # batched decode (M = 65..256): more, smaller tiles
                 "64x32x64/w4/s4", "64x64x64/w4/s4", "64x128x64/w4/s4", "32x64x64/w4/s4", "64x64x128/w4/s3")
# Decode sizes are timed by CUDA-graph replay (device time: what a captured decode step pays), not per call.
SWEEP_DECODE_MS = (1, 16, 64)
SWEEP_DECODE_CONFIGS = ("64x32x64/w4/s4", "64x64x64/w4/s4", "16x32x64/w4/s4", "16x32x128/w4/s4", "16x64x128/w4/s4",
                        "16x16x256/w4/s3", "16x32x256/w4/s3", "32x32x128/w4/s4", "16x64x64/w4/s6", "16x128x128/w8/s4")


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int
    experts: int = 0  # > 0: grouped expert GEMM (rows = M * top_k spread over this many experts)
    top_k: int = 0


def bench_shapes() -> list[Shape]:
    """Projection shapes of the bench preset (the same numbers zmrl/capacity/sizing.py enumerates)."""
    from zmrl.model import ModelConfig

    c = ModelConfig.preset("bench")
    d, la = c.hidden_size, c.linear_attn_config
    h, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    return [
        Shape("kda.qkv_proj", la.num_heads * la.head_dim, d),
        Shape("kda.o_proj", d, la.num_heads * la.head_dim),
        Shape("mla.q_a_proj", c.q_lora_rank, d),
        Shape("mla.q_b_proj", h * qk, c.q_lora_rank),
        Shape("mla.kv_a_proj", c.kv_lora_rank + c.qk_rope_head_dim, d),
        Shape("mla.o_proj", d, h * c.v_head_dim),
        Shape("indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        Shape("moe.gate_up(grouped)", c.moe_intermediate_size, d, c.n_routed_experts, c.num_experts_per_tok),
        Shape("moe.down(grouped)", d, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok),
        Shape("lm_head", c.vocab_size, d),
    ]


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _time_us(fn: Callable[[], object]) -> float:
    """Per-call time as the model sees it without CUDA graphs (host launch overhead included)."""
    import triton.testing

    return 1e3 * float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _graph_us(fn: Callable[[], object], calls: int = 20) -> float:
    """Device time per call: ``calls`` calls captured in one CUDA graph, replays timed (no host
    overhead, the kernel's own cost). NaN where the call cannot be captured (host syncs)."""
    import triton.testing

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return 1e3 * float(triton.testing.do_bench(graph.replay, warmup=5, rep=50, return_mode="median")) / calls
    except Exception as exc:  # capture refused (e.g. a host sync inside the call)
        log.warning("graph capture failed: %s", exc)
        return float("nan")


def _host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host wall time per call of ``calls`` back-to-back calls, no synchronisation in between (the
    launch queue is far from full at these counts, so this is the host's own cost per call)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def _device_offsets_row(shape: Shape, m: int, dev: torch.device, gen: torch.Generator,
                        base: Callable[[], object]) -> dict:
    """Extra columns of a grouped expert row: the device-offsets path next to the host-offsets one."""
    from zmrl.kernels_batch_invariant.moe_gemm import expert_linear
    from zmrl.kernels_batch_invariant.triton import triton_impl

    offs = _routing(m, shape)
    x = torch.randn(offs[-1], shape.k, device=dev, generator=gen).to(torch.bfloat16)
    ws = list(_weight(shape, dev, gen).unbind(0))
    dev_offs = torch.tensor(offs, dtype=torch.int32, device=dev)
    inv = triton_impl(expert_linear)

    def host_fn() -> torch.Tensor:
        return inv(x, ws, offs)

    def dev_fn() -> torch.Tensor:
        return inv(x, ws, dev_offs)

    equal = bool(torch.equal(dev_fn(), host_fn()))
    t_dev, g_dev = _time_us(dev_fn), _graph_us(dev_fn)
    h_dev, h_host, h_base = _host_us(dev_fn), _host_us(host_fn), _host_us(base)
    return {
        "device_offsets_us": t_dev, "graph_device_offsets_us": g_dev, "device_offsets_host_us": h_dev,
        "host_us": h_host, "baseline_host_us": h_base, "device_offsets_equal_host": equal,
    }


def _routing(m: int, shape: Shape) -> list[int]:
    """Expert offsets for M tokens x top_k: each token picks top_k distinct experts uniformly."""
    cpu = torch.Generator().manual_seed(m)
    picks = torch.rand(m, shape.experts, generator=cpu).topk(shape.top_k, dim=1).indices.flatten()
    counts = torch.bincount(picks, minlength=shape.experts).tolist()
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return offs


_WEIGHTS: dict[Shape, torch.Tensor] = {}


def _weight(shape: Shape, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    """The shape's bf16 weight ([N, K], or [E, N, K] stacked experts), made once per shape."""
    if shape not in _WEIGHTS:
        _WEIGHTS.clear()  # one shape at a time: lm_head alone is 0.7 GB
        dims = (shape.experts, shape.n, shape.k) if shape.experts else (shape.n, shape.k)
        _WEIGHTS[shape] = (torch.randn(dims, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    return _WEIGHTS[shape]


def _cases(shape: Shape, m: int, dev: torch.device, gen: torch.Generator):
    """(invariant fn, baseline fn, baseline name, flops, bytes) for one shape and M."""
    from zmrl.kernels_batch_invariant.matmul import linear
    from zmrl.kernels_batch_invariant.moe_gemm import expert_linear
    from zmrl.kernels_batch_invariant.triton import triton_impl

    bf = torch.bfloat16
    if not shape.experts:
        x = torch.randn(m, shape.k, device=dev, generator=gen).to(bf)
        w = _weight(shape, dev, gen)
        inv = triton_impl(linear)
        flops = 2 * m * shape.n * shape.k
        nbytes = 2 * (shape.n * shape.k + m * shape.k + m * shape.n)
        return (lambda: inv(x, w)), (lambda: F.linear(x, w)), "F.linear", flops, nbytes
    offs = _routing(m, shape)
    rows = offs[-1]
    x = torch.randn(rows, shape.k, device=dev, generator=gen).to(bf)
    stacked = _weight(shape, dev, gen)
    ws = list(stacked.unbind(0))  # the model passes per-expert tensors; here views of one stack
    inv = triton_impl(expert_linear)
    active = sum(1 for a, b in zip(offs, offs[1:]) if b > a)
    flops = 2 * rows * shape.n * shape.k
    nbytes = 2 * (active * shape.n * shape.k + rows * shape.k + rows * shape.n)
    if hasattr(torch, "_grouped_mm"):
        ends = torch.tensor(offs[1:], dtype=torch.int32, device=dev)
        wt = stacked.transpose(-2, -1)

        def base() -> torch.Tensor:
            return torch._grouped_mm(x, wt, offs=ends)
        name = "torch._grouped_mm"
        try:
            base()
        except (RuntimeError, TypeError) as exc:  # unsupported here: fall back to the per-expert loop
            log.warning("torch._grouped_mm unusable (%s); baseline = per-expert F.linear", exc)
            base, name = None, ""
        if base is not None:
            return (lambda: inv(x, ws, offs)), base, name, flops, nbytes

    def loop() -> None:
        for e, (a, b) in enumerate(zip(offs, offs[1:])):
            if b > a:
                F.linear(x[a:b], ws[e])
    return (lambda: inv(x, ws, offs)), loop, "F.linear per expert", flops, nbytes


def run(shapes: list[Shape], ms: list[int], forced: str | None, sweep: bool, device: str = "cuda",
        sweep_decode: bool = False) -> dict:
    import triton

    from zmrl.kernels_batch_invariant.triton import matmul as tmm

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    default_config = tmm.linear_config
    if forced:
        cfg = tmm.GemmConfig.parse(forced)
        tmm.linear_config = lambda n, k, dtype, m=1, experts=False: cfg
    rows, sweep_rows = [], []
    try:
        for shape in shapes:
            for m in ms:
                used = str(tmm.linear_config(shape.n, shape.k, torch.bfloat16, m))
                inv, base, base_name, flops, nbytes = _cases(shape, m, dev, gen)
                inv()  # compile outside the timing
                t_inv, t_base = _time_us(inv), _time_us(base)
                g_inv, g_base = _graph_us(inv), _graph_us(base)
                row = {
                    "graph_invariant_us": g_inv, "graph_baseline_us": g_base, "graph_ratio": g_inv / g_base,
                    "shape": shape.name, "n": shape.n, "k": shape.k, "m": m, "config": used,
                    "invariant_us": t_inv, "baseline_us": t_base, "baseline": base_name,
                    "ratio": t_inv / t_base, "tflops": flops / t_inv / 1e6, "gbps": nbytes / t_inv / 1e3,
                }
                if shape.experts:
                    row.update(_device_offsets_row(shape, m, dev, gen, base))
                rows.append(row)
            _WEIGHTS.clear()
            torch.cuda.empty_cache()
        sweeps = ([(SWEEP_CONFIGS, SWEEP_MS, _time_us)] if sweep else []) + (
            [(SWEEP_DECODE_CONFIGS, SWEEP_DECODE_MS, _graph_us)] if sweep_decode else [])
        for configs, sweep_ms, timer in sweeps:
            for shape in shapes:
                for text in configs:
                    cfg = tmm.GemmConfig.parse(text)
                    tmm.linear_config = lambda n, k, dtype, m=1, experts=False, cfg=cfg: cfg
                    for m in sweep_ms:
                        inv, _, _, flops, _ = _cases(shape, m, dev, gen)
                        try:
                            inv()
                        except Exception as exc:  # a config this GPU cannot compile (e.g. too much smem)
                            log.warning("%s %s: %s", shape.name, text, exc)
                            continue
                        t = timer(inv)
                        sweep_rows.append({"shape": shape.name, "m": m, "config": text, "invariant_us": t,
                                           "tflops": flops / t / 1e6,
                                           "timing": "graph replay" if timer is _graph_us else "per call"})
                _WEIGHTS.clear()
                torch.cuda.empty_cache()
    finally:
        _WEIGHTS.clear()
        tmm.linear_config = default_config
    return {
        "benchmark": "gemm_invariant_vs_cublas",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "dtype": "bfloat16", "timing": "triton.testing.do_bench median (warmup 10 ms, rep 50 ms, L2 flushed)",
        "forced_config": forced, "shapes": [asdict(s) for s in shapes], "rows": rows, "sweep": sweep_rows,
    }


def print_table(result: dict) -> None:
    hdr = (f"{'shape':<22}{'N':>7}{'K':>6}{'M':>6}  {'config':<18}{'inv us':>9}{'cuBLAS us':>10}{'ratio':>7}"
           f"{'TFLOP/s':>9}{'GB/s':>8}{'graph inv':>10}{'graph cuBLAS':>13}{'g.ratio':>8}")
    print(f"{result['gpu']}  torch {result['torch']}  triton {result['triton']}  commit {result['git_commit'][:10]}")
    print(hdr)
    print("-" * len(hdr))
    for r in result["rows"]:
        print(f"{r['shape']:<22}{r['n']:>7}{r['k']:>6}{r['m']:>6}  {r['config']:<18}{r['invariant_us']:>9.1f}"
              f"{r['baseline_us']:>10.1f}{r['ratio']:>7.2f}{r['tflops']:>9.1f}{r['gbps']:>8.0f}"
              f"{r['graph_invariant_us']:>10.1f}{r['graph_baseline_us']:>13.1f}{r['graph_ratio']:>8.2f}")
    print("(inv/cuBLAS us: per call incl. host launch overhead; graph columns: device time per call from "
          "CUDA-graph replays)")
    bases = sorted({r["baseline"] for r in result["rows"] if r["shape"].startswith("moe")})
    if bases:
        print(f"(grouped MoE rows: cuBLAS column = {', '.join(bases)})")
    grouped = [r for r in result["rows"] if "device_offsets_us" in r]
    if grouped:
        print("\ngrouped experts, host offsets (list) vs device offsets (capture-safe) vs baseline")
        ghdr = (f"{'shape':<22}{'M':>6}{'host-offs us':>13}{'dev-offs us':>12}{'baseline us':>12}"
                f"{'host/call: host-offs':>22}{'dev-offs':>10}{'baseline':>10}"
                f"{'graph dev-offs':>16}{'graph base':>12}{'bitwise':>9}")
        print(ghdr)
        print("-" * len(ghdr))
        for r in grouped:
            print(f"{r['shape']:<22}{r['m']:>6}{r['invariant_us']:>13.1f}{r['device_offsets_us']:>12.1f}"
                  f"{r['baseline_us']:>12.1f}{r['host_us']:>22.1f}{r['device_offsets_host_us']:>10.1f}"
                  f"{r['baseline_host_us']:>10.1f}{r['graph_device_offsets_us']:>16.1f}"
                  f"{r['graph_baseline_us']:>12.1f}{str(r['device_offsets_equal_host']):>9}")
        print("(host/call: host wall time per call, back-to-back calls; graph: device time per call from "
              "CUDA-graph replays; bitwise: device-offsets output == host-offsets output)")
    if result["sweep"]:
        print("\nconfig sweep (invariant us; best per shape and M marked *)")
        best: dict[tuple[str, int], float] = {}
        for r in result["sweep"]:
            key = (r["shape"], r["m"])
            best[key] = min(best.get(key, float("inf")), r["invariant_us"])
        for r in result["sweep"]:
            mark = "*" if r["invariant_us"] == best[(r["shape"], r["m"])] else " "
            print(f"  {r['shape']:<22}M={r['m']:<6}{r['config']:<18}{r['invariant_us']:>9.1f}{mark}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / f"{today}_gemm_h200.json"))
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="comma-separated token counts M")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape names (default: all)")
    ap.add_argument("--config", default=None, help="force one config for every shape, e.g. 64x32x64/w4/s4")
    ap.add_argument("--sweep", action="store_true", help="also time candidate configs per shape")
    ap.add_argument("--sweep-decode", action="store_true",
                    help="also time decode-sized candidate configs (M = 1, 16, 64) by CUDA-graph replay")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("gemm_invariant_vs_cublas: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "nothing to benchmark on this machine.", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gemm_invariant_vs_cublas: triton is not installed.", file=sys.stderr)
        return 2
    shapes = bench_shapes()
    if args.shapes:
        keys = [s for s in args.shapes.split(",") if s]
        shapes = [s for s in shapes if any(k in s.name for k in keys)]
    ms = [int(v) for v in args.ms.split(",") if v]
    result = run(shapes, ms, args.config, args.sweep, sweep_decode=args.sweep_decode)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
