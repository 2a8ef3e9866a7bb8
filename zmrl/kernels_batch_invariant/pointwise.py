"""Position-safe pointwise nonlinearities.

On CPU, torch evaluates a pointwise op with a SIMD kernel on the bulk of a tensor and a scalar
kernel on the tail; for sigmoid, SiLU and softplus (fp32) and rsqrt (bf16) the two disagree in the
last ulp, so an element's value depends on where it lands in the tensor, i.e. on the batch.
exp, log, log1p, tanh, sqrt, rsqrt (fp32) and IEEE +,-,*,/ agree on both paths
(tests/kernels/test_pointwise.py proves it on every path), so the nonlinearities are composed
from those, in fp32.

On CUDA these building blocks stay torch compositions: torch's CUDA elementwise kernels have no
SIMD-bulk/scalar-tail split (an element's value is the same scalar function wherever it sits; the
vectorised path only widens the loads), so they are row-invariant already. The Triton kernels inline
their own sigmoid/SiLU/softplus (triton/_common.py) rather than calling these.

Two ops that a model calls on whole tensors are ``invariant_op`` s (``sigmoid_op``, ``add_cast``): their
torch compositions are several elementwise launches on the GPU (sigmoid: neg, exp, add, reciprocal, mul),
which the Triton backend (triton/pointwise.py) does in one. Elementwise either way: row-invariant.
"""
from __future__ import annotations

import torch

from ._dispatch import invariant_op


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    # Same threshold as torch.nn.functional.softplus; the clamp keeps exp finite on the
    # branch that where() discards (its gradient would otherwise be inf * 0 = nan).
    return torch.where(x > threshold, x, torch.log1p(torch.exp(x.clamp(max=threshold))))


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(x, 0.0)


@invariant_op
def sigmoid_op(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` of a whole tensor (KDA's beta from its fp32 logits), in x's dtype."""
    return sigmoid(x)


@invariant_op
def add_cast(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a + b.to(a.dtype)).to(out_dtype)``: b widened to a's dtype, one add, one rounding (the MoE's fp32
    routed sum plus its shared expert, rounded to the model dtype). a and b have the same shape."""
    check_add_cast(a, b)
    return (a + b.to(a.dtype)).to(out_dtype)


def check_add_cast(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"add_cast: a {tuple(a.shape)} and b {tuple(b.shape)} differ in shape")
