"""``benchmarks/kda_decode_phases.py`` cuts one phase at a time out of the KDA intra kernel's source by anchors:
every anchor must still be in the kernel (else the benchmark stops), and each variant must differ from the
kernel and build."""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import kda_decode_phases as phases  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("cut", list(phases.PHASES))
def test_every_phase_variant_builds(cut):
    kernel = phases.variant_kernel(cut)
    src = inspect.getsource(kernel.fn)
    assert src != inspect.getsource(phases.tk._kda_intra_kernel.fn)
    assert all(repl in src for _, repl in phases.PHASES[cut])
