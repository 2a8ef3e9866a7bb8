"""Probe: the invariant GEMM with a rank-32 LoRA delta at training rows, with the delta added after the K loop (the
epilogue, a second fp32 accumulator) or used as the accumulator's initial value (the prologue: one accumulator, so
larger tiles fit), against the same GEMM without LoRA and cuBLAS, on the trainer's widest LoRA shapes.

    python benchmarks/probes/lora_prologue_probe.py [--out FILE.json]

Every variant is timed in the banded launch order with CUDA events (warm L2 between repetitions), its error against
float64 reported next to it (the prologue changes the rounding sequence, not the accuracy class).
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
# (name, lora, prologue, config or None for the library's)
VARIANTS = [("no lora", False, False, None), ("epilogue", True, False, None),
            ("epilogue 128x64 w4", True, False, (128, 64, 64, 4, 4)),
            ("prologue 128x128 w8", True, True, (128, 128, 64, 8, 3)),
            ("prologue 128x256 w8", True, True, (128, 256, 64, 8, 3)),
            ("prologue 256x128 w8", True, True, (256, 128, 64, 8, 3))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()
    dev = require_cuda("lora_prologue_probe")
    peak = measured_matmul_peak_tflops(dev)
    lin = triton_impl(linear)
    real_config, real_max = tmm.linear_config, tmm.LORA_MAX_TILE
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
        for name, lora, prologue, cfg in VARIANTS:
            try:
                tmm.LORA_FIRST = prologue
                if cfg is not None:
                    tmm.linear_config = lambda *a, _c=tmm.GemmConfig(*cfg), **kw: _c
                    tmm.LORA_MAX_TILE = 1 << 20
                call = (lambda: lin(x, w, lora=up)) if lora else (lambda: lin(x, w))
                y = call()
                ms = cuda_time_ms(call, warmup=3, iters=10)["median_ms"]
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item() if lora else None
                rows.append(dict(shape=f"{m}x{n}x{k}", variant=name, ms=ms, tflop_s=flop / ms / 1e9,
                                 of_peak=flop / ms / 1e9 / peak, vs_cublas=cublas / ms, max_err=err))
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is a row, not the end of the probe
                rows.append(dict(shape=f"{m}x{n}x{k}", variant=name, error=f"{type(exc).__name__}: {exc}"[:200]))
            finally:
                tmm.LORA_FIRST, tmm.linear_config, tmm.LORA_MAX_TILE = False, real_config, real_max
    print(table(rows, [("shape", "shape", "s"), ("variant", "variant", "s"), ("ms", "ms", ".3f"),
                       ("tflop_s", "TFLOP/s", ".0f"), ("of_peak", "of peak", ".2f"), ("vs_cublas", "vs cuBLAS", ".2f"),
                       ("max_err", "rel err", ".1e"), ("error", "error", "s")]))
    write_json(args.out or "lora_prologue_probe.json", dict(env(), peak_tflop_s=peak, rows=rows))


if __name__ == "__main__":
    main()
