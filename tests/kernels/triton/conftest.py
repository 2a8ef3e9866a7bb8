"""Fixtures for the Triton kernel tests: they run on CUDA, or on CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import os

import pytest
import torch

from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.numerics import KDA_FORMS
from zmrl.kernels_batch_invariant.triton import HAS_TRITON

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
