"""zmrl's DSA indexer (paged FP8 scores + exact top-k, and the model's ``Indexer``) against fla-core's
pure-torch reference ``fla.ops.dsa.naive.naive_dsa_indexer`` (an independent implementation of
DeepSeek-V3.2's lightning indexer: ``I[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s])`` over s <= t, top-k).

Both sides select the top-k of the same scores, but break exact ties differently (zmrl: lower position
first, the bitwise contract's rule; fla: ``torch.topk``, order unspecified). So a row's two sets may
differ only inside the group of positions whose score equals the k-th best, and zmrl must hold the
lowest positions of that group. The tests count such rows.

* ``test_kernel_on_exact_scores``: query/key values on a coarse grid (multiples of 1/4 up to 2) and
  weights multiples of 1/8, so every product and sum is exact in fp32 on both sides: the scores are
  equal, ties are exact (and frequent: integer-valued dots), and the sets must agree outside them.
* ``test_model_indexer_v32``: the model's ``Indexer`` of a DeepSeek-V3.2 config (split-half rope on the
  first ``qk_rope_head_dim`` dims, Hadamard rotation, FP8 queries and keys with one scale per 128
  values), random weights; fla gets the dequantised rotated queries and keys and the weights times the
  query scales (``ReLU(s_q·s_k·q8·k8) = s_q·s_k·ReLU(q8·k8)``, scales > 0). The two sides round the
  score sums in different orders, which could in principle reorder two keys a rounding step apart; with
  these inputs every differing row is an exact tie (keys whose dots are negative for every head score
  exactly 0), so the test holds both sides to the exact-tie rule on float64 scores of the same inputs.
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.dsa_indexer import dsa_index_scores, dsa_topk
from zmrl.model import ModelConfig, cu_seqlens_from_lens
from zmrl.model.context import packed_context
from zmrl.model.mla import MLAAttention

from .fla_reference import load_fla_naive


@pytest.fixture(scope="module")
def naive():
    return load_fla_naive("dsa", "naive_dsa_indexer")


LENS = [7, 90, 150]


def _paged_keys(lens: list[int], k: torch.Tensor, k_scale: torch.Tensor):
    ctx = packed_context(cu_seqlens_from_lens(lens))
    latent = torch.zeros(k.shape[0], 1)
    _, k_cache, ks_cache = ctx.store.write(0, ctx.slot_mapping, latent, k, k_scale)
    return ctx, k_cache, ks_cache


def _compare(mine: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, topk: int,
             near: float = 0.0) -> tuple[int, int]:
    """(rows with more candidates than topk, rows whose boundary is tied); asserts the rule above.
    ``scores`` [T, L] (float64 or exact), ``near``: relative width of a near-tie."""
    rows = ties = 0
    for t in range(mine.shape[0]):
        p = int(positions[t])
        a = set(mine[t][mine[t] >= 0].tolist())
        b = set(theirs[t][theirs[t] >= 0].tolist())
        if p + 1 <= topk:
            assert a == b == set(range(p + 1)), f"row {t}: with {p + 1} candidates all are selected"
            continue
        rows += 1
        row = scores[t, : p + 1].double()
        kth = row.sort(descending=True).values[topk - 1]
        group = {int(s) for s in ((row - kth).abs() <= near * kth.abs()).nonzero().flatten()}
        if a == b:
            continue
        ties += 1
        assert len(group) > 1 and a ^ b <= group, (
            f"row {t}: sets differ outside the tie group: only zmrl {sorted(a - b)}, only fla {sorted(b - a)}")
        if near == 0.0:  # exact scores: zmrl keeps the lowest positions of the tie group
            above = {s for s in range(p + 1) if row[s] > kth}
            assert a - above == set(sorted(group)[: topk - len(above)]), f"row {t}: tie rule (position asc)"
    return rows, ties


@pytest.mark.parametrize("quantized", [True, False])
def test_kernel_on_exact_scores(naive, quantized: bool) -> None:
    g = torch.Generator().manual_seed(0)
    hi, di, topk = 4, 32, 24
    total = sum(LENS)
    grid = lambda *shape: torch.randint(-8, 9, shape, generator=g).float() / 4  # noqa: E731
    q, k = grid(total, hi, di), grid(total, di)
    w = torch.randint(-8, 9, (total, hi), generator=g).float() / 8
    if quantized:  # grid values are exact in e4m3; scale 1
        q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
        assert torch.equal(q8.float(), q) and torch.equal(k8.float(), k)
    else:  # index_quant "none": model-dtype values
        q8, k8 = q, k
    ctx, k_cache, ks_cache = _paged_keys(LENS, k8, torch.ones(total))
    scores = dsa_index_scores(q8, torch.ones(total, hi), w, k_cache, ks_cache, ctx.block_table, ctx.seq_idx,
                              ctx.positions)
    mine = dsa_topk(scores, ctx.positions, topk)
    cu = cu_seqlens_from_lens(LENS)
    theirs = naive.naive_dsa_indexer(q[None], k[None], w[None], topk=topk, scale=1.0, activation="relu",
                                     cu_seqlens=cu)[0]
    rows, ties = _compare(mine, theirs, scores, ctx.positions, topk)
    assert rows > 150 and ties > 0, f"{rows} rows, {ties} tied: the grid should produce exact ties"
    print(f"exact scores ({'fp8' if quantized else 'fp32'}): {rows} rows past top-{topk}, {ties} with differing "
          "tie picks")


def test_model_indexer_v32(naive) -> None:
    cfg = ModelConfig.from_dict(_v32_config())
    assert cfg.index_use_hadamard and cfg.index_quant == "fp8" and cfg.rope_interleave and not cfg.index_rope_interleave
    attn = MLAAttention(cfg, 0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ix = attn.indexer
    total = sum(LENS)
    x = torch.randn(total, cfg.hidden_size, generator=g)
    q_latent = torch.randn(total, cfg.q_lora_rank, generator=g)
    ctx = packed_context(cu_seqlens_from_lens(LENS))
    with torch.no_grad():
        k8, ks = ix.keys(x, ctx.positions, attn.rope)
        _, k_cache, ks_cache = ctx.store.write(0, ctx.slot_mapping, torch.zeros(total, 1), k8, ks.squeeze(-1))
        mine = ix.select(x, q_latent, k_cache, ks_cache, ctx, attn.rope)
        # the same rotated, quantised queries and the weights the Indexer scores with
        q = ix.wq_b(q_latent, out_dtype=torch.float32).view(total, ix.n_heads, ix.head_dim)
        q8, qs = ix._quantize(ix._prepare(q, ctx.positions, attn.rope), x.dtype)
        w = ix.weights_proj(x, out_dtype=torch.float32) * (ix.n_heads ** -0.5 * ix.head_dim ** -0.5)
    q_deq, k_deq = q8.double() * qs.double(), k8.double() * ks.double()
    theirs = naive.naive_dsa_indexer(q_deq[None], k_deq[None], w.double()[None], topk=cfg.index_topk, scale=1.0,
                                     activation="relu", cu_seqlens=cu_seqlens_from_lens(LENS))[0]
    # float64 scores of the same inputs, for classifying near-ties
    scores = torch.full((total, max(LENS)), float("-inf"), dtype=torch.float64)
    for b, n in zip(cu_seqlens_from_lens(LENS)[:-1].tolist(), LENS):
        dots = torch.einsum("thd,sd->ths", q_deq[b:b + n], k_deq[b:b + n]).clamp_min(0)
        scores[b:b + n, :n] = torch.einsum("ths,th->ts", dots, w[b:b + n].double())
    rows, ties = _compare(mine, theirs, scores, ctx.positions, cfg.index_topk, near=0.0)
    assert rows > 150
    print(f"DeepSeek-V3.2 indexer: {rows} rows past top-{cfg.index_topk}, {ties} differing at an exact tie")


def _v32_config() -> dict:
    return {
        "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32,
        "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "index_topk": 32,
        "index_n_heads": 4, "index_head_dim": 32, "max_position_embeddings": 256, "rope_theta": 10000.0,
    }
