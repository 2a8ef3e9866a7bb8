"""What MKL's strict conditional-numerical-reproducibility mode (the numerics contract's default
``cpu_gemm_cnr="AVX2,STRICT"``) costs the CPU ``linear``, and whether the bits depend on the thread
count with and without it.

Each mode runs in a fresh process (MKL reads ``MKL_CBWR`` at its first GEMM). Writes
``benchmarks/results/<date>_cpu_gemm_cnr.json`` (``--out``) and prints a table::

    python benchmarks/cpu_gemm_cnr.py --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = [(1, 4096, 512), (16, 1024, 1024), (256, 1024, 1024), (1024, 512, 2048), (1, 1000, 100)]
MODES = ["AVX2,STRICT", "AVX512,STRICT", "AUTO"]

_CHILD = r"""
import json, sys, time, torch
from zmrl.kernels_batch_invariant.matmul import linear
threads, shapes, reps = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
out = []
for m, k, n in shapes:
    g = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    torch.set_num_threads(1)
    one = linear(x, w)
    torch.set_num_threads(threads)
    same = torch.equal(linear(x, w), one)
    linear(x, w)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(5):
            linear(x, w)
        best = min(best, (time.perf_counter() - t) / 5)
    out.append({"shape": [m, k, n], "ms": best * 1e3, "same_bits_as_1_thread": same})
print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "results": out}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    runs = {}
    for mode in MODES:
        env = {**os.environ, "MKL_CBWR": mode, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(args.threads), json.dumps(SHAPES), str(args.reps)],
                              env=env, capture_output=True, text=True, check=True)
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"CPU: {cpu}, {args.threads} threads; linear() best of {args.reps}x5 calls, ms (same bits as 1 thread?)")
    print(f"{'M x K x N':>18} " + " ".join(f"{m:>22}" for m in MODES))
    for i, shape in enumerate(SHAPES):
        cells = [f"{runs[m]['results'][i]['ms']:9.3f} ({'yes' if runs[m]['results'][i]['same_bits_as_1_thread'] else 'NO'})"
                 for m in MODES]
        print(f"{' x '.join(map(str, shape)):>18} " + " ".join(f"{c:>22}" for c in cells))
    record = {"benchmark": "cpu_gemm_cnr", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu,
              "nproc": os.cpu_count(), "threads": args.threads, "runs": runs}
    out = Path(args.out or REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}_cpu_gemm_cnr.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
