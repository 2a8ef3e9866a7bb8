"""Probe: does loading the invariant GEMM's tiles with Hopper's TMA (tensor descriptors), and running its tiles on
persistent programs, speed up the training-row products without changing a bit?

    python benchmarks/probes/gemm_tma_probe.py [--out FILE.json]

The library kernel (``triton/matmul.py``'s ``_gemm_kernel``) loads its x and W tiles with pointer loads (cp.async
on Hopper) and runs one program per tile. The arithmetic that decides the bits is the K loop: fixed BLOCK_K steps in
ascending order, one ``tl.dot`` per step onto an fp32 accumulator, one rounding. The variants here keep exactly that
loop and change only how the tiles reach shared memory (TMA) and which program computes which tile (persistent,
tiles in the library's banded order), so every variant must equal the library's output bitwise (``equal`` column).
Timed with CUDA events against cuBLAS bf16 on the trainer's widest dense shapes at 16K rows, with and without a LoRA
r = 32 delta (the delta-first form: the split fp32 t @ B^T product starts the accumulator).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cuda_time_ms, env, require_cuda, setup_logging, table, write_json  # noqa: E402
from _train_flops import measured_matmul_peak_tflops  # noqa: E402
from zmrl.kernels_batch_invariant.matmul import LoraUp, linear  # noqa: E402
from zmrl.kernels_batch_invariant.triton import matmul as tmm  # noqa: E402
from zmrl.kernels_batch_invariant.triton import triton_impl  # noqa: E402

SHAPES = [(16384, 6400, 2048), (16384, 2048, 2048), (16384, 2048, 8192), (16384, 12288, 768)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
TILES = [(256, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4)]


@triton.jit
def _tile_of(tile_id, num_m, num_n, GROUP_M: tl.constexpr):
    """The library's banded order (``grouped_tile``) on a linear tile id."""
    per_band = GROUP_M * num_n
    first = (tile_id // per_band) * GROUP_M
    height = tl.minimum(num_m - first, GROUP_M)
    in_band = tile_id % per_band
    return first + in_band % height, in_band // height


@triton.jit
def _lora_start(t_ptr, lb_ptr, offs_m, offs_n, M, N, scale, INTERPRET: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr):
    t = tl.load(t_ptr + offs_m.to(tl.int64)[:, None] * R + tl.arange(0, R)[None, :], mask=(offs_m < M)[:, None],
                other=0.0)
    lb = tl.load(lb_ptr + tl.arange(0, R)[:, None] + offs_n.to(tl.int64)[None, :] * R, mask=(offs_n < N)[None, :],
                 other=0.0)
    return tmm._dot_split_both(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), t, lb, INTERPRET) * scale


@triton.jit
def _tma_gemm(x_ptr, w_ptr, y_ptr, t_ptr, lb_ptr, M, N, K, scale, HAS_LORA: tl.constexpr, PERSISTENT: tl.constexpr,
              WS: tl.constexpr, NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, R: tl.constexpr,
              INTERPRET: tl.constexpr = False):
    x_d = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_d = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    y_d = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if PERSISTENT:
        first, step, last = tl.program_id(0), NUM_SMS, num_m * num_n
    else:
        first, step, last = tl.program_id(0), 1, tl.program_id(0) + 1
    for tile_id in tl.range(first, last, step, flatten=False, warp_specialize=WS):
        pid_m, pid_n = _tile_of(tile_id, num_m, num_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_LORA:
            acc = _lora_start(t_ptr, lb_ptr, offs_m, offs_n, M, N, scale, INTERPRET, BLOCK_M, BLOCK_N, R)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kk in tl.range(0, k_tiles, num_stages=STAGES):
            a = x_d.load([pid_m * BLOCK_M, kk * BLOCK_K])
            b = w_d.load([pid_n * BLOCK_N, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        y_d.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))


def _alloc(size: int, align: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_gemm(x, w, tile, up: LoraUp | None, persistent: bool, ws: bool) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages = tile
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(sms, tiles),) if persistent else (tiles,)
    t, lb, scale = (up.t, up.b, float(up.scale)) if up is not None else (x, x, 1.0)
    _tma_gemm[grid](x, w, y, t, lb, m, n, k, scale, HAS_LORA=up is not None, PERSISTENT=persistent, WS=ws,
                    NUM_SMS=sms, GROUP_M=tmm.GROUP_M, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, R=32,
                    num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()
    dev = require_cuda("gemm_tma_probe")
    triton.set_allocator(_alloc)
    peak = measured_matmul_peak_tflops(dev)
    lin = triton_impl(linear)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device=dev, generator=g).bfloat16()
        w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).bfloat16()
        up = LoraUp(torch.randn(m, 32, device=dev, generator=g),
                    torch.randn(n, 32, device=dev, generator=g) / 32**0.5, 2.0)
        flop = 2 * m * n * k

        def add(variant: str, fn, ref: torch.Tensor | None) -> None:
            try:
                out = fn()
                ms = cuda_time_ms(fn, warmup=3, iters=10)["median_ms"]
                rows.append(dict(shape=f"{m}x{n}x{k}", variant=variant, ms=ms, tflop_s=flop / ms / 1e9,
                                 of_peak=flop / ms / 1e9 / peak,
                                 equal=None if ref is None else bool(torch.equal(out, ref))))
            except Exception as exc:  # a variant that does not compile on this Triton is a finding, not a crash
                rows.append(dict(shape=f"{m}x{n}x{k}", variant=variant, error=f"{type(exc).__name__}: {exc}"[:300]))

        add("cuBLAS bf16", lambda: torch.mm(x, w.t()), None)
        for lora in (False, True):
            u = up if lora else None
            ref = lin(x, w, lora=u) if lora else lin(x, w)
            tag = "lora " if lora else ""
            add(f"{tag}library", (lambda: lin(x, w, lora=up)) if lora else (lambda: lin(x, w)), ref)
            for tile in TILES:
                label = "x".join(map(str, tile[:3])) + f"/w{tile[3]}/s{tile[4]}"
                add(f"{tag}tma {label}", lambda tile=tile, u=u: tma_gemm(x, w, tile, u, False, False), ref)
                add(f"{tag}tma persistent {label}", lambda tile=tile, u=u: tma_gemm(x, w, tile, u, True, False), ref)
                add(f"{tag}tma persistent ws {label}", lambda tile=tile, u=u: tma_gemm(x, w, tile, u, True, True), ref)
    print(table(rows, [("shape", "M x N x K", "s"), ("variant", "variant", "s"), ("ms", "ms", ".3f"),
                       ("tflop_s", "TFLOP/s", ".0f"), ("of_peak", "of peak", ".2f"), ("equal", "equal", "s"),
                       ("error", "error", "s")]))
    write_json(args.out or "gemm_tma_probe.json", dict(env=env(), peak_tflop_s=peak, rows=rows))


if __name__ == "__main__":
    main()
