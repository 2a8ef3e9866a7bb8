"""The device the device-parametrised tests (tests/bitwise, tests/model/parity_utils) build models on.

Read from the environment in this one place: ``ZMRL_TEST_DEVICE=cuda python -m pytest -q tests/bitwise``
runs the bitwise suite on the GPU (on CUDA tensors the ops dispatch to their Triton backend where
one is registered, else to the torch composition). The default is the CPU.
"""
from __future__ import annotations

import os

import pytest
import torch

ENV_VAR = "ZMRL_TEST_DEVICE"


def _test_device() -> torch.device:
    raw = os.environ.get(ENV_VAR, "cpu").strip() or "cpu"
    try:
        dev = torch.device(raw)
    except RuntimeError as e:
        raise RuntimeError(f"{ENV_VAR}={raw!r} is not a torch device ({e}); use cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{ENV_VAR}={raw!r}: only cpu and cuda[:N] are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        # a clear failure, not a silent fall-back to the CPU: the user asked for a GPU run
        raise RuntimeError(f"{ENV_VAR}={raw!r} but torch.cuda.is_available() is False")
    return dev


TEST_DEVICE: torch.device = _test_device()
ON_CUDA: bool = TEST_DEVICE.type == "cuda"

# Thread-count invariance is a property of the CPU backend (intra-op threads); on CUDA it is moot.
cpu_only = pytest.mark.skipif(ON_CUDA, reason=f"CPU thread-count test ({ENV_VAR}={TEST_DEVICE})")


def tensor(value, **kw) -> torch.Tensor:
    """``torch.tensor`` on the test device."""
    return torch.tensor(value, device=TEST_DEVICE, **kw)

# The engine's decode path in the device-parametrised engine tests (EngineConfig.decode_graphs): the default
# "auto" is CUDA-graph decode on a GPU, eager on CPU; ``ZMRL_TEST_DECODE_GRAPHS=off`` runs tests/bitwise on a
# GPU with eager decode, ``static`` the fixed-shape path without capture.
DECODE_GRAPHS_ENV_VAR = "ZMRL_TEST_DECODE_GRAPHS"
TEST_DECODE_GRAPHS: str = os.environ.get(DECODE_GRAPHS_ENV_VAR, "auto").strip() or "auto"
