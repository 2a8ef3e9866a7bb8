"""Triton ``expert_linear`` with DEVICE offsets (the CUDA-graph-capturable form, no host sync):
bitwise equal to the host-offsets path (same kernel, same tiles, same K walk), for list and stacked
weights, empty experts, one expert holding every row, tile-boundary counts, int32 and int64 offsets;
the per-expert weight table is cached (one stable device tensor per weight set); gradients with
device offsets; malformed device offsets stay inside x and y.

Runs on CUDA, or on CPU under TRITON_INTERPRET=1 with small shapes (there "device offsets" are CPU
tensors: x's device). The accuracy of the kernel itself (float64 reference, invariance to token
counts) is tested in test_matmul.py; equality with the host path carries it over.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from zmrl.kernels_batch_invariant.moe_gemm import expert_linear
from zmrl.kernels_batch_invariant.triton import triton_impl

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

# (E, N, K, counts per expert): ragged with empty experts, one expert holding everything, no rows at
# all, one row each, counts on and around the 64-row tile of the small-N configs.
SMALL_CASES = [
    (4, 24, 40, [3, 0, 70, 1]),
    (4, 24, 40, [0, 0, 13, 0]),
    (4, 24, 40, [0, 0, 0, 0]),
    (3, 7, 33, [1, 1, 1]),
    (5, 16, 32, [64, 0, 0, 1, 65]),
]


def _offsets(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)]


def _run(*args, **kw) -> torch.Tensor:
    return triton_impl(expert_linear)(*args, **kw)


def _gpu_cases(gen: torch.Generator) -> list[tuple[int, int, int, list[int]]]:
    """Bench MoE shapes (64 experts x 256 intermediate, hidden 2048): a decode step (8 tokens x
    top-8), one expert with every row, and a skewed prefill-sized routing (4096 x top-8)."""
    picks = torch.stack([torch.randperm(64, generator=gen)[:8] for _ in range(8)]).flatten()
    decode = torch.bincount(picks, minlength=64).tolist()
    one = [0] * 64
    one[17] = 300
    p = torch.rand(64, generator=gen) ** 3
    p[::9] = 0
    prefill = torch.bincount(torch.multinomial(p, 4096 * 8, replacement=True, generator=gen), minlength=64).tolist()
    return [(64, 256, 2048, decode), (64, 2048, 256, decode), (64, 256, 2048, one), (64, 2048, 256, prefill)]


def _dtypes(interpret: bool) -> list[torch.dtype]:
    # Under the interpreter bf16 runs through the fp32 dot path, still worth a second variant.
    return [torch.float32, torch.bfloat16] if interpret else [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype_index", [0, 1])
def test_device_offsets_bitwise_equal_host_offsets(device, interpret, dtype_index):
    dtype = _dtypes(interpret)[dtype_index]
    gen = torch.Generator().manual_seed(21 + dtype_index)
    cases = SMALL_CASES + ([] if interpret else _gpu_cases(gen))
    for E, N, K, counts in cases:
        off = _offsets(counts)
        ws = [(torch.randn(N, K, generator=gen) / K**0.5).to(device, dtype) for _ in range(E)]
        x = torch.randn(off[-1], K, generator=gen).to(device, dtype)
        for weights in (ws, torch.stack(ws)):
            for out_dtype in (None, torch.float32):
                want = _run(x, weights, off, out_dtype=out_dtype)
                for idt in (torch.int32, torch.int64):
                    got = _run(x, weights, torch.tensor(off, dtype=idt, device=device), out_dtype=out_dtype)
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert torch.equal(got, want), (E, N, K, counts, type(weights), out_dtype, idt)
        if device.type == "cuda":
            # offsets as a CPU tensor next to CUDA x: read back on the host (the old path)
            assert torch.equal(_run(x, ws, torch.tensor(off)), _run(x, ws, off))


def test_device_offsets_lora_factors(device, interpret):
    """Batched expert LoRA factors: bf16 activations through fp32 stacked A [E, r, in], B [E, out, r]."""
    gen = torch.Generator().manual_seed(22)
    E, r, d_in, d_out = 5, 8, 48, 40
    a_f = torch.randn(E, r, d_in, generator=gen).to(device)
    b_f = torch.randn(E, d_out, r, generator=gen).to(device)
    for counts in ([4, 0, 6, 2, 1], [0, 0, 0, 9, 0]):
        off = _offsets(counts)
        x = torch.randn(off[-1], d_in, generator=gen).to(device, torch.bfloat16)
        dev_off = torch.tensor(off, dtype=torch.int32, device=device)
        t_host = _run(x, a_f, off, out_dtype=torch.float32)
        t_dev = _run(x, a_f, dev_off, out_dtype=torch.float32)
        assert torch.equal(t_dev, t_host)
        assert torch.equal(_run(t_dev, b_f, dev_off, out_dtype=torch.float32),
                           _run(t_host, b_f, off, out_dtype=torch.float32))


def test_weight_table_is_cached(device, monkeypatch):
    """The per-expert weight table is built once per weight set (not per call) and is the same device
    tensor afterwards, also for a new list object holding the same weights; stacked weights use
    none."""
    from zmrl.kernels_batch_invariant.triton import matmul as tmm

    builds = []
    real = tmm._build_weight_table
    monkeypatch.setattr(tmm, "_build_weight_table", lambda *a: builds.append(1) or real(*a))
    gen = torch.Generator().manual_seed(23)
    ws = [torch.randn(6, 8, generator=gen).to(device) for _ in range(3)]
    x = torch.randn(5, 8, generator=gen).to(device)
    off = torch.tensor([0, 2, 2, 5], device=device)
    y0 = _run(x, ws, off)
    _, table0, _ = tmm._expert_weight_table(ws, device)
    for _ in range(3):
        assert torch.equal(_run(x, list(ws), off), y0)
        _, table, _ = tmm._expert_weight_table(list(ws), device)
        assert table is table0
    assert len(builds) == 1
    # a different weight set (one tensor replaced) gets its own table
    ws2 = [ws[0], ws[1].clone(), ws[2]]
    _run(x, ws2, off)
    assert len(builds) == 2
    base, table, _ = tmm._expert_weight_table(torch.stack(ws), device)
    assert table is None and base.dim() == 3
    # mismatched expert shapes are still rejected (checked when the table is built)
    with pytest.raises(ValueError):
        _run(x, [ws[0], ws[1][:, :5].contiguous(), ws[2]], off)


def test_device_offsets_grads(device):
    """Autograd through device offsets: the backward reads them back (training is not captured) and
    gives exactly the host-offsets gradients."""
    gen = torch.Generator().manual_seed(24)
    off = [0, 3, 3, 8, 10]
    x0 = torch.randn(10, 24, generator=gen).to(device)
    ws0 = [torch.randn(16, 24, generator=gen).to(device) for _ in range(4)]
    gy = torch.randn(10, 16, generator=gen).to(device)
    for stacked in (False, True):
        grads = []
        for offsets in (off, torch.tensor(off, device=device)):
            x = x0.clone().requires_grad_(True)
            ws = torch.stack(ws0).requires_grad_(True) if stacked else [w.clone().requires_grad_(True) for w in ws0]
            y = _run(x, ws, offsets)
            (y * gy).sum().backward()
            wg = [ws.grad] if stacked else [w.grad for w in ws]
            grads.append((y.detach(), x.grad, *wg))
        for a, b in zip(*grads):
            # an expert without rows gets no gradient (None) on both paths
            assert (a is None and b is None) or torch.equal(a, b)


def test_device_offsets_errors_and_clamping(device):
    gen = torch.Generator().manual_seed(25)
    ws = [torch.randn(6, 8, generator=gen).to(device) for _ in range(3)]
    x = torch.randn(10, 8, generator=gen).to(device)
    with pytest.raises(ValueError):
        _run(x, ws, torch.tensor([0, 5, 10], device=device))  # E+1 offsets needed
    with pytest.raises(ValueError):
        _run(x, ws, torch.tensor([0.0, 5.0, 5.0, 10.0], device=device))  # not integers
    assert _run(x[:0], ws, torch.zeros(4, dtype=torch.int32, device=device)).shape == (0, 6)
    # Device offsets are not validated on the host (that would sync); the kernel clamps them into
    # [0, M], so offsets past M act like M and never touch memory outside x / y.
    got = _run(x, ws, torch.tensor([0, 5, 100, 1000], device=device))
    want = _run(x, ws, [0, 5, 10, 10])
    assert torch.equal(got, want)


def test_expert_linear_cuda_graph_replay(device, interpret):
    """Capture ``expert_linear`` with device offsets once, then replay with new rows AND new routing
    (offsets copied into the captured offsets tensor): every replay equals the eager call bitwise.
    The eager call with device offsets does not synchronise."""
    if interpret or device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    gen = torch.Generator().manual_seed(26)
    E, N, K, M = 64, 256, 2048, 64  # bench experts; 8 tokens x top-8 = 64 routed rows
    ws = [(torch.randn(N, K, generator=gen) / K**0.5).to(device, torch.bfloat16) for _ in range(E)]
    lora_a = torch.randn(E, 8, K, generator=gen).to(device)  # fp32 stacked factors (expert LoRA)

    def routing(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        if seed % 3 == 0:  # one expert receives every row
            counts = [0] * E
            counts[seed % E] = M
        else:
            picks = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(M // 8)]).flatten()
            counts = torch.bincount(picks, minlength=E).tolist()
        return torch.tensor(_offsets(counts), dtype=torch.int32, device=device)

    def call(x: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _run(x, ws, offs), _run(x, lora_a, offs, out_dtype=torch.float32)

    static_x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
    static_offs = routing(1)
    call(static_x, static_offs)  # compile + cache the weight table before anything is captured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = call(static_x, static_offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(eager, (_run(static_x, ws, static_offs.tolist()),
                                 _run(static_x, lora_a, static_offs.tolist(), out_dtype=torch.float32))):
        assert torch.equal(got, want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(static_x, static_offs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call(static_x, static_offs)
    for seed in (2, 3, 4, 6):
        x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
        offs = routing(seed)
        static_x.copy_(x)
        static_offs.copy_(offs)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(static_out, call(x, offs)):
            assert torch.equal(got, want), seed
