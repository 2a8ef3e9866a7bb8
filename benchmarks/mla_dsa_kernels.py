"""Benchmark: the Triton MLA attention (dense causal and sparse top-k) and DSA indexer kernels against
the "fast" stock-kernel backends, at the bench preset's shapes (64 heads, kv_lora 512, rope 64, bf16
latent cache, page 64; indexer 32 heads x 128 FP8, top-2048).

    python benchmarks/mla_dsa_kernels.py [--out results.json] [--quick] [--sweep]
    TRITON_INTERPRET=1 python benchmarks/mla_dsa_kernels.py --smoke   # CPU: tiny shapes, checks the script

Times are medians in ms (``triton.testing.do_bench`` on CUDA). Each row also says whether the Triton
output equals the row computed alone (a cheap invariance spot check on the first query).
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._common import copy_bandwidth_tb_s, parse_mla_launches  # noqa: E402
from zmrl.kernels_batch_invariant import current_numerics, kernel_mode, numerics_scope  # noqa: E402
from zmrl.kernels_batch_invariant.dsa_indexer import dsa_index_scores, dsa_topk  # noqa: E402
from zmrl.kernels_batch_invariant.fp8 import quantize_fp8  # noqa: E402
from zmrl.kernels_batch_invariant.mla_attention import mla_attention, mla_attention_dense  # noqa: E402
from zmrl.kernels_batch_invariant.numerics import MLA_MMA_ROWS, MLA_OPERANDS  # noqa: E402
from zmrl.kernels_batch_invariant.triton import triton_impl  # noqa: E402

log = logging.getLogger("mla_dsa_kernels")


def bench(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=30))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def paged(lens: list[int], page: int, dim: int, dtype: torch.dtype, device: torch.device, seed: int):
    """Contiguous pages per sequence in a shuffled order (layout does not matter to the kernels)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_pages = [math.ceil(n / page) for n in lens]
    total = sum(n_pages)
    perm = torch.randperm(total, generator=g)
    bt = torch.zeros(len(lens), max(n_pages), dtype=torch.int64)
    k = 0
    for i, n in enumerate(n_pages):
        bt[i, :n] = perm[k:k + n]
        k += n
    # drawn on the device: a multi-GB host tensor copied over failed on the H100 (illegal address at the copy)
    cache = torch.randn(total, page, dim, generator=torch.Generator(device=device).manual_seed(seed),
                        device=device).to(dtype)
    return cache, bt.to(device)


def mla_rows(device: torch.device, smoke: bool, quick: bool) -> list[dict[str, Any]]:
    h, dc, dr, page = (4, 64, 16, 64) if smoke else (64, 512, 64, 64)
    dtype = torch.float32 if smoke else torch.bfloat16
    topk = 64 if smoke else 2048
    scale = (128 + dr) ** -0.5
    cases = [("decode", 1, 300 if smoke else 32768), ("decode", 4 if smoke else 64, 200 if smoke else 4096),
             ("prefill", 1, 130 if smoke else 4096)]
    if quick and not smoke:
        cases = [c for c in cases if c[0] == "decode"]
    rows = []
    g = torch.Generator().manual_seed(0)
    for kind, batch, ctx in cases:
        lens = [ctx] * batch
        cache, bt = paged(lens, page, dc + dr, dtype, device, seed=1)
        if kind == "decode":
            sidx = torch.arange(batch)
            qpos = torch.full((batch,), ctx - 1)
        else:
            sidx = torch.zeros(ctx, dtype=torch.int64)
            qpos = torch.arange(ctx)
        nq = len(qpos)
        q_lat = torch.randn(nq, h, dc, generator=g).to(device)
        q_pe = torch.randn(nq, h, dr, generator=g).to(device)
        sidx, qpos = sidx.to(device), qpos.to(device)
        # a sparse selection: top-k random positions per query (all of them when t + 1 <= k)
        kp = torch.full((nq, topk), -1, dtype=torch.int64)
        for i, t in enumerate(qpos.tolist()):
            n = min(topk, t + 1)
            kp[i, :n] = torch.sort(torch.randperm(t + 1, generator=g)[:n]).values
        kp = kp.to(device)
        args_d = (q_lat, q_pe, cache, bt, sidx, qpos, scale, dc)
        args_s = (q_lat, q_pe, cache, bt, sidx, kp, scale, dc)
        row: dict[str, Any] = {"op": f"mla {kind}", "queries": nq, "context": ctx}
        dense_t = triton_impl(mla_attention_dense)
        sparse_t = triton_impl(mla_attention)
        row["dense_triton_ms"] = bench(lambda: dense_t(*args_d), device)
        row["sparse_triton_ms"] = bench(lambda: sparse_t(*args_s), device)
        with kernel_mode("fast"):
            row["dense_fast_ms"] = bench(lambda: mla_attention_dense(*args_d), device)
            row["sparse_fast_ms"] = bench(lambda: mla_attention(*args_s), device)
        full = dense_t(*args_d)
        alone = dense_t(q_lat[:1], q_pe[:1], cache, bt, sidx[:1], qpos[:1], scale, dc)
        row["alone_equal"] = bool(torch.equal(alone[0], full[0]))
        if kind == "prefill":
            ql = q_lat.clone().requires_grad_()
            qr = q_pe.clone().requires_grad_()
            kv = cache.clone().requires_grad_()
            gout = torch.randn_like(full)

            def fwd_bwd() -> None:
                dense_t(ql, qr, kv, bt, sidx, qpos, scale, dc).backward(gout)

            row["dense_triton_fwd_bwd_ms"] = bench(fwd_bwd, device)
        rows.append(row)
    return rows


def dsa_rows(device: torch.device, smoke: bool, quick: bool, bandwidth_tb_s: float) -> list[dict[str, Any]]:
    hi, di, page = (4, 32, 64) if smoke else (32, 128, 64)
    topk = 64 if smoke else 2048
    cases = [("decode", 1, 300 if smoke else 32768), ("decode", 4 if smoke else 64, 200 if smoke else 4096),
             ("decode", 4 if smoke else 256, 200 if smoke else 8192), ("prefill", 1, 130 if smoke else 4096)]
    if not smoke:  # the RL decode batches at 8K and 32K
        cases += [("decode", 1, 8192), ("decode", 64, 8192), ("decode", 64, 32768), ("decode", 256, 32768)]
    if quick and not smoke:
        cases = [c for c in cases if c[0] == "decode"]
    rows = []
    g = torch.Generator().manual_seed(1)
    for kind, batch, ctx in cases:
        lens = [ctx] * batch
        keys, bt = paged(lens, page, di, torch.float32, device, seed=2)
        k8, ks = quantize_fp8(keys, block=di)
        if kind == "decode":
            sidx = torch.arange(batch)
            qpos = torch.full((batch,), ctx - 1)
        else:
            sidx = torch.zeros(ctx, dtype=torch.int64)
            qpos = torch.arange(ctx)
        nq = len(qpos)
        q8, qs = quantize_fp8(torch.randn(nq, hi, di, generator=g).to(device), block=di)
        w = (torch.randn(nq, hi, generator=g) * (hi * di) ** -0.5).to(device)
        args = (q8, qs.squeeze(-1), w, k8, ks.squeeze(-1), bt, sidx.to(device), qpos.to(device))
        row: dict[str, Any] = {"op": f"dsa {kind}", "queries": nq, "context": ctx}
        scores_t = triton_impl(dsa_index_scores)
        from zmrl.kernels_batch_invariant.triton.dsa_indexer import dsa_topk_kernel as topk_t
        row["scores_triton_ms"] = bench(lambda: scores_t(*args), device)
        sc = scores_t(*args)
        row["topk_triton_ms"] = bench(lambda: topk_t(sc, args[7], topk), device)
        row["topk_torch_sort_ms"] = bench(lambda: dsa_topk.impls["torch"](sc, args[7], topk), device)
        # the stock kernel fast mode would use (not tie-stable: the baseline, not a substitute)
        row["topk_torch_topk_ms"] = bench(lambda: torch.topk(sc, min(topk, sc.shape[-1]), dim=-1), device)
        with kernel_mode("fast"):
            row["scores_fast_ms"] = bench(lambda: dsa_index_scores(*args), device)
            row["topk_fast_ms"] = bench(lambda: dsa_topk(sc, args[7], topk), device)
        # the top-k's bound: its scores read once and the selection written, at the copy bandwidth of this run
        row["topk_bound_ms"] = (sc.numel() * 4 + nq * topk * 8) / (bandwidth_tb_s * 1e12) * 1e3
        row["topk_frac_bound"] = row["topk_bound_ms"] / row["topk_triton_ms"]
        row["topk_equal_torch"] = bool(torch.equal(topk_t(sc, args[7], topk),
                                                   dsa_topk.impls["torch"](sc, args[7], topk)))
        rows.append(row)
    return rows


SWEEP_MLA = ((16, 8, 1), (16, 4, 1), (16, 8, 2), (32, 8, 1), (32, 8, 2), (32, 8, 3), (32, 4, 2), (64, 8, 1),
             (64, 8, 2), (64, 4, 1))


def sweep_cases(smoke: bool) -> list[tuple[str, int, int]]:
    """(kind, batch, context) of the sparse-MLA sweeps: decode 256 x 8K and one 4096-token prefill (top-2048)."""
    return [("decode", 4 if smoke else 256, 200 if smoke else 8192), ("prefill", 1, 130 if smoke else 4096)]


def sparse_case(kind: str, batch: int, ctx: int, device: torch.device, smoke: bool, dtype: torch.dtype | None = None,
                seed: int = 3) -> tuple[Any, ...]:
    """Arguments of ``mla_attention`` at the bench preset's shapes (64 heads, kv_lora 512, rope 64, page 64, a bf16
    cache; smoke: tiny, fp32): ``batch`` decode queries at the end of ``ctx``-token sequences, or a ``ctx``-token
    prefill of one sequence, each query listing a random sorted top-k of its positions."""
    h, dc, dr, page = (16, 64, 16, 64) if smoke else (64, 512, 64, 64)
    dtype = dtype or (torch.float32 if smoke else torch.bfloat16)
    topk = 64 if smoke else 2048
    g = torch.Generator().manual_seed(seed)
    cache, bt = paged([ctx] * batch, page, dc + dr, dtype, device, seed=4)
    if kind == "decode":
        sidx, qpos = torch.arange(batch), torch.full((batch,), ctx - 1)
    else:
        sidx, qpos = torch.zeros(ctx, dtype=torch.int64), torch.arange(ctx)
    nq = len(qpos)
    kp = torch.full((nq, topk), -1, dtype=torch.int64)
    for i, t in enumerate(qpos.tolist()):
        n = min(topk, t + 1)
        kp[i, :n] = torch.sort(torch.randperm(t + 1, generator=g)[:n]).values
    q_lat = torch.randn(nq, h, dc, generator=g).to(device)
    q_pe = torch.randn(nq, h, dr, generator=g).to(device)
    return q_lat, q_pe, cache, bt, sidx.to(device), kp.to(device), (128 + dr) ** -0.5, dc


def mla_sweep_rows(device: torch.device, smoke: bool, bandwidth_tb_s: float,
                   mma_rows: tuple[str, ...] = MLA_MMA_ROWS,
                   launches: tuple[tuple[int, int, int], ...] = SWEEP_MLA,
                   slot_lists: tuple[bool, ...] = (False,),
                   operands: tuple[str, ...] = ("hi_lo",)) -> list[dict[str, Any]]:
    """The sparse kernel in each form (Numerics.mla_mma_rows) under each (BLOCK_H, num_warps, num_stages) of
    ``launches``, with the key lists walked through the block table in the kernel and/or turned into cache slots
    first (``slot_lists``: triton/mla_attention.py SLOT_LIST; the slot-list rows include that launch), with q and p
    multiplied as each of ``operands`` (Numerics.mla_operands: bf16 hi + lo halves, or bf16); every row says its
    fraction of the bytes bound (the unique key rows read once at the measured copy bandwidth), its largest
    difference from the first row of its form and operands in its case (launches and slot lists should give the
    same bits), its FLOP rate (the hi / lo MMA pairs counted once) and its largest error against the float64
    torch backend."""
    from zmrl.kernels_batch_invariant.triton import mla_attention as tmla

    rows = []
    for kind, batch, ctx in sweep_cases(smoke):
        args = sparse_case(kind, batch, ctx, device, smoke)
        q_lat, q_pe, cache, kp = args[0], args[1], args[2], args[5]
        nq, h = q_lat.shape[:2]
        unique_bytes = int((kp >= 0).sum()) * cache.shape[-1] * cache.element_size()
        sparse_t = triton_impl(mla_attention)
        # float64 reference (the torch backend on float64 copies): each row's error, so forms compare by accuracy
        exact = mla_attention.impls["torch"](q_lat.double(), q_pe.double(), cache.double(), *args[3:])
        # the first output of each (form, operands): launches and slot lists of one compared bitwise
        ref: dict[tuple[str, str], torch.Tensor] = {}
        # score and value products of every valid (query, head, key): 2 * (Dc + Dr) + 2 * Dc FLOPs
        flops = 2.0 * int((kp >= 0).sum()) * h * (q_lat.shape[-1] + q_pe.shape[-1] + q_lat.shape[-1])
        # launches outside the operands and slot lists: a launch that faults the device (it ends the process) loses
        # only its own rows and the later launches', so a sweep lists the untried launches last
        for rows_form, (block_h, warps, stages), ops, slots in itertools.product(mma_rows, launches, operands,
                                                                                  slot_lists):
            block_h = min(block_h, h)
            config = f"{rows_form}/{ops}/h{block_h}/w{warps}/s{stages}{'/slots' if slots else ''}"
            row: dict[str, Any] = {"op": f"mla sparse {kind} sweep", "queries": nq, "context": ctx,
                                   "mma_rows": rows_form, "operands": ops, "slot_list": slots, "config": config}
            try:
                with numerics_scope(current_numerics().replace(mla_mma_rows=rows_form, mla_operands=ops)), \
                        tmla.launch_override(block_h, warps, stages), tmla.slot_list_override(slots):
                    out = sparse_t(*args)
                    ms = bench(lambda: sparse_t(*args), device)
                row["ms"] = ms
                row["tflop_s"] = flops / ms / 1e9
                row["unique_gb_s"] = unique_bytes / ms / 1e6
                row["bytes_bound_fraction"] = row["unique_gb_s"] / (bandwidth_tb_s * 1e3)
                first = ref.setdefault((rows_form, ops), out)
                row["max_abs_diff_vs_form_first"] = float((out - first).abs().max())
                row["max_abs_err_vs_fp64"] = float((out.double() - exact).abs().max())
            except Exception as e:  # a config that does not compile (registers, shared memory) is a row too
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
            # one line per configuration as it is measured: a configuration that faults the device (an illegal
            # address is sticky: the process cannot go on) is the last line printed
            log.info("sweep %s %s: %s", kind, row["config"], row.get("error") or f"{row['ms']:.4f} ms")
    return rows


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--quick", action="store_true", help="decode cases only")
    ap.add_argument("--sweep", action="store_true",
                    help="also time sparse-MLA launch configurations, in each form of --mma-rows")
    ap.add_argument("--mma-rows", default=",".join(MLA_MMA_ROWS),
                    help=f"forms of the sparse kernel for --sweep (Numerics.mla_mma_rows: {', '.join(MLA_MMA_ROWS)})")
    ap.add_argument("--slot-lists", default="0", metavar="0,1",
                    help="sweep with the key lists walked through the block table in the kernel (0) and/or turned "
                         "into cache slots before the launch (1: SLOT_LIST)")
    ap.add_argument("--operands", default="hi_lo", metavar="hi_lo,bf16",
                    help=f"sweep with q and p multiplied as (Numerics.mla_operands: {', '.join(MLA_OPERANDS)})")
    ap.add_argument("--dsa-only", action="store_true", help="the indexer's scores and top-k only")
    ap.add_argument("--sweep-only", action="store_true", help="the --sweep rows only")
    ap.add_argument("--sweep-launches", default=None, metavar="HxWxS,...",
                    help="the sweep's launches as heads x warps x stages (default: all of SWEEP_MLA). A launch that "
                         "faults the device ends the process (the keys form's 16 x 8 x 1 did on an H100), so a "
                         "sweep can leave it out")
    a = ap.parse_args()
    forms = tuple(f for f in a.mma_rows.split(",") if f)
    launches = SWEEP_MLA if a.sweep_launches is None else parse_mla_launches(a.sweep_launches)
    slot_lists = tuple(v == "1" for v in a.slot_lists.split(",") if v)
    if not slot_lists or any(v not in ("0", "1") for v in a.slot_lists.split(",") if v):
        raise SystemExit(f"--slot-lists: {a.slot_lists!r} (allowed: 0, 1 or 0,1)")
    operands = tuple(v for v in a.operands.split(",") if v)
    if not operands or any(v not in MLA_OPERANDS for v in operands):
        raise SystemExit(f"--operands: {a.operands!r} (allowed: {', '.join(MLA_OPERANDS)}, comma-separated)")
    bad = [f for f in forms if f not in MLA_MMA_ROWS]
    if bad:
        raise SystemExit(f"--mma-rows: unknown {bad} (allowed: {', '.join(MLA_MMA_ROWS)})")
    if a.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.stderr.write("mla_dsa_kernels.py: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)\n")
        raise SystemExit(2)
    bandwidth = copy_bandwidth_tb_s(device) if device.type == "cuda" else 1.0
    rows = [] if a.sweep_only else (
        ([] if a.dsa_only else mla_rows(device, a.smoke, a.quick)) + dsa_rows(device, a.smoke, a.quick, bandwidth))
    if a.sweep or a.sweep_only:
        rows += mla_sweep_rows(device, a.smoke, bandwidth, forms, launches, slot_lists, operands)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    if a.out is not None:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        log.info("wrote %s", a.out)


if __name__ == "__main__":
    main()
