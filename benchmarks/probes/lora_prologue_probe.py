"""Probe: the invariant GEMM with a rank-32 LoRA delta from its factors at training rows, under its library tiles
and the large ones, against the same GEMM without LoRA and cuBLAS, on the trainer's widest LoRA shapes.

    python benchmarks/probes/lora_prologue_probe.py [--out FILE.json]

The LoRA delta is the accumulator's initial value (matmul.py's module doc), so a tile holds one accumulator. Until
c816b6d it was added after the K loop from a second accumulator, which capped the tile at 128 x 128: this probe
compared the two forms then (benchmarks/results/2026-12-06_lora_prologue_probe_h100.json, rows "epilogue" and
"prologue"); the epilogue form no longer exists. Every variant is timed in the banded launch order with CUDA events
(warm L2 between repetitions), its error against float64 reported next to it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cuda_time_ms, env, require_cuda, setup_logging, table, write_json  # noqa: E402
from _train_flops import measured_matmul_peak_tflops  # noqa: E402
from zmrl.kernels_batch_invariant.matmul import LoraUp, linear  # noqa: E402
from zmrl.kernels_batch_invariant.triton import matmul as tmm  # noqa: E402
from zmrl.kernels_batch_invariant.triton import triton_impl  # noqa: E402

SHAPES = [(16384, 6400, 2048), (16384, 2048, 2048), (16384, 2048, 8192), (16384, 12288, 768), (16384, 512, 2048)]
# (name, lora, config or None for the library's)
VARIANTS = [("no lora", False, None), ("lora", True, None), ("lora 128x128 w8", True, (128, 128, 64, 8, 3)),
            ("lora 128x256 w8", True, (128, 256, 64, 8, 3)), ("lora 256x128 w8", True, (256, 128, 64, 8, 3))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()
    dev = require_cuda("lora_prologue_probe")
    peak = measured_matmul_peak_tflops(dev)
    lin = triton_impl(linear)
    real_config, real_lora_config = tmm.linear_config, tmm.lora_config
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device=dev, generator=g).bfloat16()
        w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).bfloat16()
        t = torch.randn(m, 32, device=dev, generator=g)
        b = torch.randn(n, 32, device=dev, generator=g) / 32**0.5
        up = LoraUp(t, b, 2.0)
        ref = x.double() @ w.double().t() + 2.0 * (t.double() @ b.double().t())
        flop = 2 * m * n * k
        cublas = cuda_time_ms(lambda: torch.mm(x, w.t()), warmup=3, iters=10)["median_ms"]
        rows.append(dict(shape=f"{m}x{n}x{k}", variant="cuBLAS bf16 (no lora)", ms=cublas, tflop_s=flop / cublas / 1e9,
                         of_peak=flop / cublas / 1e9 / peak, max_err=None))
        for name, lora, cfg in VARIANTS:
            try:
                if cfg is not None:  # this tile, not the one lora_config would make of it
                    tmm.linear_config = lambda *a, _c=tmm.GemmConfig(*cfg), **kw: _c
                    tmm.lora_config = lambda c, n: c
                call = (lambda: lin(x, w, lora=up)) if lora else (lambda: lin(x, w))
                y = call()
                ms = cuda_time_ms(call, warmup=3, iters=10)["median_ms"]
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item() if lora else None
                rows.append(dict(shape=f"{m}x{n}x{k}", variant=name, ms=ms, tflop_s=flop / ms / 1e9,
                                 of_peak=flop / ms / 1e9 / peak, vs_cublas=cublas / ms, max_err=err))
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is a row, not the end of the probe
                rows.append(dict(shape=f"{m}x{n}x{k}", variant=name, error=f"{type(exc).__name__}: {exc}"[:200]))
            finally:
                tmm.linear_config, tmm.lora_config = real_config, real_lora_config
    print(table(rows, [("shape", "shape", "s"), ("variant", "variant", "s"), ("ms", "ms", ".3f"),
                       ("tflop_s", "TFLOP/s", ".0f"), ("of_peak", "of peak", ".2f"), ("vs_cublas", "vs cuBLAS", ".2f"),
                       ("max_err", "rel err", ".1e"), ("error", "error", "s")]))
    write_json(args.out or "lora_prologue_probe.json", dict(env(), peak_tflop_s=peak, rows=rows))


if __name__ == "__main__":
    main()
