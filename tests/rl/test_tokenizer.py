"""A checkpoint's ``tokenizer.json`` through ``transformers.AutoTokenizer`` (zmrl/rl/tokenizer.py): a tiny
byte-level BPE trained here with the ``tokenizers`` library (no network), the prompt formats, the stop ids of
generation_config.json, and the one-line refusal of a tokenizer that needs remote code."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from zmrl.rl.tokenizer import (HFTokenizer, NoChatTemplateError, TokenizerError,  # noqa: E402
                               load_tokenizer)

CORPUS = ["What is 7 * 8? The answer is \\boxed{56}.", "the thing is the answer", "What is 12 + 30?"] * 20
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_bpe_tokenizer(folder: Path, chat_template: str | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture
def bpe(tmp_path) -> Path:
    return save_bpe_tokenizer(tmp_path / "bpe", TEMPLATE)


def test_bpe_tokenizer_json(bpe) -> None:
    tok = load_tokenizer(bpe)
    assert isinstance(tok, HFTokenizer) and (bpe / "tokenizer.json").is_file()
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.stop_token_ids == [1]
    text = "What is 7 * 8? héllo 🙂"
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids) == text
    assert len(tok.encode("the answer is", add_bos=False)) < len("the answer is")  # merges learnt and used


def test_prompt_formats(bpe) -> None:
    chat = load_tokenizer(bpe).apply_chat_template("What is 1 + 1?")  # auto: the template
    assert chat == "<s><|user|>What is 1 + 1?\nPut the final answer in \\boxed{}.\n<|assistant|>"
    assert load_tokenizer(bpe, "chat_template").apply_chat_template("What is 1 + 1?") == chat
    assert load_tokenizer(bpe, "plain").apply_chat_template("What is 1 + 1?") == "What is 1 + 1?\nAnswer in \\boxed{}.\n"
    tok = load_tokenizer(bpe)
    assert tok.encode(chat).count(0) == 1  # the template's BOS text is the BOS id, not doubled


def test_no_template(tmp_path) -> None:
    folder = save_bpe_tokenizer(tmp_path / "base")
    assert load_tokenizer(folder).apply_chat_template("q") == "q\nAnswer in \\boxed{}.\n"
    with pytest.raises(NoChatTemplateError, match="has no chat template"):
        load_tokenizer(folder, "chat_template")
    with pytest.raises(ValueError, match="prompt_format must be one of"):
        load_tokenizer(folder, "chatml")


def test_generation_config_adds_stop_ids(bpe) -> None:
    (bpe / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert load_tokenizer(bpe).stop_token_ids == [1, 2]


def test_remote_code_tokenizer_is_refused_in_one_line(bpe) -> None:
    config = json.loads((bpe / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": ["tokenization_my.MyTokenizer", None]})
    (bpe / "tokenizer_config.json").write_text(json.dumps(config))
    (bpe / "tokenization_my.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(TokenizerError) as ei:
        load_tokenizer(bpe)
    msg = str(ei.value)
    assert "tokenizer_config.json: tokenizer_class 'MyTokenizer' is remote code" in msg and "\n" not in msg
    # the same auto_map beside a transformers class: loaded with that class, the Python file never runs
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (bpe / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(bpe).encode("the", add_bos=False)
