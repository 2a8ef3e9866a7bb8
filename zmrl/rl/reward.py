"""AIME answer extraction and the 0/1 reward (README.md, "The RL loop").

An AIME answer is an integer in 0..999. The rule that decides:

1. If the response contains ``\\boxed{...}`` (or ``\\fbox{...}``), the content of the *last* one
   (braces balanced, so ``\\boxed{\\text{12}}`` works) is the answer; nothing earlier is consulted.
2. Otherwise the last "Answer: N" / "answer is N" (case-insensitive) gives it.
3. The candidate is normalised (spaces, ``$``, commas, LaTeX thin spaces, ``\\text{}``/``\\mathrm{}``
   wrappers and leading zeros removed) and must then be a plain decimal integer in 0..999; anything
   else (negative, out of range, a fraction, a word) is no answer (``None``).

math-verify is consulted only for a boxed content that is not a plain integer after normalisation
(``\\frac{50}{2}``, ``\\sqrt{4}``, ``2^{3}``): if it parses to an integer-valued number, that number
is used, subject to the same 0..999 rule. It is imported lazily and skipped when unavailable.
"""
from __future__ import annotations

import re
import threading

__all__ = ["AIME_MAX", "aime_reward", "extract_answer", "normalize_integer"]

AIME_MAX = 999
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer: 12", "answer is 12", "The final answer is: $1,234$." -- the number must follow directly.
_ANSWER = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*\$?\s*([+-]?\d[\d,]*)", re.IGNORECASE)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,!;: ]|\{,\}|\\quad|\\qquad|~|\s")
_INT = re.compile(r"\+?\d+")
_MAX_FALLBACK_CHARS = 200  # math-verify runs sympy; never hand it a long string


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces; None if there is none.

    An unterminated last box (generation cut off) yields None rather than a truncated number."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _strip_formatting(s: str) -> str:
    prev = None
    while prev != s:  # unwrap nested \text{\textbf{12}}
        prev, s = s, _WRAPPERS.sub(r"\1", s)
    return _SPACES.sub("", s).replace("$", "").replace(",", "").rstrip(".")


def normalize_integer(s: str) -> int | None:
    """A plain integer in 0..999 from ``s`` after removing formatting; None otherwise."""
    s = _strip_formatting(s)
    if not _INT.fullmatch(s):
        return None
    value = int(s)  # int() drops leading zeros and a leading '+'
    return value if 0 <= value <= AIME_MAX else None


def _math_verify_integer(content: str) -> int | None:
    """math-verify's reading of a boxed content, if it is an integer-valued number; else None."""
    if not content.strip() or len(content) > _MAX_FALLBACK_CHARS:
        return None
    try:
        from math_verify import parse
    except Exception:  # not installed / broken install: the integer rule alone decides
        return None
    # math-verify's timeout uses signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        parsed = parse(f"\\boxed{{{content}}}", parsing_timeout=timeout)
    except Exception:
        return None
    for expr in parsed:
        if isinstance(expr, str):
            continue
        try:
            if not getattr(expr, "is_number", False):
                continue
            ev = expr.doit()  # math-verify keeps 2**3, sqrt(4) unevaluated
            if ev.is_Integer or (ev.is_Float and ev == int(ev)):
                value = int(ev)
                return value if 0 <= value <= AIME_MAX else None
        except Exception:  # noqa: BLE001 -- sympy raises many types; an unreadable box is no answer
            continue
    return None


def extract_answer(text: str) -> int | None:
    """The response's final AIME answer (an int in 0..999), or None; see the module docstring."""
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed is None and _BOXED.search(text):
        return None  # the last box is unterminated: no answer
    if boxed is not None:
        if _INT.fullmatch(_strip_formatting(boxed)):
            return normalize_integer(boxed)  # a plain integer: in range or not, the rule has decided
        return _math_verify_integer(boxed)
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    return normalize_integer(matches[-1].rstrip(","))


def _ground_truth_int(ground_truth: int | str) -> int:
    if isinstance(ground_truth, bool):
        raise TypeError(f"ground truth must be an int or a numeric string, got {ground_truth!r}")
    if isinstance(ground_truth, int):
        return ground_truth
    value = normalize_integer(str(ground_truth))
    if value is None:
        raise ValueError(f"ground truth {ground_truth!r} is not an AIME answer (an integer in 0..{AIME_MAX})")
    return value


def aime_reward(response_text: str, ground_truth: int | str) -> float:
    """1.0 if the extracted answer equals the ground truth (int, or a string like "025"), else 0.0."""
    pred = extract_answer(response_text)
    return 1.0 if pred is not None and pred == _ground_truth_int(ground_truth) else 0.0
