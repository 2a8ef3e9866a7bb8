"""Batch-of-one GEMMs on CPU: which shapes get other bits than inside a batch, and what the fix costs.

ATen runs ``torch.bmm`` with one batch element as a plain GEMM (sgemm/dgemm) and with more as MKL's
batched GEMM. For each MKL mode (a fresh process each: MKL reads ``MKL_CBWR`` at its first GEMM) this

* scans shapes m x k x n (fp32 and fp64, a and b each row- or column-major) and counts where element 0
  of a batch of one differs from element 0 of a batch of two, for plain ``torch.bmm`` and for
  ``zmrl.kernels_batch_invariant.matmul._bmm`` (which the invariant ops use);
* times the ops on the shapes of the tests, alternating the code before the fix (``torch.bmm``) and
  after (``_bmm``) in one process, so machine load hits both alike; and a decode of one sequence on the
  tiny model sharded into 4 virtual shards (one MLA head per piece: the case that broke parity).

Writes ``benchmarks/results/<date>_cpu_gemm_batch_of_one.json`` (``--out``)::

    python benchmarks/cpu_gemm_batch_of_one.py
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ["AVX2,STRICT", "AVX512,STRICT", "AUTO"]
SCAN_M = (1, 2, 3, 4, 8, 16, 17)
SCAN_K = (5, 16, 33, 80, 256, 1000)
SCAN_N = (1, 2, 16, 17, 64, 256)


def _scan(torch, mm) -> dict:
    g = torch.Generator().manual_seed(0)
    counts = {"cases": 0, "torch.bmm": {"m==1": 0, "n==1": 0, "other": 0}, "_bmm": 0}
    examples = []
    for dt, m, k, n, a_cm, b_cm in itertools.product((torch.float32, torch.float64), SCAN_M, SCAN_K, SCAN_N,
                                                     (False, True), (False, True)):
        if m * k * n < 400:  # ATen's own per-element loop: the same code for any batch
            continue
        counts["cases"] += 1
        a = torch.randn(2, k, m, generator=g, dtype=dt).transpose(1, 2) if a_cm else torch.randn(2, m, k, generator=g, dtype=dt)
        b = torch.randn(2, n, k, generator=g, dtype=dt).transpose(1, 2) if b_cm else torch.randn(2, k, n, generator=g, dtype=dt)
        if not torch.equal(torch.bmm(a[:1], b[:1]), torch.bmm(a, b)[:1]):
            counts["torch.bmm"]["m==1" if m == 1 else "n==1" if n == 1 else "other"] += 1
            if len(examples) < 8:
                examples.append({"dtype": str(dt), "m": m, "k": k, "n": n, "a": "col-major" if a_cm else "row-major",
                                 "b": "col-major" if b_cm else "row-major"})
        if not torch.equal(mm._bmm(a[:1], b[:1]), mm._bmm(a, b)[:1]):
            counts["_bmm"] += 1
    return {"counts": counts, "examples": examples}


def _rate(fn, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def _speed(torch, mm, rounds: int) -> dict:
    from zmrl.kernels_batch_invariant.matmul import bmm_fixed, linear

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    keys1, keys40 = r(1, 64, 80), r(40, 64, 80)
    cases = {
        "bmm_fixed 1 x [1,80]@keys^T[80,64] (MLA scores, 1 head, 1 query)": lambda: bmm_fixed(q1, keys1.transpose(1, 2)),
        "bmm_fixed 40 x [1,80]@keys^T[80,64]": lambda: bmm_fixed(q40, keys40.transpose(1, 2)),
        "bmm_fixed 1 x [1,64]@[64,128] (KDA row solve)": lambda: bmm_fixed(q1[..., :64], b64),
        "linear 1 row K=256 N=256 (unchanged path)": lambda: linear(x1, w256),
        "linear 1 row K=4096 N=512 (unchanged path)": lambda: linear(x4096, w4096),
    }
    q1, q40, b64 = r(1, 1, 80), r(40, 1, 80), r(1, 64, 128)
    x1, w256, x4096, w4096 = r(1, 256), r(256, 256), r(1, 4096), r(512, 4096)
    fixed = mm._bmm
    out = {}
    for name, fn in cases.items():
        best = {"before": 0.0, "after": 0.0}
        for _ in range(rounds):
            for which, impl in (("before", torch.bmm), ("after", fixed)):
                mm._bmm = impl
                fn()
                best[which] = max(best[which], _rate(fn, 0.1))
        mm._bmm = fixed
        out[name] = {"ops_per_s_before": round(best["before"]), "ops_per_s_after": round(best["after"])}
    return out


def _engine(torch, mm, rounds: int) -> dict:
    from zmrl.model import ModelConfig, build_model
    from zmrl.parallel import ParallelConfig, shard_model
    from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams

    cfg = ModelConfig.preset("tiny")
    model = shard_model(build_model(cfg, seed=0), ParallelConfig(virtual_shards=4))
    engine = RolloutEngine(model, EngineConfig(block_size=64, num_blocks=8, max_num_seqs=2))
    prompt = list(range(1, 10))
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    fixed = mm._bmm
    best = {"before": float("inf"), "after": float("inf")}
    for _ in range(rounds):
        for which, impl in (("before", torch.bmm), ("after", fixed)):
            mm._bmm = impl
            t0 = time.perf_counter()
            engine.generate([prompt], [params])
            best[which] = min(best[which], time.perf_counter() - t0)
    mm._bmm = fixed
    return {"what": "tiny model, virtual_shards=4, one 9-token prompt alone, 16 new tokens",
            "tokens_per_s_before": round(16 / best["before"], 1), "tokens_per_s_after": round(16 / best["after"], 1)}


def child(rounds: int) -> None:
    import torch

    import zmrl  # noqa: F401  (sets MKL_CBWR's default before the first GEMM)
    import zmrl.kernels_batch_invariant.matmul as mm

    torch.set_num_threads(1)
    print(json.dumps({"mkl_cbwr": os.environ.get("MKL_CBWR"), "scan": _scan(torch, mm),
                      "ops": _speed(torch, mm, rounds), "engine_decode": _engine(torch, mm, rounds)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="alternations of before/after per timed case (best kept)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.rounds)
        return
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    runs = {}
    for mode in MODES:
        env = {**os.environ, "MKL_CBWR": mode, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds)],
                              env=env, capture_output=True, text=True, check=True)
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        c = runs[mode]["scan"]["counts"]
        print(f"MKL_CBWR={mode}: {c['cases']} shapes; batch of one != batch of two: torch.bmm {c['torch.bmm']}, "
              f"_bmm {c['_bmm']}")
        for name, v in runs[mode]["ops"].items():
            print(f"  {v['ops_per_s_before']:>9} -> {v['ops_per_s_after']:>9} ops/s  {name}")
        e = runs[mode]["engine_decode"]
        print(f"  {e['tokens_per_s_before']:>9} -> {e['tokens_per_s_after']:>9} tokens/s  {e['what']}")
    record = {"benchmark": "cpu_gemm_batch_of_one", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu,
              "nproc": os.cpu_count(), "threads": 1, "runs": runs}
    out = Path(args.out or REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}_cpu_gemm_batch_of_one.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
