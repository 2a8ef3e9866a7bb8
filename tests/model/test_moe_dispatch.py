"""MoE dispatch with device offsets (docs/cuda_graph_decode.md item 7).

On CUDA ``MoE.forward`` keeps the per-expert row offsets on the device (sort + searchsorted, no
``bincount().tolist()``) and hands them to the grouped ``expert_linear`` (and the batched expert
LoRA); on CPU it keeps the host counts. CPU tests: the device-offsets dispatch, forced on CPU tensors,
gives exactly the host path's output (with and without expert LoRA), and CPU forward still takes the
host path. GPU tests: the CUDA forward never syncs (``torch.cuda.set_sync_debug_mode("error")``),
equals the host-offsets dispatch bitwise, and a CUDA graph of ``MoE.forward`` replays on new inputs
with the eager bits.
"""
from __future__ import annotations

import types

import pytest
import torch

from zmrl.lora import LoraConfig, apply_lora
from zmrl.model import ModelConfig, build_model
from zmrl.model.moe import MoE

LORA = LoraConfig(r=4, alpha=8.0, init_b_std=0.05, init_seed=3)


def _moe(with_lora: bool, dtype: str | None = None, device: str = "cpu") -> MoE:
    kw = {} if dtype is None else {"dtype": dtype}
    model = build_model(ModelConfig.preset("tiny"), seed=0, **kw).to(device).eval()
    if with_lora:
        apply_lora(model, LORA)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert (moe.experts_lora is not None) == with_lora
    return moe


def _inputs(moe: MoE, t: int, seed: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Random tokens, and tokens that are all the same row (every token routes to the same top-k
    experts: those experts get every row, the others none)."""
    d = moe.gate.weight.shape[1]
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(t, d, generator=g)
    same = torch.randn(1, d, generator=g).expand(t, d).contiguous()
    return [v.to(device, dtype) for v in (rand, same)]


@pytest.mark.parametrize("with_lora", [False, True])
def test_device_offsets_dispatch_equals_host_on_cpu(monkeypatch, with_lora):
    moe = _moe(with_lora)
    dtype = moe.gate.weight.dtype
    for t in (1, 9):
        for x in _inputs(moe, t, seed=t, dtype=dtype, device="cpu"):
            assert not moe._device_dispatch(x)  # CPU keeps the host counts (numerics and speed unchanged)
            with torch.no_grad():
                want = moe(x)
                with monkeypatch.context() as mp:
                    mp.setattr(MoE, "_device_dispatch", lambda self, x: True)
                    got = moe(x)
            assert got.dtype == want.dtype and torch.equal(got, want), (with_lora, t)


def test_device_dispatch_only_without_overridden_routed_experts():
    """Expert parallelism overrides ``_routed_experts`` (it slices host offsets per rank): such a
    subclass keeps the host path even on CUDA."""

    class Overriding(MoE):
        def _routed_experts(self, hs, counts):  # pragma: no cover - never called here
            return super()._routed_experts(hs, counts)

    cuda_like = types.SimpleNamespace(is_cuda=True)
    assert MoE._device_dispatch(object.__new__(MoE), cuda_like)
    assert not MoE._device_dispatch(object.__new__(Overriding), cuda_like)


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("with_lora", [False, True])
def test_moe_forward_cuda_no_sync_and_graph_replay(monkeypatch, with_lora):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    moe = _moe(with_lora, dtype="bfloat16", device="cuda")
    for t in (3, 16):
        static_x, same = _inputs(moe, t, seed=100 + t, dtype=torch.bfloat16, device="cuda")
        news = _inputs(moe, t, seed=200 + t, dtype=torch.bfloat16, device="cuda") + [same]
        with torch.no_grad():
            assert moe._device_dispatch(static_x)
            ref = moe(static_x)  # warm-up: compiles the kernels, caches the expert weight tables
            torch.cuda.synchronize()
            # 1. no host sync anywhere in the CUDA forward
            torch.cuda.set_sync_debug_mode("error")
            try:
                y = moe(static_x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(y, ref)
            # 2. bitwise the host-offsets dispatch (bincount().tolist() + host offsets)
            for x in [static_x, *news]:
                with monkeypatch.context() as mp:
                    mp.setattr(MoE, "_device_dispatch", lambda self, x: False)
                    host = moe(x)
                assert torch.equal(moe(x), host), (with_lora, t)
            # 3. capture once (warm-up on a side stream, as the PyTorch docs show), replay on new inputs
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    moe(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = moe(static_x)
            for x in news:
                static_x.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                want = moe(x)
                assert torch.equal(static_y, want), (with_lora, t)
            del graph


@pytest.mark.gpu
def test_moe_backward_cuda_device_offsets_equal_host(monkeypatch):
    """Training (not captured) through device offsets: the expert GEMM backward reads them back and
    gives the host-offsets dispatch's output and LoRA gradients bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    moe = _moe(True, dtype="bfloat16", device="cuda")
    params = [p for p in moe.parameters() if p.requires_grad]
    assert params
    x = _inputs(moe, 24, seed=7, dtype=torch.bfloat16, device="cuda")[0]
    runs = []
    for device_dispatch in (True, False):
        with monkeypatch.context() as mp:
            mp.setattr(MoE, "_device_dispatch", lambda self, x, d=device_dispatch: d)
            for p in params:
                p.grad = None
            y = moe(x)
            (y.float() * torch.linspace(-1, 1, y.numel(), device="cuda").view_as(y)).sum().backward()
            runs.append((y.detach(), [p.grad.clone() for p in params]))
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_dispatch_backward_sums_each_tokens_slot_gradients(device):
    """The dispatch gather's backward (``RowGather.rows`` with the pairs' slots: ``moe_combine_rows`` with unit
    weights over the expert-sorted rows) is autograd's gather backward: with integer-valued gradients every sum is
    exact in any order, so torch.equal; bf16 rows get the fp32 sum rounded once."""
    from zmrl.kernels_batch_invariant.moe_router import moe_sort
    from zmrl.kernels_batch_invariant.moe_gemm import RowGather
    g = torch.Generator().manual_seed(11)
    t, k, e, d = 37, 3, 8, 24
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    pairs = moe_sort(ids, e)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(t, d, generator=g).to(device, dtype).requires_grad_()
        rows = RowGather(pairs.order, k, pairs.slot_rows.view(t, k)).rows(h)
        assert torch.equal(rows, h[pairs.order // k])
        gy = torch.randint(-8, 9, rows.shape, generator=g).to(device, dtype)
        (got,) = torch.autograd.grad(rows, h, gy)
        (want,) = torch.autograd.grad(h[pairs.order // k], h, gy)
        assert got.dtype == dtype and torch.equal(got, want)
