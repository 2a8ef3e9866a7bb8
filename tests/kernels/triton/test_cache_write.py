"""Triton ``write_cache_rows``: the bytes the torch backend stores (latent parts side by side, FP8 index key
bytes, scales) at shuffled slots, and nothing else."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.cache_write import write_cache_rows
from zmrl.kernels_batch_invariant.triton import triton_impl

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


def test_same_bytes_as_the_torch_backend(device, interpret) -> None:
    g = torch.Generator().manual_seed(0)
    pages, page, dc, dr, dk, t = 3, 64, 40, 8, 24, 5
    fused = torch.randn(t, dc + dr + 16, generator=g).to(device, torch.bfloat16)
    c_kv, k_pe = fused[:, :dc], fused[:, dc + 16:]  # column slices of a wider tensor (rows apart)
    ik = (torch.randn(t, dk, generator=g) * 50).to(torch.float8_e4m3fn).to(device)
    isc = torch.rand(t, generator=g).to(device)
    slots = torch.tensor([130, 2, 64, 191, 7], device=device)
    pools = []
    for impl in (write_cache_rows.impls["torch"], triton_impl(write_cache_rows)):
        kv = torch.full((pages, page, dc + dr), 3.0, dtype=torch.bfloat16, device=device)
        k8 = torch.zeros(pages, page, dk, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        ks = torch.full((pages, page), -1.0, device=device)
        impl(slots, kv, (c_kv, k_pe), k8, ik, ks, isc)
        kv2 = torch.full((pages, page, dc + dr), 3.0, dtype=torch.bfloat16, device=device)
        impl(slots, kv2, (torch.cat([c_kv, k_pe], -1),))  # one part, no index
        pools.append((kv, k8.view(torch.uint8), ks, kv2))
    for a, b in zip(*pools):
        assert torch.equal(a, b)
    flat = pools[1][0].view(-1, dc + dr)
    assert torch.equal(flat[slots], torch.cat([c_kv, k_pe], -1)) and (flat[[0, 1, 3]] == 3.0).all()
    with pytest.raises(ValueError, match="do not make"):
        triton_impl(write_cache_rows)(slots, kv, (c_kv,))
