"""Kimi's tiktoken tokenizer files read by zmrl's own loader (zmrl/rl/tiktoken_tokenizer.py): a tiny BPE file
and tokenizer_config.json written here (no network), ids checked against merges worked out by hand."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

pytest.importorskip("tiktoken")

from zmrl.rl.tiktoken_tokenizer import TiktokenFileError, TiktokenTokenizer, read_tiktoken_ranks  # noqa: E402
from zmrl.rl.tokenizer import NoChatTemplateError, TokenizerError, load_tokenizer  # noqa: E402

# BPE merges after the 256 single bytes (rank = id). "e" + the first UTF-8 byte of 你 and "34" come first:
# Kimi's pre-tokenizer never lets them apply (Han runs and 3-digit groups are split off before BPE), a
# \p{L}+ / \p{N}+ pattern would.
MERGES = [b"e\xe4", b"34", b"th", b"the", b" t", b" the", b"in", b"ing", b"is", b" is", b"aa"]
RANK = {tok: 256 + i for i, tok in enumerate(MERGES)}
BASE = 256 + len(MERGES)
SPECIALS = {BASE: "[BOS]", BASE + 1: "[EOS]", BASE + 2: "<|im_end|>", BASE + 3: "<|im_user|>",
            BASE + 4: "<|im_assistant|>", BASE + 6: "<|im_middle|>"}  # BASE + 5 left unnamed: reserved
TEMPLATE = ("{%- for m in messages -%}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
            "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def write_kimi_tokenizer(folder: Path, chat_template: str | None = TEMPLATE, **config_over) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + MERGES
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                                   for i, t in enumerate(tokens)))
    config = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in SPECIALS.items()},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": None, "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(config_over)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": BASE + 2}))
    return folder


@pytest.fixture
def kimi(tmp_path) -> Path:
    return write_kimi_tokenizer(tmp_path / "kimi")


def test_ids_follow_kimi_pretokenizer_and_merges(kimi) -> None:
    tok = load_tokenizer(kimi)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == BASE + 7 and tok.bos_token_id == BASE and tok.eos_token_id == BASE + 1
    assert tok.stop_token_ids == [BASE + 1, BASE + 2]  # EOS, then generation_config's end-of-turn
    assert tok.pad_token_id == BASE + 1
    assert load_tokenizer(write_kimi_tokenizer(kimi.parent / "pad", pad_token="[PAD]")).pad_token_id == BASE + 1
    # "the" | " thing" | " is": " thing" = " " + th + ing
    assert tok.encode("the thing is", add_bos=False) == [RANK[b"the"], 32, RANK[b"th"], RANK[b"ing"], RANK[b" is"]]
    # Han run split from the letters: e + 0xE4 never merges
    assert tok.encode("the你", add_bos=False) == [RANK[b"the"], *"你".encode()]
    # digits in groups of three: "123" | "45", so "34" never merges
    assert tok.encode("12345", add_bos=False) == [*b"12345"]
    assert tok.encode("34", add_bos=False) == [RANK[b"34"]]
    ids = tok.encode("héllo 你好 🙂 \\boxed{56}")
    assert ids[0] == BASE and tok.decode(ids) == "héllo 你好 🙂 \\boxed{56}"


def test_long_runs_are_cut_where_kimi_cuts_them(kimi) -> None:
    from zmrl.rl.tiktoken_tokenizer import MAX_RUN_CHARS

    tok = load_tokenizer(kimi)
    # "b" + 25000 "a": one pre-token, cut after 25000 characters -> "b" + 24999 "a" | "a"
    ids = tok.encode("b" + "a" * MAX_RUN_CHARS, add_bos=False)
    assert ids == [ord("b"), *[RANK[b"aa"]] * ((MAX_RUN_CHARS - 1) // 2), ord("a"), ord("a")]
    # a run of exactly MAX_RUN_CHARS is not cut ("bb" + 24998 "a": a cut one earlier would end in "a", "a")
    assert tok.encode("bb" + "a" * (MAX_RUN_CHARS - 2), add_bos=False)[-2:] == [RANK[b"aa"], RANK[b"aa"]]
    assert tok.decode(ids) == "b" + "a" * MAX_RUN_CHARS


def test_special_tokens_and_decode(kimi) -> None:
    tok = load_tokenizer(kimi)
    ids = tok.encode("<|im_user|>is<|im_end|>", add_bos=False)
    assert ids == [BASE + 3, RANK[b"is"], BASE + 2]
    assert tok.encode("[BOS]the").count(BASE) == 1  # a rendered BOS is not doubled
    assert tok.decode(ids) == "is"
    assert tok.decode(ids, skip_special=False) == "<|im_user|>is<|im_end|>"
    assert tok.decode([BASE + 5], skip_special=False) == f"<|reserved_token_{BASE + 5}|>"
    assert tok.decode([RANK[b"the"], BASE + 99]) == "the"  # a padded embedding row's id: not text
    assert tok.decode([BASE + 99], skip_special=False) == f"<|id:{BASE + 99}|>"
    assert tok.decode([0xE4, 0xBD]) == "\ufffd"  # a cut UTF-8 sequence


def test_chat_template_from_config_and_jinja_file(kimi) -> None:
    tok = load_tokenizer(kimi)
    prompt = tok.apply_chat_template(" What is 1 + 1? ")
    assert prompt == ("<|im_user|>user<|im_middle|>What is 1 + 1?\nPut the final answer in \\boxed{}.<|im_end|>"
                      "<|im_assistant|>assistant<|im_middle|>")
    ids = tok.encode(prompt)
    assert ids[:2] == [BASE, BASE + 3] and ids[-1] == BASE + 6
    assert load_tokenizer(kimi, "plain").apply_chat_template("q") == "q\nAnswer in \\boxed{}.\n"
    (kimi / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}|")
    assert load_tokenizer(kimi, "chat_template").apply_chat_template("q") == \
        "[BOS]q\nPut the final answer in \\boxed{}.|"


def test_no_chat_template(tmp_path) -> None:
    folder = write_kimi_tokenizer(tmp_path / "base", chat_template=None)
    assert load_tokenizer(folder).apply_chat_template("q") == "q\nAnswer in \\boxed{}.\n"  # auto
    with pytest.raises(NoChatTemplateError, match="has no chat template"):
        load_tokenizer(folder, "chat_template")
    with pytest.raises(NoChatTemplateError):
        load_tokenizer(None, "chat_template")  # the byte tokenizer has none either


@pytest.mark.parametrize("over,needle", [
    ({"eos_token": "[END]"}, "eos_token = '[END]' is not a special token"),
    ({"eos_token": None}, "no 'eos_token'"),
    ({"bos_token": "<s>"}, "bos_token = '<s>' is not a special token"),
    ({"added_tokens_decoder": {"3": {"content": "<x>"}}}, "added_tokens_decoder id 3 ('<x>') is one of the"),
    ({"added_tokens_decoder": {"abc": {"content": "<x>"}}}, "added_tokens_decoder['abc'] must map an integer id"),
])
def test_bad_config_names_the_setting(tmp_path, over, needle) -> None:
    folder = write_kimi_tokenizer(tmp_path / "bad", **over)
    with pytest.raises(TiktokenFileError) as ei:
        load_tokenizer(folder)
    assert needle in str(ei.value) and "tokenizer_config.json" in str(ei.value) and "\n" not in str(ei.value)


def test_bad_bpe_file_names_the_line(kimi) -> None:
    lines = (kimi / "tiktoken.model").read_text().splitlines()
    (kimi / "tiktoken.model").write_text("\n".join([*lines[:5], "!!notbase64 5", *lines[6:]]) + "\n")
    with pytest.raises(TiktokenFileError, match=r"tiktoken\.model: line 6 is not"):
        read_tiktoken_ranks(kimi / "tiktoken.model")
    (kimi / "tiktoken.model").write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    with pytest.raises(TiktokenFileError, match="without gaps"):
        load_tokenizer(kimi)
    (kimi / "tokenizer_config.json").unlink()
    with pytest.raises(TiktokenFileError, match="needs a tokenizer_config.json"):
        load_tokenizer(kimi)


def test_generation_config_stop_ids_are_checked(kimi) -> None:
    (kimi / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match=r"generation_config\.json: eos_token_id must be"):
        load_tokenizer(kimi)
