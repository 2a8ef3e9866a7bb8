"""Every invariant GEMM launch of one trainer forward (a packed micro-batch, autograd on), timed where it runs,
against the matmul peak and cuBLAS on the same shapes.

    python benchmarks/train_gemms.py [--seq-lens 4096,4096,4096,4096] [--layers 16] [--lora 32] [--sweep N]
                                     [--out FILE.json]

Why: at 16K tokens the invariant GEMM is the largest item of the trainer's forward (benchmarks/results/
2026-12-06_h100_mla_keys_summary.md: 174 ms for ~26 TFLOP), but the profile names ``_gemm_kernel`` only. This
script runs the forward ``benchmarks/trainer_throughput.py`` times (``zmrl.trainer.compute_logprobs`` on the bench
model with LoRA on every attention projection and expert) twice: a warm-up, then one with CUDA events around
every ``_launch`` of zmrl/kernels_batch_invariant/triton/matmul.py (the launches stay in place: their inputs are
the forward's own, nothing is cloned). Launches with one signature (issuing site, mode, M, N, K, dtypes) are
grouped; per group: calls, device ms, the FLOPs (2 M N K; an expert product's M is its rows), the fraction of
the bf16 matmul peak measured in the same run, and cuBLAS bf16 on one call's shape (``torch.mm``, or
``torch._grouped_mm`` over the same expert row counts). The events serialize nothing but each launch with itself,
so a group's ms is its kernels' device time.

``--sweep N``: the first launch of each of the N groups of the most time (the batched ``bmm_fixed`` products
too: their tiles come from ``bmm_config``, a function of the per-matrix shape) is replayed alone with a cold L2 (decode_gemms.time_ms) under every
config of TRAIN_SWEEP it admits, its output checked ``torch.equal`` to its own config's
(decode_gemms.sweep_launch); the fastest with equal bits is reported. ``--sweep-budget-s`` stops starting new
groups after that many seconds (each config is a compile per kernel variant).

``--smoke``: CPU, the tiny preset, the GEMMs under the Triton interpreter, host-clock times (checks the script).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from _common import (build_bench_model, default_out, env, pick_device,
                     require_interpreter, setup_logging, table, write_json, _call_site)
from _train_flops import measured_matmul_peak_tflops
from decode_gemms import Launch, capture, run, sweep_launch, time_ms
from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.triton import matmul as mm
from zmrl.kernels_batch_invariant.triton import triton_everywhere
from zmrl.trainer import compute_logprobs

log = logging.getLogger("benchmarks.train_gemms")
_DT = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): training-sized tiles; a split operand keeps its 64-wide K step
TRAIN_SWEEP = [(64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (128, 32, 64, 4, 4), (128, 64, 64, 4, 4), (128, 64, 64, 8, 3),
               (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (256, 64, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3),
               (64, 64, 128, 4, 3), (128, 64, 128, 8, 3)]


@dataclass
class Group:
    """The launches of one signature: their device times and what one of them computes."""

    signature: str
    m: int
    n: int
    k: int
    g: int  # batch elements (grouped / batched products)
    expert_rows: list[int] | None  # expert mode: rows per expert (one call's)
    flop: float  # one call's 2 M N K (summed over batch elements)
    ms: list[float] = field(default_factory=list)
    config: str = ""  # the config its launches ran
    first: Launch | None = None  # its first launch, replayable (only when sweeping)


def _signature(x3: torch.Tensor, w3: torch.Tensor, y3: torch.Tensor, m: int, n: int, k: int,
               kw: dict[str, Any]) -> str:
    segments = kw.get("segments")
    mode = ("experts" if kw.get("experts") is not None else f"concat{segments.n_segments}" if segments is not None
            else f"batch{x3.shape[0]}" if x3.shape[0] > 1 else "plain")
    extra = "+lora" if kw.get("lora") is not None else "+delta" if kw.get("delta") is not None else ""
    return (f"{_call_site()} {mode}{extra} M{m} N{n} K{k} "
            f"{_DT.get(x3.dtype, x3.dtype)}x{_DT.get(w3.dtype, w3.dtype)}->{_DT.get(y3.dtype, y3.dtype)}")


def timed_launches(step: Callable[[], None], cuda: bool, keep_first: bool = False) -> list[Group]:
    """Run ``step`` with every outer ``_launch`` timed (CUDA events, or the host clock on CPU); grouped by signature
    in order of first appearance; ``keep_first``: each group's first launch captured for replay."""
    groups: dict[str, Group] = {}
    pending: list[tuple[Group, Any, Any]] = []
    original = mm._launch
    depth = 0

    def timing(x3, w3, bias, y3, cfg, m, n, k, **kw):  # type: ignore[no-untyped-def]
        nonlocal depth
        if depth:
            return original(x3, w3, bias, y3, cfg, m, n, k, **kw)
        sig = _signature(x3, w3, y3, m, n, k, kw)
        grp = groups.get(sig)
        if grp is None:
            experts = kw.get("experts")
            rows = None
            if experts is not None:
                offs = experts.offsets.tolist()
                rows = [offs[e + 1] - offs[e] for e in range(experts.n_experts)]
            grp = groups[sig] = Group(sig, m, n, k, x3.shape[0], rows, 2.0 * x3.shape[0] * m * n * k, config=str(cfg))
            if keep_first:
                grp.first = capture(x3, w3, bias, y3, cfg, m, n, k, **kw)
        depth += 1
        try:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = original(x3, w3, bias, y3, cfg, m, n, k, **kw)
                end.record()
                pending.append((grp, start, end))
            else:
                t0 = time.perf_counter()
                out = original(x3, w3, bias, y3, cfg, m, n, k, **kw)
                grp.ms.append((time.perf_counter() - t0) * 1e3)
            return out
        finally:
            depth -= 1

    mm._launch = timing
    try:
        step()
    finally:
        mm._launch = original
    if cuda:
        torch.cuda.synchronize()
        for grp, start, end in pending:
            grp.ms.append(start.elapsed_time(end))
    return list(groups.values())


def stock_ms(grp: Group, device: torch.device) -> float | None:
    """cuBLAS bf16 on one call's shape: torch.mm / bmm, or torch._grouped_mm over the same expert row counts."""
    if device.type != "cuda":
        return None
    a = torch.randn(grp.m, grp.k, device=device, dtype=torch.bfloat16)
    if grp.expert_rows is not None:
        if not hasattr(torch, "_grouped_mm"):
            return None
        w = torch.randn(len(grp.expert_rows), grp.k, grp.n, device=device, dtype=torch.bfloat16)
        offs = torch.tensor(grp.expert_rows, device=device, dtype=torch.int32).cumsum(0).to(torch.int32)
        fn: Callable[[], Any] = lambda: torch._grouped_mm(a, w, offs=offs)  # noqa: E731
    elif grp.g > 1:
        a3 = a.expand(grp.g, grp.m, grp.k).contiguous()
        b3 = torch.randn(grp.g, grp.k, grp.n, device=device, dtype=torch.bfloat16)
        fn = lambda: torch.bmm(a3, b3)  # noqa: E731
    else:
        b = torch.randn(grp.k, grp.n, device=device, dtype=torch.bfloat16)
        fn = lambda: torch.mm(a, b)  # noqa: E731
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=3, rep=20))
    except Exception as err:  # noqa: BLE001 - a shape cuBLAS (or this torch) does not take is a row without it
        log.info("no cuBLAS figure for %s: %s", grp.signature, err)
        return None


def sweep_groups(groups: list[Group], top: int, budget_s: float, cuda: bool) -> dict[str, dict[str, Any]]:
    """``decode_gemms.sweep_launch`` over TRAIN_SWEEP for the ``top`` groups of the most time, each group's own
    config timed the same way (``replay_ms``: alone, cold L2); new groups stop after ``budget_s``."""
    t0 = time.perf_counter()
    out: dict[str, dict[str, Any]] = {}
    captured = [g for g in groups if g.first is not None]
    for grp in sorted(captured, key=lambda g: -sum(g.ms))[:top]:
        if time.perf_counter() - t0 > budget_s:
            log.info("sweep budget spent: %s not swept", grp.signature)
            continue
        launch = grp.first
        own = time_ms(lambda: run(launch, launch.cfg), cuda)
        out[grp.signature] = {"replay_ms": own, **sweep_launch(launch, own, TRAIN_SWEEP, cuda)}
        grp.first = None  # its clones freed
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=lambda s: [int(v) for v in s.split(",") if v], default=[4096] * 4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--lora", type=int, default=32, metavar="R", help="LoRA rank (0 = base model)")
    ap.add_argument("--sweep", type=int, default=0, metavar="N",
                    help="replay the N groups of the most time under every TRAIN_SWEEP config, bits checked")
    ap.add_argument("--sweep-budget-s", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, the GEMMs interpreted")
    a = ap.parse_args()
    setup_logging()
    dev = pick_device("train_gemms.py", a.smoke)
    if a.smoke:
        require_interpreter("train_gemms.py --smoke")
        a.seq_lens = [24, 24]
    cuda = dev.type == "cuda"
    cfg, model = build_bench_model(a.layers, a.smoke, dev, a.lora, a.seed)
    g = torch.Generator().manual_seed(a.seed)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in a.seq_lens]
    plens = [max(1, n // 2) for n in a.seq_lens]

    def forward() -> None:
        with torch.enable_grad(), kernel_mode("bitwise"):
            compute_logprobs(model, seqs, plens, 1.0, micro_batch_tokens=None)

    with triton_everywhere() if a.smoke else contextlib.nullcontext():  # smoke: the Triton backends on the CPU
        forward()  # compiles, weight tables
        groups = timed_launches(forward, cuda, keep_first=a.sweep > 0)
        swept = sweep_groups(groups, a.sweep, a.sweep_budget_s, cuda)
    peak = measured_matmul_peak_tflops(dev) if cuda else None
    rows = []
    for grp in groups:
        ms = sum(grp.ms)
        tflops = grp.flop * len(grp.ms) / (ms * 1e-3) / 1e12 if ms > 0 else 0.0
        stock = stock_ms(grp, dev)
        rows.append({"signature": grp.signature, "calls": len(grp.ms), "ms": ms, "ms_per_call": ms / len(grp.ms),
                     "tflop": grp.flop * len(grp.ms) / 1e12, "tflop_s": tflops,
                     "of_peak": None if peak is None else tflops / peak, "cublas_ms_per_call": stock,
                     "vs_cublas": None if stock is None else stock / (ms / len(grp.ms)),
                     "config": grp.config, **swept.get(grp.signature, {})})
    rows.sort(key=lambda r: -r["ms"])
    total_ms = sum(r["ms"] for r in rows)
    total_tflop = sum(r["tflop"] for r in rows)
    print(f"\nGEMM launches of one trainer forward, {'+'.join(map(str, a.seq_lens))} packed tokens, "
          f"{'tiny' if a.smoke else 'bench'} preset ({cfg.num_hidden_layers} layers), LoRA r={a.lora}: "
          f"{sum(r['calls'] for r in rows)} launches, {total_ms:.1f} ms, {total_tflop:.2f} TFLOP"
          + (f", matmul peak {peak:.0f} TFLOP/s measured" if peak else ""))
    print(table(rows, [("signature", "launch", "s"), ("calls", "calls", "d"), ("ms", "ms", ".3f"),
                       ("tflop_s", "TFLOP/s", ".1f"), ("of_peak", "of peak", ".0%"),
                       ("cublas_ms_per_call", "cuBLAS ms/call", ".4f"), ("vs_cublas", "vs cuBLAS", ".2f")]))
    for r in rows:
        if "best_ms" in r:
            print(f"sweep {r['signature']}: {r['config']} {r['replay_ms']:.4f} ms -> {r['best_config']} "
                  f"{r['best_ms']:.4f} ms; differing bits: {r['differing_bits'] or 'none'}")
    write_json(a.out or default_out("train_gemms" + ("_smoke" if a.smoke else "")),
               {"benchmark": "train_gemms", **env(), "seq_lens": a.seq_lens, "lora_r": a.lora,
                "matmul_peak_tflop_s": peak, "total_ms": total_ms, "total_tflop": total_tflop, "groups": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
