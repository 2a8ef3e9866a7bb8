"""AIME answer extraction and reward: the integer rule (0..999, last \\boxed{} wins, else the last
"Answer: N" / "answer is N") over many formats, with math-verify only for non-literal boxed content."""
import threading

import pytest

from zmrl.rl.reward import aime_reward, extract_answer, normalize_integer


@pytest.mark.parametrize("text, expected", [
    (r"\boxed{42}", 42),
    (r"so the result is $\boxed{204}$.", 204),
    (r"\boxed{ 7 }", 7),
    (r"\boxed{025}", 25),                      # AIME-style leading zeros
    (r"\boxed{000}", 0),
    (r"\boxed{0}", 0),
    (r"\boxed{999}", 999),
    (r"\boxed{$113$}", 113),
    (r"\boxed{+5}", 5),
    (r"\boxed{\text{12}}", 12),                # nested braces
    (r"\boxed{\textbf{\text{12}}}", 12),
    (r"\boxed{{12}}", None),                   # not a number once braces are kept
    (r"\boxed {33}", 33),
    (r"\fbox{8}", 8),
    (r"\boxed{5.}", 5),
    ("first \\boxed{1} then \\boxed{2} and finally \\boxed{3}", 3),   # last box wins
    ("\\boxed{7} ... Answer: 8", 7),           # a box beats an 'Answer:' line
    ("Answer: 17", 17),
    ("answer: 17.", 17),
    ("The answer is 123", 123),
    ("The final answer is: $45$", 45),
    ("ANSWER IS 9", 9),
    ("Answer: 1,000", None),                   # out of range
    ("Answer: 0,12", 12),                      # commas are formatting
    ("answer is 3 and the Answer: 4", 4),      # last one wins
    ("Answer: -5", None),
    (r"\boxed{-5}", None),
    (r"\boxed{1000}", None),
    (r"\boxed{1\,000}", None),                 # thin space: 1000, out of range (math-verify alone reads 1*0)
    (r"\boxed{123456}", None),
    (r"\boxed{3.5}", None),
    (r"\boxed{x+1}", None),
    (r"\boxed{}", None),
    (r"\boxed{12", None),                      # unterminated box (truncated generation)
    (r"\boxed{3} and then \boxed{4", None),    # the last box is unterminated: no answer
    ("the answer is unknown", None),
    ("42", None),                              # a bare number is no answer
    ("", None),
    ("\x00\xff garbage \ufffd{{}}", None),
    (r"\boxed{\frac{50}{2}}", 25),             # math-verify fallback: integer-valued expression
    (r"\boxed{\sqrt{4}}", 2),
    (r"\boxed{2^{3}}", 8),
    (r"\boxed{\frac{1}{3}}", None),
    (r"\boxed{10^{4}}", None),                 # integer-valued but out of range
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_rejects_non_strings():
    assert extract_answer(None) is None  # type: ignore[arg-type]
    assert extract_answer(42) is None  # type: ignore[arg-type]


def test_normalize_integer():
    assert normalize_integer(" 0 7 ") == 7
    assert normalize_integer("$1,2$") == 12
    assert normalize_integer("1e3") is None
    assert normalize_integer("") is None


@pytest.mark.parametrize("response, truth, reward", [
    (r"7*8=56 \boxed{56}", 56, 1.0),
    (r"7*8=56 \boxed{56}", "56", 1.0),
    (r"\boxed{25}", "025", 1.0),            # AIME ground truths are strings with leading zeros
    (r"\boxed{025}", 25, 1.0),
    (r"\boxed{55}", 56, 0.0),
    ("no answer here", 56, 0.0),
    (r"\boxed{1056}", 56, 0.0),             # out of range never matches, even by suffix
    ("Answer: 0", 0, 1.0),
    ("", 0, 0.0),
])
def test_aime_reward(response, truth, reward):
    assert aime_reward(response, truth) == reward


def test_bad_ground_truth_is_an_error():
    with pytest.raises(ValueError, match="ground truth"):
        aime_reward(r"\boxed{1}", "one")
    with pytest.raises(TypeError):
        aime_reward(r"\boxed{1}", True)  # type: ignore[arg-type]


def test_fallback_works_outside_the_main_thread():
    """math-verify's timeout uses signal.alarm (main thread only); the reward must still work in threads."""
    out = []
    t = threading.Thread(target=lambda: out.append(extract_answer(r"\boxed{\frac{50}{2}}")))
    t.start()
    t.join()
    assert out == [25]


def test_integer_rule_works_without_math_verify(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails as if not installed
    assert extract_answer(r"\boxed{\frac{50}{2}}") is None
    assert extract_answer(r"\boxed{025}") == 25
    assert aime_reward("Answer: 7", 7) == 1.0
