"""The training backward through the Triton backend (its autograd Functions, the views they return, the layers
that join or split them) on the small all-paths model of tests/trainer/test_gradients.py, on the CPU under
TRITON_INTERPRET=1: every LoRA gradient matches the torch backend's.

Both sides are fp32 with the same forward math; they differ only in summation orders (the Triton GEMMs' fixed
K loop, the backward's stock GEMMs in other groupings): measured 4e-6 relative (norm), so 1e-4 leaves margin
while a gradient cut or mis-scaled anywhere is O(1) (a cut q/k/v path gave 1.0). On a GPU
tests/trainer/test_gradients_gpu.py compares the CUDA gradients (fla's TF32 KDA backward) with float64."""
from __future__ import annotations

import pytest

from zmrl.kernels_batch_invariant.triton import triton_everywhere

from tests.trainer.test_gradients import batch, grads_of, model32, relative_grad_errors  # noqa: F401

pytestmark = [pytest.mark.triton]


def test_triton_backend_lora_gradients_match_torch_backend(device, model32, batch):  # noqa: F811
    if device.type == "cuda":
        pytest.skip("on a GPU tests/trainer/test_gradients_gpu.py checks the CUDA gradients against float64")
    _, want = grads_of(model32, batch)
    with triton_everywhere():
        _, got = grads_of(model32, batch)
    worst = relative_grad_errors(got, want)
    assert worst[0][0] < 1e-4, worst[:5]
