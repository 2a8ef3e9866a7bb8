"""Helpers for the Triton row-wise kernel tests (norms, GLUs, gates, log-probs, FP8, MoE): random
inputs on the test device, a row-invariance check, and the batch sizes to sweep (small under the
interpreter, up to 1000 rows on CUDA)."""
from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch

# Under the interpreter every program is a Python loop iteration: keep batches tiny.
INTERPRET_SIZES = [1, 2, 3, 5, 8]
# On CUDA: around power-of-two boundaries and well past the number of SMs.
CUDA_SIZES = [1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 1000]


def batch_sizes(interpret: bool) -> list[int]:
    return INTERPRET_SIZES if interpret else CUDA_SIZES


def randn(*shape: int, device: torch.device, seed: int, scale: float = 1.0,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # float8 has no CUDA comparison kernels: compare its codes
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _outs(out: object) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        outs: tuple = (out,)
    elif isinstance(out, tuple):
        outs = tuple(o for o in out if isinstance(o, torch.Tensor))
    else:  # dataclass-like (RouterOutput)
        outs = tuple(v for v in vars(out).values() if isinstance(v, torch.Tensor))
    return tuple(_bits(o) for o in outs)


def assert_rows_invariant(fn: Callable[..., object], inputs: Sequence[torch.Tensor], sizes: Sequence[int],
                          seed: int = 0) -> None:
    """Each output row of ``fn`` (every tensor output, dim 0 = row) is bitwise the same computed alone
    and inside batches of every size in ``sizes`` (rows drawn at random with repeats, random order)."""
    n = inputs[0].shape[0]
    g = torch.Generator().manual_seed(seed)
    alone = [_outs(fn(*(t[i:i + 1] for t in inputs))) for i in range(n)]
    for b in sizes:
        idx = torch.randint(0, n, (b,), generator=g)
        got = _outs(fn(*(t[idx.to(t.device)] for t in inputs)))
        for k, out in enumerate(got):
            for j, i in enumerate(idx.tolist()):
                if not torch.equal(out[j], alone[i][k][0]):
                    pytest.fail(f"output {k}: row {i} at position {j} of a batch of {b} differs from the row alone")
