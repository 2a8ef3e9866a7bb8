"""CPU GEMMs across thread counts: which MKL routine gives a tile the same bits at every torch thread count,
and what sending every batch of one to the batched routine costs.

ATen runs ``torch.bmm`` with one batch element as a plain GEMM (sgemm) and with more as MKL's batched GEMM.
On a CPU where MKL ignores its CNR branch (AMD) the plain GEMM splits K over 3 or more threads. This

* scans one-tile shapes ``[16, K] @ [K, N]`` (the tiles ``linear`` feeds MKL; the rows past the first three
  zero, as a short batch pads them) and counts those whose result at 2, 3, 4 or 8 threads differs from the
  one at 1 thread, for the plain GEMM (a batch of one) and the batched GEMM (batches of 2, 3 and 7);
* times a one-tile ``linear`` as it ran before (a batch of one on the plain GEMM) and as it runs now (the
  same element twice on the batched GEMM, ``matmul._bmm``), alternated in one process, best of ``--rounds``.

Writes ``benchmarks/results/<date>_cpu_gemm_threads_<vendor>.json`` (``--out``)::

    python benchmarks/cpu_gemm_threads.py
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path

import torch

import zmrl  # noqa: F401  (sets MKL_CBWR before the first GEMM)
from zmrl.kernels_batch_invariant import matmul as mm
from zmrl.kernels_batch_invariant.numerics import _cpu_vendor

REPO = Path(__file__).resolve().parents[1]
THREADS = (1, 2, 3, 4, 8)
SCAN_K = (16, 48, 576, 1024, 2304, 7168)
SCAN_N = (16, 32, 64, 576, 2048)
TIMED = [(256, 256), (1024, 1024), (2048, 2048), (2048, 512)]  # (K, N) of a one-tile linear


def _at_threads(fn) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    try:
        out = []
        for t in THREADS:
            torch.set_num_threads(t)
            out.append(fn())
        return out
    finally:
        torch.set_num_threads(before)


def _differs(results: list[torch.Tensor]) -> list[int]:
    return [t for t, r in zip(THREADS[1:], results[1:]) if not torch.equal(results[0], r)]


def scan(ks: tuple[int, ...] = SCAN_K, ns: tuple[int, ...] = SCAN_N) -> dict:
    g = torch.Generator().manual_seed(3)
    plain, batched, cases = [], [], 0
    for k, n in itertools.product(ks, ns):
        w = torch.randn(n, k, generator=g)
        tile = torch.zeros(1, 16, k)
        tile[0, :3] = torch.randn(3, k, generator=g)
        bt = w.t().unsqueeze(0)
        cases += 1
        bad = _differs(_at_threads(lambda: torch.bmm(tile, bt)))
        if bad:
            plain.append({"k": k, "n": n, "threads": bad})
        for b in (2, 3, 7):
            xs = torch.randn(b, 16, k, generator=g)
            xs[0] = tile[0]
            bad = _differs(_at_threads(lambda: torch.bmm(xs, bt.expand(b, k, n))[:1]))
            if bad:
                batched.append({"k": k, "n": n, "batch": b, "threads": bad})
    return {"one_tile_shapes": cases, "thread_counts": list(THREADS),
            "plain_gemm_differs": plain, "batched_gemm_differs": batched}


def _mean_us(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def timings(rounds: int, threads: int, shapes: list[tuple[int, int]] = TIMED) -> list[dict]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(5)
    rows = []
    for k, n in shapes:
        x = torch.randn(1, 16, k, generator=g)
        bt = torch.randn(n, k, generator=g).t().unsqueeze(0)
        plain = lambda: torch.bmm(x, bt)  # noqa: E731  (the code before: a batch of one, plain GEMM)
        now = lambda: mm._bmm(x, bt)  # noqa: E731
        for f in (plain, now):
            f()
        iters = max(5, int(2e5 / (k * n / 1e3)))
        best_plain = best_now = float("inf")
        for _ in range(rounds):  # alternated: machine load hits both alike
            best_plain = min(best_plain, _mean_us(plain, iters))
            best_now = min(best_now, _mean_us(now, iters))
        rows.append({"k": k, "n": n, "threads": threads, "plain_us": round(best_plain, 1),
                     "batched_us": round(best_now, 1), "ratio": round(best_now / best_plain, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="alternations of before/after per timed case (best kept)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the timings")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="a few shapes, one round (tests)")
    args = ap.parse_args()
    if args.smoke:
        args.rounds = 1
    vendor = _cpu_vendor()
    result = {
        "benchmark": "cpu_gemm_threads", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "mkl_cbwr": os.environ.get("MKL_CBWR"), "cpu_vendor": vendor, "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "scan": scan((48, 576), (32, 64)) if args.smoke else scan(),
        "one_tile_linear": timings(args.rounds, args.threads, TIMED[:1] if args.smoke else TIMED),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    result["cpu"] = names[0] if names else result["cpu"]
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / (
        f"{result['date']}_cpu_gemm_threads_{'amd' if 'AMD' in vendor else 'intel' if 'Intel' in vendor else 'cpu'}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    s = result["scan"]
    print(f"{s['one_tile_shapes']} one-tile shapes at threads {THREADS}: plain GEMM differs on "
          f"{len(s['plain_gemm_differs'])}, batched on {len(s['batched_gemm_differs'])}")
    for r in result["one_tile_linear"]:
        print(f"  K={r['k']:5d} N={r['n']:5d}: plain {r['plain_us']:8.1f} us, batched {r['batched_us']:8.1f} us "
              f"({r['ratio']}x)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
