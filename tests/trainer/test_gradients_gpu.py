"""The training backward on CUDA (Triton forwards with the GPU backwards: fla-core for KDA, the MLA GEMM
backward, closed forms for the row-wise ops) on the small all-paths model of test_gradients.py:

* LoRA gradients against the float64 CPU reference. The model is fp32; fla runs its fp32 path with TF32
  tensor-core dots (2^-11 relative per operand), the other backwards are fp32: measured errors are
  printed (``-s``); 2e-2 per tensor leaves margin while a dropped or mis-scaled path is O(1).
* Two identical backward passes give bitwise-equal gradients.
* Activation recompute (``layer``, ``selective``) gives bitwise the gradients of ``none`` on the GPU too.
"""
from __future__ import annotations

import copy

import pytest
import torch

from zmrl.model import apply_recompute
from zmrl.trainer import compute_logprobs

from .test_gradients import (MBT, PROMPTS, TEMPS, batch, grads64, model32, model64,  # noqa: F401 (fixtures)
                             relative_grad_errors)

pytestmark = pytest.mark.gpu


def _cuda_grads(model32, batch, policy: str = "none"):  # noqa: F811
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m = apply_recompute(copy.deepcopy(model32).cuda(), policy)
    seqs, coef = batch
    lps = compute_logprobs(m, seqs, PROMPTS, temperature=TEMPS, micro_batch_tokens=MBT)
    loss = sum((lp * c.to(lp.device, lp.dtype)).sum() for lp, c in zip(lps, coef))
    loss.backward()
    return {n: (None if p.grad is None else p.grad.cpu()) for n, p in m.named_parameters() if p.requires_grad}


def test_cuda_gradients_match_float64(model32, batch, grads64):  # noqa: F811
    got = _cuda_grads(model32, batch)
    _, want = grads64
    worst = relative_grad_errors(got, want)
    print("\nCUDA LoRA gradients vs float64, worst relative errors:", [(f"{e:.2e}", n) for e, n in worst[:5]])
    assert worst[0][0] < 2e-2, worst[:5]


def test_cuda_backward_is_deterministic_and_recompute_exact(model32, batch):  # noqa: F811
    a = _cuda_grads(model32, batch)
    for policy in ("none", "layer", "selective"):
        b = _cuda_grads(model32, batch, policy)
        diff = [n for n in a if not ((a[n] is None and b[n] is None) or torch.equal(a[n], b[n]))]
        assert not diff, f"{policy}: {len(diff)} gradients differ from the first pass, e.g. {diff[:3]}"
