"""Benchmark 5: zmrl's batch-invariant Triton ``kda_chunk`` vs fla-core's ``chunk_kda`` (H200).

Forward, and forward + backward, on the bench preset's KDA shape (H = 16, dk = dv = 128, bf16 q, k, v,
beta; fp32 log-space gates), T in {2048, 8192, 32768} as one sequence and as 16 packed sequences.
Times are ``triton.testing.do_bench`` medians (ms). zmrl's backward is autograd of the torch
composition (``with_reference_backward``), so its fwd+bwd column measures that slower path.

    python benchmarks/kda_vs_fla.py [--tokens 2048 8192 32768] [--seqs 1 16] [--no-backward]
        [--time-budget-s 230] [--out benchmarks/results/<date>_kda_h200.json]

fla-core is imported lazily; without it the fla columns are empty and the JSON says why. fla
autotunes on its first calls (minutes in total): every shape is warmed up once before timing.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/kda_vs_fla.py` without installing the package
    sys.path.insert(0, str(REPO))

log = logging.getLogger("kda_vs_fla")

H, DK, DV = 16, 128, 128
SLOW_CALL_S = 1.0  # a call slower than this is timed once instead of with do_bench


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except OSError:
        return None


def _load_fla() -> tuple[Callable[..., Any] | None, str | None]:
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # ImportError, or fla failing to initialise on this machine
        return None, f"{type(exc).__name__}: {exc}"
    return chunk_kda, None


def make_inputs(t: int, n_seqs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Model-like inputs on CUDA: L2-normalised q, k; FLA-init log decay (~ -0.05 per token)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    q = F.normalize(torch.randn(t, H, DK, device=dev, generator=gen), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(t, H, DK, device=dev, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(t, H, DV, device=dev, generator=gen).to(torch.bfloat16)
    a_log = torch.log(torch.rand(H, device=dev, generator=gen) * 15 + 1)
    dt = torch.exp(torch.rand(H, DK, device=dev, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = -torch.exp(a_log)[:, None] * F.softplus(torch.randn(t, H, DK, device=dev, generator=gen) + dt_bias)
    beta = torch.sigmoid(torch.randn(t, H, device=dev, generator=gen)).to(torch.bfloat16)
    base, rem = divmod(t, n_seqs)
    lens = [base + (1 if i < rem else 0) for i in range(n_seqs)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return {"q": q, "k": k, "v": v, "g": g.float(), "beta": beta, "cu": cu}


def time_ms(fn: Callable[[], Any]) -> float:
    """Median ms of fn. The first (warm-up) call compiles / autotunes and is not timed; a call slower
    than SLOW_CALL_S (zmrl's torch-composition backward at long T) is reported from one timed run
    to keep the whole script within a few minutes."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    if once > SLOW_CALL_S:
        return once * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _guarded(row: dict[str, Any], key: str, fn: Callable[[], float]) -> None:
    """row[key] = fn(); on failure log it and record the error instead, so one broken path (e.g. an
    out-of-memory backward at 32K) does not lose the rest of the table."""
    try:
        row[key] = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        log.error("%s failed at T=%s seqs=%s: %s", key, row["T"], row["num_seqs"], exc)
        row[key.replace("_ms", "_error")] = f"{type(exc).__name__}: {exc}"[:500]
        torch.cuda.empty_cache()


class ShapeBench:
    """Inputs and callables of one shape; each ``measure_*`` fills one entry of ``row``."""

    def __init__(self, t: int, n_seqs: int, chunk_kda: Callable[..., Any] | None):
        from zmrl.kernels_batch_invariant.kda import kda_chunk
        from zmrl.kernels_batch_invariant.triton import triton_impl

        self.zm = triton_impl(kda_chunk)
        self.fla = chunk_kda
        self.x = make_inputs(t, n_seqs)
        self.cu_dev = self.x["cu"].cuda()
        self.do = torch.randn(t, H, DV, device="cuda", dtype=torch.bfloat16)
        self.row: dict[str, Any] = {"T": t, "num_seqs": n_seqs, "H": H, "dk": DK, "dv": DV}

    def zm_fwd(self, req: bool = False) -> torch.Tensor:
        args = [self.x[n].detach().requires_grad_(req) for n in ("q", "k", "v", "g", "beta")]
        return self.zm(*args, self.x["cu"])[0]

    def fla_fwd(self, req: bool = False) -> torch.Tensor:
        args = [self.x[n].detach().requires_grad_(req)[None] for n in ("q", "k", "v", "g", "beta")]
        return self.fla(*args, output_final_state=True, cu_seqlens=self.cu_dev, cu_seqlens_cpu=self.x["cu"])[0][0]

    def _fwd_bwd(self, fwd: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            fwd(True).backward(self.do)
        return run

    def measure(self, what: str) -> None:
        r = self.row
        if what == "zmrl_fwd":
            with torch.no_grad():
                _guarded(r, "zmrl_fwd_ms", lambda: time_ms(self.zm_fwd))
            if "zmrl_fwd_ms" in r:
                r["zmrl_fwd_Mtok_s"] = r["T"] / r["zmrl_fwd_ms"] / 1e3
        elif what == "fla_fwd":
            with torch.no_grad():
                _guarded(r, "fla_fwd_ms", lambda: time_ms(self.fla_fwd))
                if "fla_fwd_ms" in r and "zmrl_fwd_ms" in r:
                    # Same function; fla rounds A and the chunk states to bf16 (~1e-2 relative).
                    o_zm, o_fla = self.zm_fwd().float(), self.fla_fwd().float()
                    r["max_rel_diff_vs_fla"] = ((o_zm - o_fla).abs().max() / o_fla.abs().max()).item()
                    r["fwd_slowdown"] = r["zmrl_fwd_ms"] / r["fla_fwd_ms"]
        elif what == "zmrl_fwd_bwd":
            _guarded(r, "zmrl_fwd_bwd_ms", lambda: time_ms(self._fwd_bwd(self.zm_fwd)))
        elif what == "fla_fwd_bwd":
            _guarded(r, "fla_fwd_bwd_ms", lambda: time_ms(self._fwd_bwd(self.fla_fwd)))
        if "zmrl_fwd_bwd_ms" in r and "fla_fwd_bwd_ms" in r:
            r["fwd_bwd_slowdown"] = r["zmrl_fwd_bwd_ms"] / r["fla_fwd_bwd_ms"]


def _default_budget() -> float:
    """run_gpu.sh exports STEP_LIMIT (its timeout for this step): stay 30 s inside it."""
    limit = os.environ.get("STEP_LIMIT")
    return max(20.0, float(limit) - 30.0) if limit else 230.0


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16], help="packed sequences per shape")
    ap.add_argument("--no-backward", action="store_true", help="forward only")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop starting new measurements after this many seconds (default: STEP_LIMIT - 30 "
                         "when run_gpu.sh sets it, else 230); the JSON is rewritten after every measurement")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<date>_kda_h200.json)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda_vs_fla: needs a CUDA GPU")
    budget = a.time_budget_s if a.time_budget_s is not None else _default_budget()
    out = pathlib.Path(a.out) if a.out else (pathlib.Path(__file__).resolve().parent / "results"
                                             / f"{time.strftime('%Y-%m-%d')}_kda_h200.json")
    chunk_kda, fla_error = _load_fla()
    if chunk_kda is None:
        log.warning("fla-core not importable (%s): timing zmrl only", fla_error)

    import triton

    from zmrl.kernels_batch_invariant import current_numerics

    result: dict[str, Any] = {
        "benchmark": "kda_vs_fla",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "fla-core": _version("fla-core"),
                     "cuda": torch.version.cuda},
        "fla_error": fla_error,
        "dot_precision": current_numerics().kda_dot_precision,
        "dtypes": "q, k, v, beta bf16; g fp32; zmrl computes in fp32",
        "timing": "triton.testing.do_bench median; calls slower than 1 s: one timed run after a warm-up",
        "time_budget_s": budget,
        "skipped": [],
        "rows": [],
    }
    # Forward of every shape first, then forward + backward: the most useful numbers come first
    # if the budget runs out (fla's first calls autotune for a while).
    shapes = [ShapeBench(t, n, chunk_kda) for t in a.tokens for n in a.seqs]
    result["rows"] = [sb.row for sb in shapes]
    plan = [(sb, "zmrl_fwd") for sb in shapes]
    if chunk_kda is not None:
        plan += [(sb, "fla_fwd") for sb in shapes]
    if not a.no_backward:
        plan += [(sb, "zmrl_fwd_bwd") for sb in shapes]
        if chunk_kda is not None:
            plan += [(sb, "fla_fwd_bwd") for sb in shapes]
    t_start = time.perf_counter()
    for sb, what in plan:
        if time.perf_counter() - t_start > budget:
            result["skipped"].append(f"{what} T={sb.row['T']} seqs={sb.row['num_seqs']} (time budget)")
            continue
        log.info("%s T=%d seqs=%d ...", what, sb.row["T"], sb.row["num_seqs"])
        sb.measure(what)
        result["elapsed_s"] = time.perf_counter() - t_start
        _write(out, result)
    if result["skipped"]:
        log.warning("time budget %.0f s used up: skipped %d measurements", budget, len(result["skipped"]))

    cols = [("T", "T", "d"), ("seqs", "num_seqs", "d"), ("zmrl fwd", "zmrl_fwd_ms", ".3f"),
            ("fla fwd", "fla_fwd_ms", ".3f"), ("x", "fwd_slowdown", ".2f"),
            ("zmrl f+b", "zmrl_fwd_bwd_ms", ".2f"), ("fla f+b", "fla_fwd_bwd_ms", ".3f"),
            ("x", "fwd_bwd_slowdown", ".1f"), ("rel diff", "max_rel_diff_vs_fla", ".1e")]
    print(f"KDA chunk, H={H} dk={DK} dv={DV}, bf16 inputs, ms (median) on {result['gpu']}")
    print("".join(f"{name:>11}" for name, _, _ in cols))
    for r in result["rows"]:
        print("".join(f"{format(r[key], fmt):>11}" if key in r else f"{'-':>11}" for _, key, fmt in cols))
    _write(out, result)
    print(f"wrote {out}")


def _write(out: pathlib.Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
