"""``zmrl convert`` (zmrl/model/convert.py): the mapping report of a tiny ``DeepseekV3ForCausalLM`` saved by
transformers (sharded, read as it is: nothing written), a Kimi K3 release checkpoint with MXFP4 experts
(converted: the copy loads to the same tensors bit for bit), and one-line errors for bad folders."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zmrl import cli
from zmrl.model import load_pretrained, save_pretrained
from zmrl.model.convert import convert_checkpoint, inspect_checkpoint, main

from .k3_utils import random_k3_model, tiny_k3

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, set[str]]:
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    path = tmp_path_factory.mktemp("dsv3")
    model.save_pretrained(path, max_shard_size="50KB")
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return path, names


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("k3")
    save_pretrained(random_k3_model(tiny_k3()), path, format="k3", max_shard_bytes=60_000)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
    (path / "tokenization_kimi.py").write_text("raise SystemExit('remote code ran')\n")
    return path


def test_transformers_deepseek_v3_is_read_as_it_is(hf_dir, tmp_path, capsys) -> None:
    path, saved = hf_dir  # the names transformers writes (per-expert gate/up/down_proj)
    assert (path / "model.safetensors.index.json").is_file()
    report = inspect_checkpoint(path)
    assert report.config_format == "hf" and report.model_type == "deepseek_v3" and len(report.weight_files) > 1
    assert {t.target for t in report.tensors} == saved and all(t.unchanged for t in report.tensors)
    assert report.changes == [] and report.dropped == {}
    fields = {f.source: f for f in report.fields}
    assert fields["n_routed_experts"].target == "n_routed_experts" and fields["n_routed_experts"].value == 4
    assert fields["architectures"].target is None  # bookkeeping
    # the CLI: report, and with --out nothing written
    out = tmp_path / "out"
    assert cli.main(["convert", str(path), "--out", str(out), "--report-json", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "config: hf format, model_type 'deepseek_v3'" in text and "nothing must change" in text
    assert "model.layers.{L}.mlp.experts.{E}.gate_proj.weight -> model.layers.{L}.mlp.experts.{E}.gate_proj.weight" \
        in text
    assert "nothing written" in text and not out.exists()
    assert json.loads((tmp_path / "r.json").read_text())["changes"] == []


def test_release_checkpoint_is_converted_exactly(release_dir, tmp_path, capsys) -> None:
    report = inspect_checkpoint(release_dir)
    assert report.config_format == "release" and report.model_type == "kimi_k3 / kimi_linear"
    kinds = {t.kind for t in report.tensors}
    assert {"mxfp4", "row", "a_log", "plain"} <= kinds
    assert any("renamed" in c for c in report.changes) and any("(mxfp4)" in c for c in report.changes)
    fields = {f.source: f.target for f in report.fields}
    assert fields["text_config.num_experts"] == "n_routed_experts"
    assert fields["text_config.linear_attn_config.kda_layers"] == "linear_attn_config.kda_layers"
    out = tmp_path / "zmrl"
    assert main([str(release_dir), "--out", str(out), "--max-shard-size", "100KB"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert not (out / "tokenization_kimi.py").exists()  # remote code is never carried along
    src, dst = load_pretrained(release_dir, dtype="float32"), load_pretrained(out, dtype="float32")
    assert src.config == dst.config
    for (k, a), (k2, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    again = inspect_checkpoint(out)
    assert again.config_format == "zmrl" and again.changes == []
    for f in out.glob("*.safetensors"):  # dequantised experts stored in the checkpoint's dtype, exactly
        with safe_open(str(f), framework="pt") as sf:
            for n in sf.keys():
                if ".experts." in n:
                    assert sf.get_slice(n).get_dtype() == "F32"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _single_file(path: Path) -> tuple[dict, Path]:
    """(state, the folder) with one model.safetensors instead of shards."""
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
        f.unlink()
    (path / "model.safetensors.index.json").unlink()
    return state, path


def test_bad_folders_stop_with_one_line(hf_dir, tmp_path, capsys) -> None:
    path, _ = hf_dir
    cases = []
    llama = _copy(path, tmp_path / "llama")
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    cases.append((llama, r"model_type' = 'llama'"))
    state, missing = _single_file(_copy(path, tmp_path / "missing"))
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, str(missing / "model.safetensors"))
    cases.append((missing, r"missing tensors \['model.norm.weight'\]"))
    state, extra = _single_file(_copy(path, tmp_path / "extra"))
    save_file({**state, "model.bonus.weight": torch.zeros(2)}, str(extra / "model.safetensors"))
    cases.append((extra, r"unexpected tensors \['model.bonus.weight'\]"))
    state, shaped = _single_file(_copy(path, tmp_path / "shaped"))
    save_file({**state, "model.norm.weight": torch.zeros(63)}, str(shaped / "model.safetensors"))
    cases.append((shaped, r"mis-shaped tensors: model.norm.weight: checkpoint \(63,\) vs model \(64,\)"))
    _, pickled = _single_file(_copy(path, tmp_path / "pickled"))
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    cases.append((pickled, r"only pickled weights \(pytorch_model.bin\); zmrl reads \*.safetensors only"))
    lost = _copy(path, tmp_path / "lost")
    shard = sorted(lost.glob("model-*.safetensors"))[0]
    shard.unlink()
    cases.append((lost, rf"lists shard\(s\) the folder lacks: \['{shard.name}'\]"))
    import re

    for folder, pattern in cases:
        assert cli.main(["convert", str(folder)]) == 2, folder
        err = capsys.readouterr().err
        assert err.startswith("zmrl convert: error: ") and err.count("\n") == 1, err
        assert re.search(pattern, err), (pattern, err)


def test_out_must_be_new(release_dir, tmp_path, capsys) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main([str(release_dir), "--out", str(busy)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"]
    with pytest.raises(Exception, match="is the checkpoint folder itself"):
        convert_checkpoint(release_dir, release_dir)


def test_bfloat16_release_dequantises_into_bfloat16(tmp_path) -> None:
    from zmrl.model.model import cast_model

    src = tmp_path / "bf16"
    save_pretrained(cast_model(random_k3_model(tiny_k3()), torch.bfloat16), src, format="k3")
    out = tmp_path / "zmrl"
    report, written = convert_checkpoint(src, out)
    assert written and report.config.torch_dtype == "bfloat16"
    state = load_file(str(out / "model.safetensors"))
    experts = [k for k in state if ".experts." in k]
    assert experts and all(state[k].dtype == torch.bfloat16 for k in experts)
    a, b = load_pretrained(src, dtype="float32"), load_pretrained(out, dtype="float32")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
