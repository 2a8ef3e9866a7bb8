"""The LoRA products of the bench model at rollout and training row counts: the invariant Triton GEMM
against cuBLAS on the same shapes, and against the hardware bound measured in the same run.

Every attention projection and every routed / shared expert carries a rank-r adapter,
``delta(x) = scale * (x @ A^T) @ B^T`` with fp32 factors (zmrl/lora/layers.py). The A product takes
bf16 activations against an fp32 [r, in] factor: a narrow output (N = r) over a long K, which at
decode sizes is one program walking K. It runs as three bf16 MMAs on a split of the fp32 factor
(``SPLIT_W`` in zmrl/kernels_batch_invariant/triton/matmul.py) with K cut into fixed chunks of
``SPLIT_K_CHUNK``, one program each; ``--compare-ieee`` also times the IEEE fp32 FMA dots both replaced
(the same kernel with the split turned off), ``--compare-whole-k`` the split without the K chunks. The
B product is fp32 [M, r] @ [out, r]^T (one K step; both operands split, six MMAs). Routed experts run
``expert_linear`` over 64 experts, top-8.

Per shape and M: device time by CUDA-graph replay (``triton.testing.do_bench_cudagraph``), cuBLAS
fp32 (TF32 off: the same accuracy class) and bf16 (a floor: what the bytes and FLOPs cost on the
tensor cores), and the fraction of the bound max(bytes / copy bandwidth, FLOPs / matmul peak), both
measured here.

    python benchmarks/lora_gemms.py [--ms 1,64,256,16384] [--compare-ieee] [--compare-whole-k] [--sweep] [--out PATH]

``--sweep`` times every product under each tile config of ``SWEEP_CONFIGS`` and checks its bits equal the
default config's (the decode-step GEMM configs are picked from this: a config that helps one product can
slow others, as 16/32-row fp32 tiles did, benchmarks/results/2026-12-01_h200_summary.md).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import (copy_bandwidth_tb_s, default_out, env, require_cuda, setup_logging,  # noqa: E402
                                table, write_json)
from zmrl.model.presets import bench  # noqa: E402

R = 32
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried by --sweep; a split product's BLOCK_K is fixed by _launch.
SWEEP_CONFIGS = [(16, 32, 32, 4, 3), (16, 64, 32, 4, 3), (16, 128, 32, 4, 3), (32, 64, 32, 4, 3), (32, 128, 32, 4, 3),
                 (64, 32, 32, 4, 3), (64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (64, 128, 32, 8, 3), (128, 64, 32, 8, 3),
                 # prefill / training rows
                 (128, 128, 32, 8, 3), (128, 128, 32, 4, 3), (128, 256, 32, 8, 3), (256, 128, 32, 8, 3)]


@dataclass(frozen=True)
class LoraShape:
    name: str
    k: int  # the product's reduction length
    n: int  # its output width
    x_dtype: torch.dtype  # bf16 activations (A products) or the fp32 intermediate (B products)
    experts: int = 0  # > 0: expert_linear over this many experts, top-k rows per token


def shapes() -> list[LoraShape]:
    cfg = bench()
    h = cfg.hidden_size
    mla_o = cfg.num_attention_heads * cfg.v_head_dim
    inter = cfg.moe_intermediate_size
    e = cfg.n_routed_experts
    bf, f32 = torch.bfloat16, torch.float32
    return [
        LoraShape("A hidden->r", h, R, bf),  # a projection reading the hidden state; KDA's o_proj (16 x 128)
        LoraShape("A hidden->6r (fused)", h, 6 * R, bf),  # the KDA projections of one input, one GEMM
        LoraShape("A mla o_proj", mla_o, R, bf),
        LoraShape("A q_b", cfg.q_lora_rank, R, bf),
        LoraShape("B r->hidden", R, h, f32),
        LoraShape("A expert gate/up", h, R, bf, experts=e),
        LoraShape("A expert down", inter, R, bf, experts=e),
        LoraShape("B expert r->inter", R, inter, f32, experts=e),
        LoraShape("B expert r->hidden", R, h, f32, experts=e),
    ]


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,64,256,16384", help="token counts (expert rows: top-k x tokens)")
    ap.add_argument("--compare-ieee", action="store_true", help="also time the IEEE fp32 dots the split replaced")
    ap.add_argument("--compare-whole-k", action="store_true", help="also time the split products without K chunks")
    ap.add_argument("--sweep", action="store_true",
                    help="also time each product under the tile configs of SWEEP_CONFIGS (bits checked equal to the default's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = require_cuda("lora_gemms.py")
    import triton.testing

    from zmrl.kernels_batch_invariant import kernel_mode
    from zmrl.kernels_batch_invariant.matmul import linear
    from zmrl.kernels_batch_invariant.moe_gemm import expert_linear
    from zmrl.kernels_batch_invariant.triton import matmul as tmm

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = bench()
    top_k = cfg.num_experts_per_tok
    bw = copy_bandwidth_tb_s(dev) * 1e12
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    peak = 2 * 8192**3 / (triton.testing.do_bench(lambda: big @ big, rep=200) * 1e-3)
    del big
    g = torch.Generator(device=dev).manual_seed(0)

    def time_us(fn) -> float:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3

    rows = []
    for s in shapes():
        for m_tok in (int(v) for v in a.ms.split(",")):
            m = m_tok * top_k if s.experts else m_tok
            x = torch.randn(m, s.k, device=dev, generator=g).to(s.x_dtype)
            if s.experts:
                w = torch.randn(s.experts, s.n, s.k, device=dev, generator=g) / s.k**0.5
                counts = torch.full((s.experts,), m // s.experts, dtype=torch.int64)
                counts[: m % s.experts] += 1
                offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(dev)
                ours = lambda: expert_linear(x, w, offs, out_dtype=torch.float32)  # noqa: E731
                wl = list(w)
                sl = [slice(int(p), int(q)) for p, q in zip(offs[:-1].tolist(), offs[1:].tolist())]
                cub32 = lambda: [F.linear(x[i].float(), wl[e]) for e, i in enumerate(sl)]  # noqa: E731
                wb = [t.bfloat16() for t in wl]
                xb = x.bfloat16()
                cub16 = lambda: [F.linear(xb[i], wb[e]) for e, i in enumerate(sl)]  # noqa: E731
                w_bytes = w.numel() * 4 * min(1.0, m / s.experts)  # experts with rows
            else:
                w = torch.randn(s.n, s.k, device=dev, generator=g) / s.k**0.5
                ours = lambda: linear(x, w, out_dtype=torch.float32)  # noqa: E731
                cub32 = lambda: F.linear(x.float(), w)  # noqa: E731
                wb, xb = w.bfloat16(), x.bfloat16()
                cub16 = lambda: F.linear(xb, wb)  # noqa: E731
                w_bytes = w.numel() * 4
            nbytes = x.numel() * x.element_size() + w_bytes + m * s.n * 4
            flops = 2 * m * s.k * s.n
            bound_us = max(nbytes / bw, flops / peak) * 1e6
            with kernel_mode("bitwise"):
                t_ours = time_us(ours)
                row = {"shape": s.name, "tokens": m_tok, "m": m, "k": s.k, "n": s.n, "experts": s.experts,
                       "x_dtype": str(s.x_dtype).replace("torch.", ""), "ours_us": t_ours}
                never = lambda *args: False  # noqa: E731
                variants = {"ieee_us": {"_split_x": never, "_split_w": never}} if a.compare_ieee else {}
                if a.compare_whole_k and s.k > tmm.SPLIT_K_CHUNK:
                    variants["whole_k_us"] = {"_k_chunk": lambda *args: 0}
                for key, stand_ins in variants.items():
                    saved = {name: getattr(tmm, name) for name in stand_ins}
                    for name, fn in stand_ins.items():
                        setattr(tmm, name, fn)
                    try:
                        row[key] = time_us(ours)
                    finally:
                        for name, fn in saved.items():
                            setattr(tmm, name, fn)
                if a.sweep:
                    row["sweep"] = sweep(tmm, ours, time_us)
                    same = [r for r in row["sweep"] if r["same_bits"]]
                    best = min(same, key=lambda r: r["us"]) if same else {"config": None, "us": None}
                    row["best_config"], row["best_us"] = best["config"], best["us"]
            row.update(cublas_fp32_us=time_us(cub32), cublas_bf16_us=time_us(cub16), bound_us=bound_us,
                       of_bound=bound_us / t_ours)
            row["vs_cublas_fp32"] = row["cublas_fp32_us"] / t_ours
            rows.append(row)
            print(f"{s.name:>24} M={m_tok:<6} ours {t_ours:9.1f} us" +
                  (f"  ieee {row['ieee_us']:9.1f}" if "ieee_us" in row else "") +
                  (f"  whole K {row['whole_k_us']:9.1f}" if "whole_k_us" in row else "") +
                  f"  cuBLAS fp32 {row['cublas_fp32_us']:8.1f}  bf16 {row['cublas_bf16_us']:8.1f}"
                  f"  bound {bound_us:7.1f}  ({100 * row['of_bound']:.1f} % of bound)", flush=True)
    cols = [("shape", "shape", "s"), ("tokens", "tokens", "d"), ("ours_us", "ours us", ".1f"),
            ("ieee_us", "ieee us", ".1f"), ("whole_k_us", "whole-K us", ".1f"), ("cublas_fp32_us", "cuBLAS fp32 us", ".1f"),
            ("cublas_bf16_us", "cuBLAS bf16 us", ".1f"), ("vs_cublas_fp32", "cuBLAS32/ours", ".2f"),
            ("of_bound", "of bound", ".3f"), ("best_config", "best swept", "s"), ("best_us", "its us", ".1f")]
    print(table(rows, cols))
    out = write_json(a.out or default_out("lora_gemms"), {
        "env": env(), "copy_tb_s": bw / 1e12, "matmul_peak_tflops": peak / 1e12, "rank": R, "rows": rows})
    print(f"wrote {out}")


def sweep(tmm, product, time_us) -> list[dict]:
    """Time ``product`` with ``linear_config`` returning each of SWEEP_CONFIGS; each result is compared with
    the default config's bits (tile shapes must not change them: module doc of triton/matmul.py)."""
    want = product()
    default = tmm.linear_config
    out = []
    try:
        for c in SWEEP_CONFIGS:
            cfg = tmm.GemmConfig(*c)
            tmm.linear_config = lambda n, k, dtype, m=1, experts=False, cfg=cfg: cfg
            try:
                got = product()
            except triton.runtime.errors.OutOfResources as exc:  # e.g. shared memory of a large split tile
                out.append({"config": str(cfg), "error": str(exc)[:100]})
                continue
            out.append({"config": str(cfg), "us": time_us(product), "same_bits": bool(torch.equal(got, want))})
    finally:
        tmm.linear_config = default
    return out


if __name__ == "__main__":
    main()
