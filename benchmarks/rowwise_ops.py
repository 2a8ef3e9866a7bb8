"""Row-wise ops on the bench preset's shapes: Triton (bitwise) vs fast (stock torch kernels) vs the
torch composition (what CUDA ran before the Triton backend), with achieved GB/s.

    python benchmarks/rowwise_ops.py [--rows 1,64,4096] [--out PATH] [--smoke]

Each op is memory-bound; GB/s counts the bytes of the inputs read and outputs written once. Writes
JSON to ``--out`` (default benchmarks/results/<date>_rowwise_ops_h200.json) and prints a table.
``--smoke`` runs tiny shapes on the CPU (torch and fast backends only, unless TRITON_INTERPRET=1)
to check the script end to end.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable

import torch

from _common import cuda_time_ms, default_out, env, pick_device, setup_logging, table, write_json  # noqa: I001

from zmrl.kernels_batch_invariant.fp8 import quantize_fp8
from zmrl.kernels_batch_invariant.glu import swiglu
from zmrl.kernels_batch_invariant.kda_gate import kda_gate
from zmrl.kernels_batch_invariant.l2norm import l2_norm
from zmrl.kernels_batch_invariant.logprob import log_softmax, token_logprobs
from zmrl.kernels_batch_invariant.moe_router import moe_combine, moe_route
from zmrl.kernels_batch_invariant.norms import rms_norm, rms_norm_gated
from zmrl.kernels_batch_invariant.short_conv import causal_short_conv

log = logging.getLogger("benchmarks.rowwise_ops")

BF16 = torch.bfloat16


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


def cases(m: int, dev: torch.device, smoke: bool) -> list[tuple[str, Any, tuple, str]]:
    """(name, op, args, shape text) at the bench preset's widths (tiny ones with --smoke)."""
    hid, heads, hd, inter, experts, k, vocab, lat = (
        (64, 2, 16, 32, 8, 2, 1000, 128) if smoke else (2048, 16, 128, 256, 64, 8, 163840, 512))
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    lm = min(m, 1024)  # [rows, vocab] fp32 logits: 0.6 GiB at 1024 rows
    cu1 = torch.tensor([0, m], device=dev)
    cud = torch.arange(m + 1, device=dev)
    return [
        ("rms_norm", rms_norm, (r(m, hid), r(hid, dtype=torch.float32), 1e-6), f"[{m},{hid}] bf16"),
        ("rms_norm_gated", rms_norm_gated, (r(m * heads, hd), r(m * heads, hd), r(hd, dtype=torch.float32), 1e-6),
         f"[{m * heads},{hd}] bf16"),
        ("l2_norm", l2_norm, (r(m * heads, hd),), f"[{m * heads},{hd}] bf16"),
        ("swiglu", swiglu, (r(m * k, inter), r(m * k, inter)), f"[{m * k},{inter}] bf16"),
        ("kda_gate", kda_gate, (r(m, heads * hd), r(heads, dtype=torch.float32), r(heads * hd, dtype=torch.float32),
                                heads), f"[{m},{heads * hd}] bf16"),
        ("token_logprobs", token_logprobs, (r(lm, vocab, dtype=torch.float32, scale=4.0),
                                            torch.randint(0, vocab, (lm,), device=dev), 0.6), f"[{lm},{vocab}] fp32"),
        ("log_softmax", log_softmax, (r(min(lm, 256), vocab, dtype=torch.float32, scale=4.0), 0.6),
         f"[{min(lm, 256)},{vocab}] fp32"),
        ("short_conv prefill", causal_short_conv, (r(m, 3 * hid), r(3 * hid, 4), cu1, None, "silu"),
         f"1 seq x {m} x {3 * hid}"),
        ("short_conv decode", causal_short_conv, (r(m, 3 * hid), r(3 * hid, 4), cud, r(m, 3, 3 * hid), "silu"),
         f"{m} seqs x 1 x {3 * hid}"),
        ("quantize_fp8", quantize_fp8, (r(m, lat), 128), f"[{m},{lat}] bf16"),
        ("moe_route", moe_route, (r(m, hid), r(experts, hid, dtype=torch.float32, scale=hid ** -0.5),
                                  r(experts, dtype=torch.float32, scale=0.05), k, 1, 1, True, 2.5),
         f"[{m},{hid}] x E={experts} top-{k}"),
        ("moe_combine", moe_combine, (r(m, k, hid), r(m, k, dtype=torch.float32), torch.float32),
         f"[{m},{k},{hid}] bf16"),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,64,4096", help="comma-separated row counts (tokens)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    setup_logging()
    dev = pick_device("rowwise_ops.py", a.smoke)
    rows_list = [int(x) for x in a.rows.split(",")] if not a.smoke else [1, 8]
    use_triton = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    results: list[dict[str, Any]] = []
    for m in rows_list:
        for name, op, args, shape in cases(m, dev, a.smoke):
            row: dict[str, Any] = {"op": name, "rows": m, "shape": shape}
            with torch.no_grad():
                out = op.impls["torch"](*args)
                row["bytes"] = _nbytes(args) + _nbytes(out)
                backends: dict[str, Callable[..., Any]] = {"torch": op.impls["torch"], "fast": op.impls.get("fast")}
                if use_triton:
                    backends["triton"] = op.impls.get("triton")
                for be, fn in backends.items():
                    if fn is None:
                        continue
                    t = cuda_time_ms(lambda fn=fn: fn(*args), warmup=3, iters=a.iters if not a.smoke else 2)
                    row[f"{be}_us"] = t["median_ms"] * 1e3
                    row[f"{be}_gbs"] = row["bytes"] / (t["median_ms"] * 1e-3) / 1e9
            if "triton_us" in row and "fast_us" in row:
                row["triton_vs_fast"] = row["triton_us"] / row["fast_us"]
            results.append(row)
            del args
    cols = [("op", "op", ""), ("shape", "shape", ""), ("triton_us", "triton us", ".1f"),
            ("triton_gbs", "triton GB/s", ".0f"), ("fast_us", "fast us", ".1f"), ("fast_gbs", "fast GB/s", ".0f"),
            ("torch_us", "torch-comp us", ".1f"), ("triton_vs_fast", "triton/fast", ".2f")]
    print(table(results, cols))
    if not a.smoke or a.out:
        write_json(a.out or default_out("rowwise_ops"), {"env": env(), "results": results})


if __name__ == "__main__":
    main()
