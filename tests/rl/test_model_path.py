"""``zmrl.train`` with ``model.path`` of a real checkpoint: a tiny ``DeepseekV3ForCausalLM`` saved by
transformers (sharded, with its index file) plus a ``tokenizer.json`` with a chat template, all built here (no
network). The inputs are checked before any heavy work, the prompt format follows ``data.prompt_format``, and
one RL step runs with the rollout's log-probs bitwise equal to the trainer's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from zmrl import train  # noqa: E402
from zmrl.rl.config import RecipeError, load_recipe  # noqa: E402
from zmrl.rl.preflight import InputError, check_inputs  # noqa: E402
from zmrl.rl.tokenizer import HFTokenizer  # noqa: E402

from .test_tokenizer import TEMPLATE, save_bpe_tokenizer  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


def save_tiny_deepseek_v3(folder: Path, vocab_size: int = 320) -> Path:
    import torch

    cfg = transformers.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(folder, max_shard_size="40KB")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = save_tiny_deepseek_v3(tmp_path_factory.mktemp("dsv3"))
    save_bpe_tokenizer(folder, TEMPLATE)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a} + 1?", "answer": a + 1}) + "\n" for a in range(4)))
    return path


def _overrides(out: Path, checkpoint: Path, problems: Path, *extra: str) -> list[str]:
    return [f"model.path={checkpoint}", f"data.train={problems}", "data.eval=none", f"trainer.out_dir={out}",
            "trainer.total_steps=1", "trainer.save_every=1", "data.prompts_per_step=2", "rollout.n=2",
            "rollout.max_tokens=4", "eval.every=0", "eval.before_training=false", "logging.wandb_mode=disabled",
            "trainer.num_threads=1", *extra]


def test_inputs_of_a_transformers_checkpoint(tmp_path, checkpoint, problems) -> None:
    cfg = load_recipe(str(RECIPE), _overrides(tmp_path / "run", checkpoint, problems))
    tok = check_inputs(cfg).tokenizer
    assert isinstance(tok, HFTokenizer) and tok.uses_chat_template
    assert tok.apply_chat_template("q").startswith("<s><|user|>q")
    cfg = load_recipe(str(RECIPE), _overrides(tmp_path / "run", checkpoint, problems, "data.prompt_format=plain"))
    assert check_inputs(cfg).tokenizer.apply_chat_template("q") == "q\nAnswer in \\boxed{}.\n"


def test_prompt_format_is_validated(tmp_path, checkpoint, problems) -> None:
    with pytest.raises(RecipeError, match=r"^recipe key 'data\.prompt_format': must be one of auto, chat_template, "
                                          r"plain, got 'chatml'$"):
        load_recipe(str(RECIPE), ["data.prompt_format=chatml"])
    # the embedded default's byte tokenizer has no chat template
    cfg = load_recipe(str(RECIPE), [f"trainer.out_dir={tmp_path}/run", f"model.bootstrap_dir={tmp_path}/boot",
                                    "data.prompt_format=chat_template"])
    with pytest.raises(InputError, match=r"^data\.prompt_format=chat_template: the tokenizer ByteTokenizer.* has no "
                                         r"chat template"):
        check_inputs(cfg)


def test_tokenizer_of_another_model_is_refused(tmp_path, problems) -> None:
    folder = save_tiny_deepseek_v3(tmp_path / "small_vocab", vocab_size=128)
    save_bpe_tokenizer(folder)  # ~300 ids > 128
    cfg = load_recipe(str(RECIPE), _overrides(tmp_path / "run", folder, problems))
    with pytest.raises(InputError, match=r"^model\.path=.*: the tokenizer has \d+ token ids but config\.json "
                                         r"vocab_size is 128"):
        check_inputs(cfg)
    shutil.rmtree(folder)


def test_one_rl_step_from_a_transformers_checkpoint(tmp_path, checkpoint, problems, capsys) -> None:
    out = tmp_path / "run"
    assert train.main([str(RECIPE), *_overrides(out, checkpoint, problems)]) == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step = [r for r in rows if r["step"] == 1][0]
    assert step["mismatch/tokens_compared"] > 0 and step["rollout/errors"] == 0
    assert step["mismatch/bitwise_equal_frac"] == 1.0 and step["mismatch/max_abs_dlogp"] == 0.0


def test_one_rl_step_from_a_kimi_release_checkpoint(tmp_path, problems, capsys) -> None:
    """The released Kimi K3 layout (MXFP4 experts) with Kimi's tiktoken tokenizer and chat template."""
    from zmrl.model import save_pretrained
    from zmrl.rl.tiktoken_tokenizer import TiktokenTokenizer

    from ..model.k3_utils import random_k3_model, tiny_k3
    from .test_tiktoken_tokenizer import BASE, write_kimi_tokenizer

    folder = tmp_path / "k3"
    save_pretrained(random_k3_model(tiny_k3(vocab_size=320)), folder, format="k3", max_shard_bytes=100_000)
    write_kimi_tokenizer(folder)
    out = tmp_path / "run"
    overrides = _overrides(out, folder, problems, "data.prompt_format=chat_template")
    tok = check_inputs(load_recipe(str(RECIPE), overrides)).tokenizer
    assert isinstance(tok, TiktokenTokenizer) and tok.stop_token_ids == [BASE + 1, BASE + 2]
    assert tok.encode(tok.apply_chat_template("q"))[:2] == [BASE, BASE + 3]  # [BOS] <|im_user|>
    assert train.main([str(RECIPE), *overrides]) == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step = [r for r in rows if r["step"] == 1][0]
    assert step["mismatch/tokens_compared"] > 0 and step["rollout/errors"] == 0
    assert step["mismatch/bitwise_equal_frac"] == 1.0 and step["mismatch/max_abs_dlogp"] == 0.0


def test_remote_code_tokenizer_stops_the_run_in_one_line(tmp_path, checkpoint, problems, capsys) -> None:
    folder = tmp_path / "remote"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": ["tokenization_my.MyTokenizer", None]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert train.main([str(RECIPE), *_overrides(tmp_path / "run", folder, problems)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"zmrl train: error: model.path={folder}: tokenizer: "), err
    assert "tokenizer_config.json: tokenizer_class 'MyTokenizer' is remote code" in err
