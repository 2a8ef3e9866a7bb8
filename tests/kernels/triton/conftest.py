"""Fixtures for the Triton kernel tests: they run on CUDA, or on CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import os

import pytest
import torch

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
