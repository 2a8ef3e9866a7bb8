"""``benchmarks/kda_decode_phases.py`` cuts one phase at a time out of the KDA intra kernel's source by anchors:
every anchor must still be in the kernel (else the benchmark stops), each variant must differ from the kernel,
and, built for sm_90 on this machine, do less than the kernel: its scans and reductions an ordered sub-list of
the kernel's decode variant's (cutting one branch of a constexpr ``if`` would compile the other instead)."""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import kda_decode_phases as phases  # noqa: E402
import kernel_resources  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("cut", list(phases.PHASES))
def test_every_phase_variant_cuts_its_anchors(cut):
    kernel = phases.variant_kernel(cut)
    src = inspect.getsource(kernel.fn)
    assert src != inspect.getsource(phases.tk._kda_intra_kernel.fn)
    assert all(repl in src for _, repl in phases.PHASES[cut])


def _is_sublist(small: list, big: list) -> bool:
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the compiler, not the interpreter")
def test_variants_build_and_reduce_less():
    if kernel_resources.missing_tools():
        pytest.skip(f"this Triton lacks {kernel_resources.missing_tools()} (its NVIDIA backend)")
    def reduction_list(kernel) -> list:
        (report,) = kernel_resources.kda_reports(128, 128, ["intra_decode"], intra_kernel=kernel)
        return [(r.op, r.axis, r.shape, r.layout) for r in report.reductions]

    full = reduction_list(phases.tk._kda_intra_kernel)
    # the phases that hold reductions, and the (op, axis, shape) each must leave out entirely
    gone = {"scan": ("scan", 0, "64x128xf32"), "diag": ("reduce", 1, "16x128xf32"), "solve": ("reduce", 1, "64x64xf32")}
    for cut, key in gone.items():
        got = reduction_list(phases.variant_kernel(cut))
        assert _is_sublist(got, full), (cut, got)
        assert key in [r[:3] for r in full] and key not in [r[:3] for r in got], (cut, got)
