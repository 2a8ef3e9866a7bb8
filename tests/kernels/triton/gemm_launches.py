"""Counting launches of the Triton GEMM module's kernels (tests of how many launches a fused path takes)."""
from __future__ import annotations


def count_gemm_launches(monkeypatch, kernel: str = "_gemm_kernel") -> list[int]:
    """From now on (until ``monkeypatch`` undoes it), one entry per ``<kernel>[grid](...)`` launch of
    ``triton/matmul.py`` (the GEMM kernel by default; e.g. ``_split_k_sum``)."""
    from zmrl.kernels_batch_invariant.triton import matmul as tm
    return count_launches(monkeypatch, tm, kernel)


def count_launches(monkeypatch, module, kernel: str) -> list[int]:
    """One entry per ``<kernel>[grid](...)`` launch of the Triton module ``module`` from now on."""
    calls: list[int] = []
    real = getattr(module, kernel)

    class Counting:
        def __getitem__(self, grid):
            calls.append(1)
            return real[grid]

    monkeypatch.setattr(module, kernel, Counting())
    return calls
