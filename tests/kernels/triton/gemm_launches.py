"""Counting launches of the Triton GEMM kernel (tests of how many GEMMs a fused path takes)."""
from __future__ import annotations


def count_gemm_launches(monkeypatch) -> list[int]:
    """From now on (until ``monkeypatch`` undoes it), one entry per ``_gemm_kernel[grid](...)`` launch."""
    from zmrl.kernels_batch_invariant.triton import matmul as tm
    calls: list[int] = []
    real = tm._gemm_kernel

    class Counting:
        def __getitem__(self, grid):
            calls.append(1)
            return real[grid]

    monkeypatch.setattr(tm, "_gemm_kernel", Counting())
    return calls
