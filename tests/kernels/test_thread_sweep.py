"""Every op of zmrl.kernels_batch_invariant (torch backend) at 1, 2 and 4 torch threads, on shapes wide
enough that stock kernels split a row's reduction across threads (K = 4096 GEMMs with few rows, vocab
65536 log-softmax, 16384-wide norms): the bits must not change. The per-op test files sweep the same
thread counts with batch and position changes; this file is the one place that lists every op."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from zmrl.kernels_batch_invariant import (bmm_fixed, grouped_linear, linear, linear_blockdiag, linear_concat, tree_mean,
                                         tree_sum)
from zmrl.kernels_batch_invariant.fp8 import dequantize_fp8, quantize_fp8
from zmrl.kernels_batch_invariant.glu import situ_glu, swiglu
from zmrl.kernels_batch_invariant.hadamard import hadamard_rotate
from zmrl.kernels_batch_invariant.kda_gate import kda_gate
from zmrl.kernels_batch_invariant.l2norm import l2_norm
from zmrl.kernels_batch_invariant.logprob import log_softmax, token_logprobs
from zmrl.kernels_batch_invariant.moe_gemm import ExpertLoraFactors, RowGather, expert_gate_up, expert_linear
from zmrl.kernels_batch_invariant.moe_router import moe_combine, moe_combine_rows, moe_route, moe_sort
from zmrl.kernels_batch_invariant.norms import add_rms_norm, layer_norm, rms_norm, rms_norm_gated
from zmrl.kernels_batch_invariant.pointwise import add_cast, relu, sigmoid, sigmoid_op, silu, softplus
from zmrl.kernels_batch_invariant.short_conv import causal_short_conv
from zmrl.rollout.sampling import sample_scaled

from .invariance import THREAD_COUNTS, num_threads

_g = torch.Generator().manual_seed(0)


def _r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_g).to(dtype)


W4096 = _r(512, 4096)
BF = torch.bfloat16
# name -> (op, inputs). Ops covered elsewhere at 1, 2 and 4 threads with their own paged/packed inputs:
# mla_attention(_dense) and dsa_index_scores/dsa_topk (test_mla_attention.py, test_dsa_indexer.py),
# kda_chunk(_step) (test_kda.py, test_kda_chunk_step.py), and all of them in tests/bitwise/test_thread_count.py.
CASES: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "linear 1 row fp32": (linear, (_r(1, 4096), W4096)),
    "linear 1 row bf16": (linear, (_r(1, 4096, dtype=BF), W4096.to(BF))),
    "linear 33 rows + bias": (linear, (_r(33, 4096), W4096, _r(512))),
    "linear K=1000 N=100": (linear, (_r(1, 1000), _r(100, 1000))),
    "linear_concat": (linear_concat, (_r(1, 4096, dtype=BF), [W4096.to(BF), _r(96, 4096, dtype=BF)])),
    "linear_blockdiag": (linear_blockdiag, (_r(1, 96), [_r(4096, 32), _r(512, 32), _r(2048, 32)])),  # LoRA B factors
    "grouped_linear": (grouped_linear, (_r(2, 3, 4096), _r(2, 256, 4096))),
    "bmm_fixed": (bmm_fixed, (_r(2, 16, 4096), _r(2, 4096, 64))),
    "expert_linear": (expert_linear, (_r(5, 4096), _r(2, 256, 4096), [0, 2, 5])),
    # 3 tokens x 2 slots gathered into 2 experts' rows, LoRA on gate
    "expert_gate_up": (expert_gate_up, (_r(3, 4096), _r(2, 256, 4096), _r(2, 256, 4096), [0, 2, 6],
                                        ExpertLoraFactors(_r(2, 8, 4096), _r(2, 256, 8), 2.0), None,
                                        RowGather(torch.tensor([5, 0, 3, 1, 4, 2]), 2))),
    "token_logprobs": (token_logprobs, (_r(2, 65536), torch.tensor([3, 60000]), 0.7)),
    "log_softmax": (log_softmax, (_r(1, 65536),)),
    "sample_scaled": (sample_scaled, (_r(2, 65536), torch.tensor([11, -5]), torch.tensor([65536, 40]),
                                      torch.tensor([1.0, 0.9]))),
    "rms_norm": (rms_norm, (_r(2, 16384), _r(16384), 1e-6)),
    "add_rms_norm": (add_rms_norm, (_r(2, 16384, dtype=BF), _r(2, 16384, dtype=BF), _r(16384), 1e-6)),
    "layer_norm": (layer_norm, (_r(2, 16384), _r(16384), _r(16384), 1e-5)),
    "rms_norm_gated": (rms_norm_gated, (_r(2, 16384), _r(2, 16384), _r(16384), 1e-6)),
    "l2_norm": (l2_norm, (_r(2, 16384),)),
    "tree_sum": (tree_sum, (_r(1, 100_000),)),
    "tree_mean": (tree_mean, (_r(1, 100_000),)),
    "swiglu": (swiglu, (_r(1, 100_000), _r(1, 100_000))),
    "situ_glu": (situ_glu, (_r(1, 100_000), _r(1, 100_000))),
    "sigmoid": (sigmoid, (_r(100_000),)),
    "silu": (silu, (_r(100_000),)),
    "softplus": (softplus, (_r(100_000),)),
    "relu": (relu, (_r(100_000),)),
    "sigmoid_op": (sigmoid_op, (_r(100_000),)),
    "add_cast": (add_cast, (_r(100_000), _r(100_000, dtype=BF), BF)),
    "hadamard_rotate": (hadamard_rotate, (_r(3, 4096),)),
    "quantize_fp8": (quantize_fp8, (_r(2, 16384),)),
    "dequantize_fp8": (lambda x: dequantize_fp8(*quantize_fp8(x)), (_r(2, 16384),)),
    "kda_gate": (kda_gate, (_r(3, 4096), _r(16), _r(4096), 16)),
    "moe_route": (moe_route, (_r(3, 4096), _r(64, 4096), _r(64), 6, 8, 4, True, 2.5)),
    "moe_combine": (moe_combine, (_r(3, 8, 4096), _r(3, 8))),
    # the expert-sorted rows of 3 tokens x 8 slots, slot (t, j) at row slot_rows[t, j] (a permutation)
    "moe_combine_rows": (moe_combine_rows, (_r(24, 4096), torch.randperm(24, generator=torch.Generator().manual_seed(0))
                                            .view(3, 8), _r(3, 8))),
    # 4096 tokens x 8 slots over 64 experts: a sort long enough to run threaded
    "moe_sort": (moe_sort, (torch.randint(0, 64, (4096, 8), generator=torch.Generator().manual_seed(0)), 64)),
    "causal_short_conv": (causal_short_conv, (_r(100, 4096), _r(4096, 4), torch.tensor([0, 37, 100]))),
}


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [getattr(out, f) for f in out.__dataclass_fields__]  # RouterOutput, ExpertOrder


@pytest.mark.parametrize("name", list(CASES))
def test_same_bits_at_every_thread_count(name: str) -> None:
    op, args = CASES[name]
    with num_threads(1):
        ref = _flat(op(*args))
    for threads in THREAD_COUNTS[1:]:
        with num_threads(threads):
            got = _flat(op(*args))
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"{name}: {threads} threads differ from 1"


# Ops whose thread sweep lives with their paged/packed inputs (named in the comment above CASES).
SWEPT_ELSEWHERE = {"mla_attention", "mla_attention_dense", "dsa_index_scores", "dsa_topk", "kda_chunk", "kda_chunk_step",
                   "kda_decode_step", "kda_decode_prime",  # these two: tests/kernels/test_kda_decode_step.py
                   "causal_short_conv_pooled",  # tests/kernels/test_short_conv.py (its pool is updated in place)
                   "write_cache_rows"}  # stores bytes, no arithmetic (tests/kernels/triton/test_cache_write.py)


def test_every_op_is_swept() -> None:
    """A new op of the package (or the sampler) must be added to CASES or SWEPT_ELSEWHERE."""
    import importlib
    import pkgutil

    import zmrl.kernels_batch_invariant as kbi
    from zmrl.kernels_batch_invariant import InvariantOp
    from zmrl.rollout import sampling

    modules = [importlib.import_module(m.name) for m in pkgutil.walk_packages(kbi.__path__, kbi.__name__ + ".")
               if ".triton" not in m.name]
    ops = {v.name for m in [*modules, sampling] for v in vars(m).values() if isinstance(v, InvariantOp)}
    swept = {getattr(op, "name", getattr(op, "__name__", "")) for op, _ in CASES.values()} | SWEPT_ELSEWHERE
    assert len(ops) >= 20 and not ops - swept, f"ops without a thread sweep: {sorted(ops - swept)}"
