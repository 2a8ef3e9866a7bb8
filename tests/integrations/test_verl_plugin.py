"""zmrl.integrations.verl without Ray: registration, the engine's log-probs in verl's layout against the
rollout engine's recorded ones (bitwise), the server's generate/update path and the misconfiguration
errors. The end-to-end run through verl's own trainer is test_verl_main_ppo.py."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

import zmrl  # noqa: F401 -- before verl: zmrl sets MKL's reproducible mode, which MKL reads at its first GEMM

pytest.importorskip("verl")
pytest.importorskip("ray")

from zmrl.integrations.verl import register  # noqa: E402
from zmrl.integrations.verl.hf import prepare_checkpoint  # noqa: E402
from zmrl.integrations.verl.settings import ModelSettings, RolloutSettings, ZmrlSettingError  # noqa: E402
from zmrl.kernels_batch_invariant import NumericsError, current_numerics, fingerprint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from zmrl.model import build_model, save_pretrained
    from zmrl.rl.bootstrap import tiny_byte_config
    from zmrl.rl.tokenizer import write_byte_tokenizer_marker

    path = tmp_path_factory.mktemp("tiny")
    save_pretrained(build_model(tiny_byte_config(512), seed=0, dtype="float32"), path)
    write_byte_tokenizer_marker(path)
    return prepare_checkpoint(path)


def _model_config(path, **override):
    return SimpleNamespace(local_path=str(path), path=str(path), lora_rank=0, lora_alpha=16, override_config=override,
                           tokenizer=SimpleNamespace(eos_token_id=257), generation_config=None)


def _rollout_config(**engine_kwargs):
    return SimpleNamespace(engine_kwargs={"zmrl": {"seed": 0, "num_blocks": 16, **engine_kwargs}}, prompt_length=32,
                           response_length=8)


def test_registered_with_verl():
    register()
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from zmrl.integrations.verl.engine import ZmrlEngine
    from zmrl.integrations.verl.rollout import ZmrlReplica, ZmrlRolloutAdapter

    assert EngineRegistry._engines["language_model"]["zmrl"]["cpu"] is ZmrlEngine
    assert get_rollout_replica_class("zmrl") is ZmrlReplica
    assert get_rollout_class("zmrl", "async") is ZmrlRolloutAdapter


def test_checkpoint_readable_by_verl_model_config(checkpoint):
    register()
    from transformers import AutoConfig, AutoTokenizer

    from zmrl.rl.tokenizer import ByteTokenizer

    cfg = AutoConfig.from_pretrained(str(checkpoint), local_files_only=True)
    assert cfg.architectures == ["ZmrlForCausalLM"] and cfg.vocab_size == 512
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["ZmrlForCausalLM"]
    tok, byte = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True), ByteTokenizer()
    for q in ("What is 7 * 8?", "  héllo\twörld ∑  "):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == byte.encode(byte.apply_chat_template(q), add_bos=True)
    sample = [*b"x = 5 ", 300, 257, *"é".encode()]
    assert tok.decode(sample, skip_special_tokens=True) == byte.decode(sample)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 257, 258, 512)


def test_settings_errors_name_the_setting(checkpoint):
    with pytest.raises(ZmrlSettingError, match=r"override_config\.zmrl_kernel_mode='exact'"):
        ModelSettings.from_model_config(_model_config(checkpoint, zmrl_kernel_mode="exact"))
    model = ModelSettings.from_model_config(_model_config(checkpoint))
    assert model.lora.r == 32 and model.kernel_mode == "bitwise"
    with pytest.raises(ZmrlSettingError, match=r"engine_kwargs\.zmrl\.block_sise"):
        RolloutSettings.from_rollout_config(_rollout_config(block_sise=16), model)
    with pytest.raises(ZmrlSettingError, match=r"engine_kwargs\.zmrl.*num_blocks"):
        RolloutSettings.from_rollout_config(_rollout_config(num_blocks=0), model)
    with pytest.raises(ZmrlSettingError, match=r"engine_kwargs\.zmrl.*decode_graph_batch_sizes.*got 16"):
        RolloutSettings.from_rollout_config(_rollout_config(decode_graph_batch_sizes=16), model)
    from omegaconf import OmegaConf  # verl hands its settings over as OmegaConf containers

    sizes = OmegaConf.create({"s": [1, 2, 8]}).s
    engine = RolloutSettings.from_rollout_config(_rollout_config(decode_graph_batch_sizes=sizes), model).engine
    assert engine.decode_graph_batch_sizes == (1, 2, 8)


def test_unloadable_model_path_names_the_setting(tmp_path):
    from zmrl.integrations.verl.engine import ZmrlEngine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "hidden_size": "wide"}))
    with pytest.raises(ZmrlSettingError, match=r"^actor_rollout_ref\.model\.path=.*zmrl cannot load it"):
        ZmrlEngine(_model_config(tmp_path), SimpleNamespace(), SimpleNamespace(lr=1e-4), None)


def _verl_batch(sequences: list[list[int]], prompt_lens: list[int], temperature: float):
    from verl.utils import tensordict_utils as tu

    nested = lambda rows: torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)
    return tu.get_tensordict(
        {"input_ids": nested(sequences), "prompts": nested([s[:p] for s, p in zip(sequences, prompt_lens)]),
         "responses": nested([s[p:] for s, p in zip(sequences, prompt_lens)]),
         "loss_mask": nested([[0] * p + [1] * (len(s) - p) for s, p in zip(sequences, prompt_lens)])},
        {"temperature": temperature, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 3,
         "calculate_entropy": True})


def test_engine_logprobs_in_verl_layout_equal_the_servers_recorded_ones(checkpoint):
    """verl's old-log-prob pass through ZmrlEngine vs the log-probs ZmrlServer returned for the same
    tokens: bitwise, token by token (what training/rollout_probs_diff_max = 0 means)."""
    register()
    from zmrl.integrations.verl.engine import PEFT_MARKER, ZmrlEngine
    from zmrl.integrations.verl.rollout import ZmrlServer

    engine = ZmrlEngine(_model_config(checkpoint), SimpleNamespace(), SimpleNamespace(lr=1e-2, clip_grad=1.0), None)
    engine.initialize()
    with torch.no_grad():  # a non-zero adapter, so that the weight sync matters
        for p in engine.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    server = ZmrlServer(_rollout_config(), _model_config(checkpoint))
    weights, peft = engine.get_per_tensor_param()
    assert peft[PEFT_MARKER]["numerics"] == fingerprint()
    server.update_weights(dict(weights), peft[PEFT_MARKER]["numerics"], global_steps=0)

    prompts = [[256, *b"What is 2 + 3?\n"], [256, *b"Hi"], [256, *b"What is 2 + 3?\n"]]

    async def ask():
        return await asyncio.gather(*[server.generate(p, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, f"q{i}")
                                      for i, p in enumerate(prompts)])

    outs = asyncio.run(ask())
    assert all(len(o.token_ids) == len(o.log_probs) > 0 for o in outs)
    assert outs[0].token_ids != outs[2].token_ids  # same prompt, two samples of one group: different noise
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    data = _verl_batch(seqs, [len(p) for p in prompts], 1.0)
    out = engine.infer_batch(data)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        lp = out["model_output"]["log_probs"][i]
        assert lp.shape[0] == len(seqs[i])
        # position t holds log p(token t+1): the response's log-probs are positions p-1 .. L-2
        assert torch.equal(lp[len(p) - 1:-1], torch.tensor(o.log_probs, dtype=torch.float32)), i
        assert torch.isfinite(out["model_output"]["entropy"][i]).all()


def test_server_samples_every_group_as_the_zmrl_loop_does(checkpoint, tmp_path):
    """One seed rule on both sides: verl's one-sample requests to the server, arriving interleaved, and the
    zmrl loop's n-sample requests (RLRunner), with the same seed, weights and prompts, sample the same
    tokens and log-probs, sample by sample -- a prompt that comes twice in the step included."""
    from zmrl.integrations.verl.data import problems_for
    from zmrl.integrations.verl.rollout import ZmrlServer

    from tests.integrations.zmrl_loop import groups_of, loop_runner

    n, max_tokens = 3, 8
    first, second = problems_for("synthetic", 2)
    runner = loop_runner(checkpoint, [first, second, first], tmp_path, prompts_per_step=3, n=n, max_tokens=max_tokens)
    try:
        gen = torch.Generator().manual_seed(0)  # a non-zero adapter (B starts at zero): the draws depend on it
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen)
                 for k, v in sorted(runner.trainer.lora_state().result().items())}
        runner.trainer.load_lora_state(state)
        runner._push_weights()
        loop = groups_of(runner.rollout_step(0).samples)  # step 0: the weights after 0 updates
    finally:
        runner.close()
    assert [len(g) for g in loop.values()] == [2 * n, n]

    rollout_config = SimpleNamespace(engine_kwargs={"zmrl": {"seed": 0, "num_blocks": 64}}, prompt_length=128,
                                     response_length=max_tokens)
    server = ZmrlServer(rollout_config, _model_config(checkpoint))
    server.update_weights(state, fingerprint(), global_steps=0)  # verl's sync before its first step
    # one request per sample, the prompts interleaved: a, b, a, b, a, b, a, a, a
    order = [p for k in range(2 * n) for p, g in loop.items() if k < len(g)]

    async def ask():
        return await asyncio.gather(*[server.generate(list(p), {"temperature": 1.0, "top_p": 1.0, "top_k": -1},
                                                      f"q{i}") for i, p in enumerate(order)])

    served: dict[tuple[int, ...], list] = {}
    for p, out in zip(order, asyncio.run(ask())):  # a prompt's k-th request is its sample k
        served.setdefault(p, []).append(out)
    assert served.keys() == loop.keys()
    for prompt, samples in loop.items():
        assert len({tuple(s.response_ids) for s in samples}) > 1, "a group's samples must differ"
        for k, (s, out) in enumerate(zip(samples, served[prompt], strict=True)):
            assert out.token_ids == s.response_ids, (prompt, k)
            assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float32), s.logprobs.cpu()), (prompt, k)


def test_engine_checkpoint_round_trip(checkpoint, tmp_path):
    from zmrl.integrations.verl.engine import ZmrlEngine
    from zmrl.lora import lora_state_dict

    engine = ZmrlEngine(_model_config(checkpoint), SimpleNamespace(), SimpleNamespace(lr=1e-2), None)
    engine.initialize()
    saved = {k: v.clone() for k, v in lora_state_dict(engine.model).items()}
    engine.save_checkpoint(str(tmp_path), global_step=3)
    with torch.no_grad():
        for p in engine.model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    engine.load_checkpoint(str(tmp_path))
    assert all(torch.equal(v, saved[k]) for k, v in lora_state_dict(engine.model).items())


def test_weights_from_other_numerics_or_engine_are_refused(checkpoint, monkeypatch):
    register()
    from zmrl.integrations.verl.engine import ZmrlEngine
    from zmrl.integrations.verl.rollout import ZmrlRolloutAdapter, ZmrlServer

    server = ZmrlServer(_rollout_config(kernel_mode="fast"), _model_config(checkpoint))
    try:
        with pytest.raises(NumericsError, match=r"kernel_mode is 'bitwise' in the trainer.*'fast' in the rollout server"
                                                r".*zmrl_kernel_mode"):
            server.update_weights({}, fingerprint(current_numerics().replace(kernel_mode="bitwise")))
    finally:
        from zmrl.kernels_batch_invariant import apply_numerics

        apply_numerics(current_numerics().replace(kernel_mode="bitwise"))  # the fast engine applied its mode
    with pytest.raises(ZmrlSettingError, match="received a request before any weights"):
        asyncio.run(ZmrlServer(_rollout_config(), _model_config(checkpoint)).generate([256, 1], {}, "r"))

    from verl.workers.config import RolloutConfig

    rollout_config = RolloutConfig(name="zmrl", tensor_model_parallel_size=1)
    monkeypatch.setattr(ZmrlEngine, "instances_in_process", 0)
    with pytest.raises(ZmrlSettingError, match=r"rollout\.name=zmrl needs actor_rollout_ref\.actor\.strategy=zmrl"):
        ZmrlRolloutAdapter(rollout_config, _model_config(checkpoint), None)
    monkeypatch.setattr(ZmrlEngine, "instances_in_process", 1)
    adapter = ZmrlRolloutAdapter(rollout_config, _model_config(checkpoint), None)
    with pytest.raises(ZmrlSettingError, match=r"needs actor_rollout_ref\.actor\.strategy=zmrl"):
        asyncio.run(adapter.update_weights(iter([("w", torch.zeros(1))]), peft_config=None))


def test_save_pretrained_writes_architectures(tmp_path):
    from zmrl.model import build_model, load_pretrained, save_pretrained
    from zmrl.model.checkpoint import ZMRL_ARCHITECTURE
    from zmrl.rl.bootstrap import tiny_byte_config

    model = build_model(tiny_byte_config(512), seed=0, dtype="float32")
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [ZMRL_ARCHITECTURE]
    assert load_pretrained(tmp_path).config == model.config  # zmrl reads its own file back unchanged


def _verl_step(step: int, k1: float = 0.0, k3: float = 0.0, valid: int = 1) -> str:
    data = {"critic/score/mean": 0.25 * step, "critic/score/max": 1.0, "actor/pg_loss": -0.1, "response_length/mean": 12.0,
            "prompt_length/mean": 36.0, "perf/total_num_tokens": 16 * 48, "perf/throughput": 50.0,
            "rollout_corr/kl": k1, "rollout_corr/k3_kl": k3, "training/rollout_probs_diff_valid": valid,
            "training/rollout_probs_diff_max": 0.0 if k1 == k3 == 0 else 1e-3, "timing_s/gen": 3.0,
            "val-core/zmrl/reward/mean@1": 0.5}
    return json.dumps({"step": step, "data": data})


def _badge(page: str) -> dict:
    import re

    m = re.search(r'<div class="badge [a-z]+" id="kl-badge" data-status="(\w+)"(?: data-first-step="(\d+)")?', page)
    assert m, "no parity badge"
    return {"status": m[1], "first_step": m[2]}


def test_dashboard_of_verl_metrics(tmp_path):
    from zmrl.integrations.verl.dashboard import build_verl_dashboard, read_verl_metrics

    ok = tmp_path / "ok.jsonl"
    ok.write_text("\n".join(_verl_step(s) for s in (1, 2, 3)) + "\n")
    rec = read_verl_metrics(ok)[0]
    assert rec["reward/mean"] == 0.25 and rec["mismatch/kl_k3"] == 0.0 and rec["eval/zmrl_mean@1"] == 0.5
    assert (rec["mismatch/sequences_compared"], rec["mismatch/tokens_compared"]) == (16.0, 192.0)
    assert "timing_s/gen" not in rec  # only the mapped and the listed verl metrics are drawn
    page = build_verl_dashboard(ok).read_text()
    assert _badge(page)["status"] == "ok"
    assert 'data-metric="reward/mean"' in page and 'data-metric="training/rollout_probs_diff_max"' in page

    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([_verl_step(1), _verl_step(2, k1=1e-6, k3=2e-7), _verl_step(3)]) + "\n")
    assert _badge(build_verl_dashboard(bad).read_text()) == {"status": "mismatch", "first_step": "2"}
    unchecked = tmp_path / "unchecked.jsonl"
    unchecked.write_text("\n".join([_verl_step(1), _verl_step(2, valid=0)]) + "\n")
    assert _badge(build_verl_dashboard(unchecked).read_text()) == {"status": "unchecked", "first_step": "2"}
