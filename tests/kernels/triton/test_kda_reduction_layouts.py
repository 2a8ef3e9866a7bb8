"""The KDA decode step's intra-chunk kernel reduces with the chunk kernel's layouts (built for sm_90 on CPU).

The decode step reproduces the chunk kernel's row bits by running the same kernel with ``DECODE=True``
(``triton/kda_chunk.py``). The in-chunk cumulative decay (``tl.cumsum``) and the tile reductions (``tl.sum``)
combine in a tree that follows the layout Triton gives their input, and the layout is chosen by the compiler
for each variant separately. The bits can only match where every scan and reduction the two variants share
has the same layout; this builds both variants with the installed Triton and compares them
(``benchmarks/kernel_resources.py`` prints the whole report).

Checked with Triton 3.6 (the GPU runs' version, under which the GPU parity suite passes) and 3.9 (the CPU
install): both give the two variants the same layouts. A Triton that does not is a parity risk for the
decode step on the GPU before any GPU run shows it (docs/cuda_graph_decode.md, "KDA decode: registers and
layouts").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[3]


def _report(tmp_path: Path) -> list[dict]:
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_resources.py"), "--kernels",
                           "intra,intra_decode", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)
    if done.returncode != 0 and "Unsupported" in done.stderr:  # pragma: no cover - toolchain without sm_90
        pytest.skip(f"this Triton cannot build for sm_90 here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())["kernels"]


def _shared_reductions(kernel: dict) -> list[tuple]:
    """The scan and the reductions over dk and over the T columns (the decode variant's extra reductions over
    rows only pick one exact value per column: ``x + 0`` in any order)."""
    return [(r["op"], r["axis"], r["shape"], r["layout"]) for r in kernel["reductions"]
            if r["op"] == "scan" or r["axis"] == 1]


def test_decode_variant_reduces_like_the_chunk_kernel(tmp_path):
    chunk, decode = _report(tmp_path)
    assert chunk["name"] == "kda_intra (chunk)" and decode["name"] == "kda_intra (decode)"
    assert chunk["registers"] > 0 and decode["registers"] > 0
    shared = _shared_reductions(chunk)
    assert [r[:3] for r in shared] == [("scan", 0, "64x128xf32"), ("reduce", 1, "16x128xf32"),
                                       ("reduce", 1, "16x128xf32"), ("reduce", 1, "64x64xf32")]
    assert _shared_reductions(decode) == shared
