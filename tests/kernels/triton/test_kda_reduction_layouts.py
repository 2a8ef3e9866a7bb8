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

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import kernel_resources  # noqa: E402


def _skip_without_toolchain() -> None:
    if kernel_resources.missing_tools():
        pytest.skip(f"this Triton lacks {kernel_resources.missing_tools()} (its NVIDIA backend)")


def _report(tmp_path: Path) -> list[dict]:
    _skip_without_toolchain()
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_resources.py"), "--kernels",
                           "intra,intra_decode", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())["kernels"]


def _key(r: dict) -> tuple:
    return r["op"], r["axis"], r["shape"], r["layout"]


def test_decode_variant_reduces_like_the_chunk_kernel(tmp_path):
    """Every scan / reduction of the chunk kernel appears, in order and with its layout, in the decode
    variant; the decode variant's only extra ones are its axis-0 picks of the new row's diagonal entries
    (one exact value per column: ``x + 0`` in any order)."""
    chunk, decode = _report(tmp_path)
    assert chunk["name"] == "kda_intra (chunk)" and decode["name"] == "kda_intra (decode)"
    assert chunk["registers"] > 0 and decode["registers"] > 0
    want = [_key(r) for r in chunk["reductions"]]
    assert [k[:3] for k in want] == [("scan", 0, "64x128xf32"), ("reduce", 1, "16x128xf32"),
                                     ("reduce", 1, "16x128xf32"), ("reduce", 0, "16x64xf32"),
                                     ("reduce", 1, "64x64xf32")]
    extra, i = [], 0
    for key in map(_key, decode["reductions"]):
        if i < len(want) and key == want[i]:
            i += 1
        else:
            extra.append(key)
    assert i == len(want), f"the decode variant lacks {want[i]} (or has it with another layout)"
    assert [k[:3] for k in extra] == [("reduce", 0, "16x64xf32")] * 2, extra


def test_mla_kernel_report_builds():
    """The sparse MLA kernel's report (kernel_resources.mla_report) builds with the kernel's current signature
    and launch configuration; its online softmax holds a row max and a row sum per key block."""
    _skip_without_toolchain()
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the compiler, not the interpreter")
    report = kernel_resources.mla_report()
    assert report.registers > 0 and report.name.startswith("mla_split")
    assert sum(r.op == "reduce" and r.axis == 1 for r in report.reductions) >= 2
    assert report.mma == "mma.sync" and report.stack_bytes == 0  # 32 heads: too few rows for a warpgroup MMA


def test_mla_keys_form_runs_warpgroup_mmas():
    """The transposed form (Numerics.mla_mma_rows = "keys") exists for Hopper's warpgroup MMA: its sm_90 build
    must issue wgmma (keys and latent columns on the rows, heads on the columns), and its online softmax
    reduces over the keys, now axis 0 of the [keys, heads] score tile."""
    _skip_without_toolchain()
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the compiler, not the interpreter")
    report = kernel_resources.mla_report(mma_rows="keys")
    assert report.mma == "wgmma", report
    assert sum(r.op == "reduce" and r.axis == 0 and r.shape == "64x32xf32" for r in report.reductions) >= 2


def test_recurrent_kernel_report_builds():
    """The recurrent-form KDA kernel's report builds with its current signature and launch configuration: two
    reductions over dk per token (what the state recalls for k, the read-out), no register spills."""
    _skip_without_toolchain()
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the compiler, not the interpreter")
    from zmrl.kernels_batch_invariant.triton.kda_recurrent import launch_config

    report = kernel_resources.recurrent_report()
    assert report.registers > 0 and report.stack_bytes == 0
    bv = launch_config(128, 128)["BV"]
    assert [(r.op, r.axis, r.shape) for r in report.reductions] == [("reduce", 0, f"128x{bv}xf32")] * 2
