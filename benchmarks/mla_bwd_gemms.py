"""The MLA backward's bf16-operand, fp32-output GEMMs (cuBLAS through torch's ``out_dtype``) on the trainer's
chunk shapes, with the chunk's key count U as it comes (often not a multiple of 8) and padded to
``mla_attention_grads.KEY_PAD``, with TFLOP/s and the fraction of the bf16 matmul peak measured in the same
run (torch.mm at 8192^3).

A chunk of the backward (kernels_batch_invariant/mla_attention_grads.py, bf16 path) holds G queries x H heads
over the U unique keys of their lists, and runs these products:

    S  = q_s [G*H, Dc+Dr] @ K^T           (K^T a transposed view of the gathered keys [U, Dc+Dr])
    dP = dO  [G*H, Dc]    @ C^T           (C = the latent columns of K)
    dQ = scale * dS [G*H, U] @ K          (written into the query-gradient rows, the scale in alpha)
    dK = dS^T [U, G*H] @ q_s, + P^T dO on the first Dc columns (dV)

A bf16 row of U elements is 16-byte aligned only when U is a multiple of 8; cuBLAS then picks its sm90
kernels, else its sm75 "align1" ones (what the trainer profile showed before the padding). G follows the
backward's own chunk rule.

    python benchmarks/mla_bwd_gemms.py [--u 2045,3001,4093] [--out PATH]
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

import torch

from _common import cuda_time_ms, default_out, env, require_cuda, setup_logging, table, write_json  # noqa: I001
from _train_flops import measured_matmul_peak_tflops

from zmrl.kernels_batch_invariant.backward_gemms import mm_f32 as _mm_f32
from zmrl.kernels_batch_invariant.mla_attention_grads import CHUNK_ELEMS, KEY_PAD

log = logging.getLogger("benchmarks.mla_bwd_gemms")


def products(g: int, h: int, u: int, dc: int, dr: int, scale: float, dev: torch.device
             ) -> list[tuple[str, int, Callable[[], Any]]]:
    """(name, FLOPs, call) for the products of one chunk with U = u keys."""
    bf = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev).to(bf)

    rows, d = g * h, dc + dr
    qs, k, go = r(rows, d), r(u, d), r(rows, dc)
    ds, p = r(rows, u), r(rows, u)
    c = k[:, :dc]
    dq_out = torch.empty(rows, d, dtype=torch.float32, device=dev)

    def dk() -> torch.Tensor:
        out = _mm_f32(ds.t(), qs)
        out[:, :dc] += _mm_f32(p.t(), go)
        return out

    return [("S = q K^T", 2 * rows * u * d, lambda: _mm_f32(qs, k.t())),
            ("dP = dO C^T", 2 * rows * u * dc, lambda: _mm_f32(go, c.t())),
            ("dQ = s dS K", 2 * rows * u * d, lambda: _mm_f32(ds, k, scale, out=dq_out)),
            ("dK = dS^T q + P^T dO", 2 * rows * u * (d + dc), dk)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--u", default="2045,3001,4093", help="unique keys per chunk as they come (comma-separated)")
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
    for u_raw in (int(x) for x in a.u.split(",")):
        for u in dict.fromkeys([u_raw, -(-u_raw // KEY_PAD) * KEY_PAD]):
            chunk_ms = 0.0
            for name, flops, call in products(g, h, u, dc, dr, scale, dev):
                ms = cuda_time_ms(call, warmup=3, iters=10)["median_ms"]
                chunk_ms += ms
                tf = flops / (ms * 1e-3) / 1e12
                rows.append(dict(u=u, padded=u % KEY_PAD == 0, product=name, ms=ms, tflop_s=tf, frac_peak=tf / peak))
            rows.append(dict(u=u, padded=u % KEY_PAD == 0, product="(chunk)", ms=chunk_ms))
            torch.cuda.empty_cache()
    print(table(rows, [("u", "U", "d"), ("padded", "aligned", "s"), ("product", "product", "s"), ("ms", "ms", ".3f"),
                       ("tflop_s", "TFLOP/s", ".0f"), ("frac_peak", "of peak", ".1%")]))
    write_json(a.out, dict(benchmark="mla_bwd_gemms", **env(), peak_tflops=peak, chunk_queries=g, heads=h,
                           dc=dc, dr=dr, key_pad=KEY_PAD, rows=rows))


if __name__ == "__main__":
    main()
