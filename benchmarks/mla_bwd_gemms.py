"""The MLA backward's bf16-operand, fp32-output GEMMs on the trainer's chunk shapes: zmrl's Triton
``mm_f32`` (triton/bwd_matmul.py) under its shape configs and alternatives, against torch's
``mm(out_dtype=float32)`` (cuBLAS), with TFLOP/s and the fraction of the bf16 matmul peak measured in the
same run (torch.mm at 8192^3).

A chunk of the backward (kernels_batch_invariant/mla_attention_grads.py, bf16 path) holds G queries x H heads
over the U unique keys of their lists, and runs four products:

    S  = q_s [G*H, Dc+Dr] @ K^T           (K^T a transposed view of the gathered keys [U, Dc+Dr])
    dP = dO  [G*H, Dc]    @ C^T           (C = the latent columns of K)
    dQ = scale * dS [G*H, U] @ K          (written into the query-gradient rows)
    dK = dS^T [U, G*H] @ q_s  (+ P^T dO on the first Dc columns: dV)

G follows the backward's own chunk rule; U = 2048 (a chunk in the first half of a 4096-token sequence)
and 4096 (the second half: top-2048 lists out of 4096 keys). Each result is checked against torch's.

    python benchmarks/mla_bwd_gemms.py [--u 2048,4096] [--configs 128x256x64/w8/s3,...] [--out PATH]
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

import torch

from _common import cuda_time_ms, default_out, env, require_cuda, setup_logging, table, write_json  # noqa: I001
from _train_flops import measured_matmul_peak_tflops

from zmrl.kernels_batch_invariant.mla_attention_grads import CHUNK_ELEMS
from zmrl.kernels_batch_invariant.triton.bwd_matmul import MmConfig, mm_config, mm_f32

log = logging.getLogger("benchmarks.mla_bwd_gemms")

CANDIDATES = ("128x256x64/w8/s3", "128x128x64/w8/s3", "128x128x64/w4/s4", "256x128x64/w8/s3", "128x64x64/w4/s4",
              "128x64x64/w4/s3", "64x64x64/w4/s4", "256x64x64/w8/s3", "128x64x128/w4/s3", "64x128x64/w4/s4")


def products(g: int, h: int, u: int, dc: int, dr: int, scale: float, dev: torch.device
             ) -> list[tuple[str, int, Callable[[MmConfig | None], torch.Tensor], Callable[[], torch.Tensor]]]:
    """(name, FLOPs, zmrl call under a config, the torch reference call) for one chunk."""
    bf = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev).to(bf)

    rows, d = g * h, dc + dr
    qs, k, go = r(rows, d), r(u, d), r(rows, dc)
    ds, p = r(rows, u), r(rows, u)
    c = k[:, :dc]
    f32 = torch.float32
    dq_out = torch.empty(rows, d, dtype=f32, device=dev)

    def torch_dk() -> torch.Tensor:
        dk = torch.mm(ds.t(), qs, out_dtype=f32)
        dk[:, :dc] += torch.mm(p.t(), go, out_dtype=f32)
        return dk

    return [
        ("S = q K^T", 2 * rows * u * d, lambda cfg: mm_f32(qs, k.t(), config=cfg),
         lambda: torch.mm(qs, k.t(), out_dtype=f32)),
        ("dP = dO C^T", 2 * rows * u * dc, lambda cfg: mm_f32(go, c.t(), config=cfg),
         lambda: torch.mm(go, c.t(), out_dtype=f32)),
        ("dQ = s dS K", 2 * rows * u * d, lambda cfg: mm_f32(ds, k, scale, out=dq_out, config=cfg),
         lambda: torch.mm(ds, k, out_dtype=f32).mul_(scale)),
        ("dK = dS^T q + P^T dO", 2 * rows * u * (d + dc), lambda cfg: mm_f32(ds.t(), qs, second=(p.t(), go), config=cfg),
         torch_dk),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--u", default="2048,4096", help="unique keys per chunk (comma-separated)")
    ap.add_argument("--configs", default=",".join(CANDIDATES), help="alternative configs to time per product")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--out", default=str(default_out("mla_bwd_gemms")))
    a = ap.parse_args()
    setup_logging()
    dev = require_cuda("mla_bwd_gemms.py")
    dc, dr, h = 512, 64, a.heads
    g = max(1, CHUNK_ELEMS // (h * 2 * a.topk))  # mla_attention_grads' chunk rule
    scale = (128 + dr) ** -0.5
    peak = measured_matmul_peak_tflops(dev)
    log.info("bf16 matmul peak %.0f TFLOP/s; chunk G = %d queries x %d heads", peak, g, h)
    rows: list[dict[str, Any]] = []
    for u in (int(x) for x in a.u.split(",")):
        for name, flops, ours, ref in products(g, h, u, dc, dr, scale, dev):
            want = ref()
            base = cuda_time_ms(ref, warmup=3, iters=10)["median_ms"]
            default = mm_config(want.shape[0], want.shape[1], 0)
            for text in [str(default), *(x for x in a.configs.split(",") if x and x != str(default))]:
                cfg = MmConfig.parse(text)
                try:
                    got = ours(cfg)
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    ms = cuda_time_ms(lambda: ours(cfg), warmup=3, iters=10)["median_ms"]
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not a crash
                    rows.append(dict(u=u, product=name, config=text, error=f"{type(exc).__name__}: {exc}"[:120]))
                    continue
                tf = flops / (ms * 1e-3) / 1e12
                rows.append(dict(u=u, product=name, config=text, default=text == str(default), ms=ms, cublas_ms=base,
                                 speedup=base / ms, tflop_s=tf, frac_peak=tf / peak, max_rel_diff=err))
            torch.cuda.empty_cache()
    print(table(rows, [("u", "U", "d"), ("product", "product", "s"), ("config", "config", "s"),
                       ("default", "default", "s"), ("ms", "zmrl ms", ".3f"), ("cublas_ms", "cuBLAS ms", ".3f"),
                       ("speedup", "x cuBLAS", ".2f"), ("tflop_s", "TFLOP/s", ".0f"), ("frac_peak", "of peak", ".1%"),
                       ("max_rel_diff", "max rel diff", ".1e"), ("error", "error", "s")]))
    write_json(a.out, dict(benchmark="mla_bwd_gemms", **env(), peak_tflops=peak, chunk_queries=g, heads=h,
                           dc=dc, dr=dr, rows=rows))


if __name__ == "__main__":
    main()
