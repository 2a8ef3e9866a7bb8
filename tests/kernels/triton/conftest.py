"""Fixtures for the Triton kernel tests: they run on CUDA, or on CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import os

import pytest
import torch

from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.numerics import KDA_FORMS
from zmrl.kernels_batch_invariant.triton import HAS_TRITON

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _row_invariant_interpreter_dot() -> None:
    """Give Triton's interpreter a ``tl.dot`` whose every output element sums its K products in ascending order,
    whatever the tile's row count, as the GPU's MMAs do (measured: docs/numerics.md). The interpreter's own dot
    is numpy's ``matmul`` (BLAS), whose order can change with M: with OpenBLAS's Zen kernels (AMD EPYC) a KDA
    decode step's 16-row tile gave a row other bits than the same row in the 64-row chunk tile (2e-8), which the
    GPU never does. The products are formed in the accumulator's dtype and reduced over the K axis, which numpy
    does one K slice at a time."""
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(o.dtype.is_floating() and o.dtype.primitive_bitwidth == 8 for o in (a, b)):
            return real(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        prod = (a.data.astype(acc)[..., :, :, None] * b.data.astype(acc)[..., None, :, :]).sum(axis=-2, dtype=acc)
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if INTERPRET and HAS_TRITON:
    _row_invariant_interpreter_dot()


@pytest.fixture(scope="session")
def device() -> torch.device:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if INTERPRET:
        return torch.device("cpu")
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1")


@pytest.fixture(scope="session")
def interpret() -> bool:
    """True under Triton's CPU interpreter: use small shapes, and fp32 operands for tl.dot (the
    interpreter computes bf16 dots wrongly)."""
    return INTERPRET and not torch.cuda.is_available()


@pytest.fixture(params=KDA_FORMS)
def kda_form(request) -> str:
    """Each Triton KDA test runs under both forms of ``Numerics.kda_form`` (the op contract is the same:
    a decoded row is bitwise the packed forward's row, whichever arithmetic defines it)."""
    with numerics_scope(current_numerics().replace(kda_form=request.param)):
        yield request.param
