"""The KDA dot precision is a field of the numerics contract: applying another value changes the
kernel's bits (a different compile-time constant), applying it again reproduces them."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import Numerics, current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.kda import kda_chunk

from .test_kda_chunk import make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


def test_precision_comes_from_the_contract(device, interpret):
    if interpret:
        pytest.skip("the interpreter ignores input_precision (every dot is fp32)")
    q, k, v, g, beta, cu, s0 = make_inputs([70, 130], 2, 64, 64, device)
    runs = {}
    for prec in ("tf32x3", "tf32", "tf32x3"):
        with numerics_scope(current_numerics().replace(kda_dot_precision=prec)):
            o, state, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0)
        if prec in runs:
            assert torch.equal(runs[prec][0], o) and torch.equal(runs[prec][1], state)
        runs[prec] = (o, state)
    # single-pass TF32 rounds the dot operands to 10 mantissa bits: ~1e-3 relative, never the same bits
    assert not torch.equal(runs["tf32"][0], runs["tf32x3"][0])
    torch.testing.assert_close(runs["tf32"][0], runs["tf32x3"][0], rtol=2e-2, atol=2e-2)
    assert Numerics().kda_dot_precision == current_numerics().kda_dot_precision
