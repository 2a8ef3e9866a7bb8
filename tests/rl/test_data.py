"""Problem files (the shipped AIME sets, jsonl/parquet, errors), the byte tokenizer and its HF twin,
and the synthetic task (answers checked by evaluating the expression)."""
import json
import random
import re

import pytest

from zmrl.rl.data import AIME_SETS, default_aime_path, load_problems
from zmrl.rl.reward import aime_reward
from zmrl.rl.synthetic import TaskSpec, format_solution, make_dataset, make_problem, solution_token_ids
from zmrl.rl.tokenizer import BYTE_TOKENIZER_FILE, ByteTokenizer, HFTokenizer, load_tokenizer, write_byte_tokenizer_marker


# ----------------------------------------------------------------------------- problem files


@pytest.mark.parametrize("name", AIME_SETS)
def test_shipped_aime_sets_load(name):
    path = default_aime_path(name)
    assert path.is_file(), path
    problems = load_problems(path)
    assert len(problems) == 30
    for p in problems:
        assert set(p) == {"question", "answer"}
        assert isinstance(p["question"], str) and len(p["question"]) > 20
        assert type(p["answer"]) is int and 0 <= p["answer"] <= 999
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert [p["answer"] for p in problems] == [int(r["answer"]) for r in raw]  # "025" -> 25, file order kept


def test_known_aime24_answers():
    answers = [p["answer"] for p in load_problems(default_aime_path("aime24"))]
    assert answers[:3] == [204, 113, 371] and answers[7] == 25  # "025" in the file


def test_unknown_set_name():
    with pytest.raises(ValueError, match="aime23"):
        default_aime_path("aime23")


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_problems(missing)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_missing_field_names_row_and_field(tmp_path):
    f = _write_jsonl(tmp_path / "p.jsonl", [{"question": "q0", "answer": 1}, {"question": "q1"}])
    with pytest.raises(ValueError, match=r"p.jsonl: line 2 has no 'answer' field"):
        load_problems(f)
    f = _write_jsonl(tmp_path / "q.jsonl", [{"problem": "q0", "answer": 1}])
    with pytest.raises(ValueError, match=r"line 1 has no 'question' field"):
        load_problems(f)


def test_broken_json_line_names_the_line(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text('{"question": "q0", "answer": 1}\n\n{"question": "q1", "answer": 2\n')
    with pytest.raises(ValueError, match=r"b.jsonl: line 3 is not valid JSON"):
        load_problems(f)
    f.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 1 is a JSON list, not an object"):
        load_problems(f)
    f.write_text("")
    with pytest.raises(ValueError, match=r"no problems"):
        load_problems(f)


def test_non_integer_answer_names_row(tmp_path):
    f = _write_jsonl(tmp_path / "p.jsonl", [{"question": "a", "answer": "7"}, {"question": "b", "answer": "x/2"}])
    with pytest.raises(ValueError, match=r"line 2 field 'answer' is not an integer: 'x/2'"):
        load_problems(f)


def test_answer_types_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "What is 1 + 1?", "answer": 2}, {"question": "Q2", "answer": 30}]
    assert load_problems(_write_jsonl(tmp_path / "a.jsonl", rows)) == rows
    f = _write_jsonl(tmp_path / "f.jsonl", [{"question": "Q", "answer": 12.0}])
    assert load_problems(f) == [{"question": "Q", "answer": 12}]
    pq.write_table(pa.Table.from_pylist([{"question": "P", "answer": "007", "extra": 1}]), tmp_path / "p.parquet")
    assert load_problems(tmp_path / "p.parquet") == [{"question": "P", "answer": 7}]
    (tmp_path / "x.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_problems(tmp_path / "x.csv")


# ----------------------------------------------------------------------------- byte tokenizer


@pytest.mark.parametrize("text", ["", "What is 7 * 8?", "héllo ∑ 🙂 \\boxed{56}\n", "\x00\x7f"])
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256 and all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == ids[1:]


def test_byte_specials_and_invalid_utf8():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (259, 256, 257, 258)
    assert tok.stop_token_ids == [257]
    ids = [256, *b"ab", 257, 258]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special=False) == "<|bos|>ab<|eos|><|pad|>"
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"  # invalid utf-8 -> replacement character
    assert tok.decode([0xE2, 0x82]) == "\ufffd"      # truncated multi-byte sequence
    assert tok.decode([ord("a"), 300, ord("b")]) == "ab"  # ids a bigger model vocabulary may sample
    assert tok.decode([300], skip_special=False) == "<|id:300|>"


def test_chat_template_is_short_and_asks_for_a_box():
    tok = ByteTokenizer()
    prompt = tok.apply_chat_template("What is 7 * 8?")
    assert prompt.startswith("What is 7 * 8?") and "\\boxed{}" in prompt
    assert len(prompt) - len("What is 7 * 8?") <= 24  # every prompt byte costs CPU time


def test_load_tokenizer_byte(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    write_byte_tokenizer_marker(tmp_path)
    assert (tmp_path / BYTE_TOKENIZER_FILE).exists()
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    (tmp_path / BYTE_TOKENIZER_FILE).write_text('{"type": "sentencepiece"}')
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def _save_hf_tokenizer(path, chat_template=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "[UNK]": 3}
    for c in "abcdefghijklmnopqrstuvwxyzW0123456789?+*-=\\{}.: \n<>|":
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="[UNK]")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(path))


def test_load_tokenizer_hf(tmp_path):
    _save_hf_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_id == 1 and tok.stop_token_ids == [1] and tok.pad_token_id == 2
    ids = tok.encode("what is 7*8?")
    assert ids[0] == 0 and ids.count(0) == 1
    assert tok.decode(ids) == "what is 7*8?"
    assert tok.encode("<s>ab", add_bos=True).count(0) == 1  # a rendered template's BOS is not doubled
    # no chat template: the byte tokenizer's fixed prompt
    assert tok.apply_chat_template("what is 1+1?") == ByteTokenizer().apply_chat_template("what is 1+1?")


def test_load_tokenizer_hf_chat_template(tmp_path):
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    _save_hf_tokenizer(tmp_path, template)
    prompt = load_tokenizer(tmp_path).apply_chat_template("what is 1+1?")
    assert prompt.startswith("<|user|>what is 1+1?") and "\\boxed{}" in prompt and prompt.endswith("<|assistant|>")


def test_load_tokenizer_hf_missing_files(tmp_path):
    with pytest.raises(ValueError, match=BYTE_TOKENIZER_FILE):
        load_tokenizer(tmp_path)  # an empty folder: no tokenizer of either kind


# ----------------------------------------------------------------------------- synthetic task

_EXPR = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def test_synthetic_answers_are_correct():
    problems = make_dataset(500, seed=3)
    ops = set()
    for p in problems:
        m = _EXPR.fullmatch(p["question"])
        assert m, p["question"]
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        ops.add(op)
        assert p["answer"] == eval(f"{a} {op} {b}")  # noqa: S307 -- the expression is digits and one operator
        assert type(p["answer"]) is int and 0 <= p["answer"] <= 999
    assert ops == {"+", "-"}  # the default task: single-digit sums and differences
    assert {op for p in make_dataset(200, 0, TaskSpec(mul_weight=1.0)) for op in "+-*" if op in p["question"]} \
        == {"+", "-", "*"}


def test_synthetic_is_deterministic_and_seeded():
    assert make_dataset(20, seed=5) == make_dataset(20, seed=5)
    assert make_dataset(20, seed=5) != make_dataset(20, seed=6)
    rng = random.Random(5)
    assert [make_problem(rng) for _ in range(20)] == make_dataset(20, seed=5)


def test_synthetic_spec_ranges():
    spec = TaskSpec(add_weight=0, sub_weight=1, mul_weight=0, sub_max=50)
    answers = [p["answer"] for p in make_dataset(200, 0, spec)]
    assert min(answers) >= 0 and max(answers) > 9
    with pytest.raises(ValueError, match="outside 0..999"):
        make_dataset(50, 0, TaskSpec(add_weight=0, sub_weight=0, mul_weight=1, mul_max=99))


def test_solution_format_earns_the_reward():
    tok = ByteTokenizer()
    for p in make_dataset(100, seed=1):
        text = format_solution(p)
        assert text.endswith(f"\\boxed{{{p['answer']}}}")
        assert aime_reward(text, p["answer"]) == 1.0
        ids = solution_token_ids(p, tok)
        assert ids[-1] == tok.eos_token_id and tok.decode(ids) == text
        assert len(ids) <= 18  # the rollout max_tokens the default task needs
    assert format_solution({"question": "What is 7 * 8?", "answer": 56}) == "7*8=56 \\boxed{56}"
    assert format_solution({"question": "An AIME problem.", "answer": 25}) == "\\boxed{25}"


def test_unboxed_solution_earns_nothing():
    """The bootstrap teacher's other format: the work without the box, which the grader cannot read."""
    for p in make_dataset(50, seed=2):
        text = format_solution(p, boxed=False)
        assert text.endswith(f"={p['answer']}") and "boxed" not in text
        assert aime_reward(text, p["answer"]) == 0.0
