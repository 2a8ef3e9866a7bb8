"""The bitwise contract on real checkpoint layouts: for a checkpoint of each supported ``model_type``
(built as in its reference test: transformers' own tiny models for deepseek_v3 and glm_moe_dsa, V3 +
indexer tensors for deepseek_v32, the published names for kimi_linear), the rollout engine generates
(chunked prefill, staggered arrivals, greedy and sampled requests, prompts longer than index_topk and than
a KDA chunk) and the trainer's log-prob of every generated token is ``torch.equal`` to the engine's, with
the eager and the fixed-shape ("static", the CUDA-graph code path without capture) decode, in fp32 and in
bf16 (the dtype real checkpoints ship in). ``ZMRL_TEST_DEVICE=cuda`` runs it on the GPU (Triton kernels, and
CUDA-graph decode too)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from zmrl.model import load_pretrained
from zmrl.parity.audit import _drive
from zmrl.parity.metric import compare_logprobs
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import compute_logprobs

from ..device import ON_CUDA, TEST_DEVICE

transformers = pytest.importorskip("transformers")

CHECKPOINTS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_linear")
PROMPT_LENS = (3, 30, 70, 110)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v3":
        from .test_hf_deepseek_v3 import _hf_model
        _hf_model(q_lora_rank=32, n_group=2, topk_group=1, num_experts_per_tok=2).save_pretrained(path)
    elif request.param == "deepseek_v32":
        from .test_hf_deepseek_v32 import write_v32_checkpoint
        write_v32_checkpoint(path)
    elif request.param == "glm_moe_dsa":
        if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
            pytest.skip("this transformers has no GlmMoeDsaForCausalLM")
        from .test_hf_glm_moe_dsa import VARIANTS, _hf_model
        _hf_model(**VARIANTS["shared_alternate"]).save_pretrained(path)
    else:
        from .test_kimi_linear_checkpoint import write_kimi_linear_checkpoint
        write_kimi_linear_checkpoint(path)
    return request.param, path


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request, checkpoint):
    model_type, path = checkpoint
    model = load_pretrained(path, dtype=request.param, device=TEST_DEVICE).eval()
    assert model.config.model_type in (model_type, "kimi_k3")
    return model


@pytest.mark.parametrize("decode_graphs", ["off", "static"] + (["cuda"] if ON_CUDA else []))
def test_engine_and_trainer_logprobs_are_bitwise_equal(loaded, decode_graphs: str) -> None:
    model = loaded
    cfg = model.config
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    params = [SamplingParams(temperature=t, max_tokens=6, seed=i) for i, t in enumerate((0.0, 0.7, 1.0, 1.0))]
    engine = RolloutEngine(copy.deepcopy(model), EngineConfig(block_size=64, num_blocks=16, max_num_batched_tokens=37,
                                                              decode_graphs=decode_graphs))
    outs = _drive(engine, prompts, params, [f"r{i}" for i in range(len(prompts))], [0, 2, 1, 3])
    assert all(o.finish_reason != "error" for o in outs), [o.error for o in outs]
    if cfg.has_indexer:
        assert max(len(o.prompt_token_ids) for o in outs) > cfg.index_topk  # the sparse selection is active
    order = list(reversed(range(len(outs))))
    with torch.enable_grad():
        lps = compute_logprobs(model, [o.prompt_token_ids + o.token_ids for o in outs],
                               [len(o.prompt_token_ids) for o in outs], [o.temperature for o in outs],
                               micro_batch_tokens=90, order=order)
    report = compare_logprobs([o.logprobs for o in outs], [lp.detach() for lp in lps])
    assert report.ok and report.tokens_compared == 6 * len(prompts), report
