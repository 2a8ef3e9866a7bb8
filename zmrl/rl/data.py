"""Problem sets: jsonl/json/parquet files with a ``question`` and an integer ``answer`` per row, loaded
offline through HF ``datasets``.

The AIME 2024 and 2025 sets (30 problems each) ship in the repository's ``data/aime/``;
``default_aime_path("aime24")`` finds them relative to this package, which works for a source
checkout and an editable install (``pip install -e .``). A non-editable install does not carry
``data/``: pass the file's path to ``load_problems`` instead.
"""
from __future__ import annotations

import numbers
import os
from pathlib import Path

__all__ = ["AIME_SETS", "default_aime_path", "load_problems"]

AIME_SETS = ("aime24", "aime25")
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def default_aime_path(name: str) -> Path:
    """``aime24`` / ``aime25``: the copies shipped in the repository's ``data/aime/``."""
    if name not in AIME_SETS:
        raise ValueError(f"unknown problem set {name!r}; shipped sets: {', '.join(AIME_SETS)}")
    return Path(__file__).resolve().parents[2] / "data" / "aime" / f"{name}.jsonl"


def _answer_int(value, where: str) -> int:
    """An int from an int, an integer-valued float, or a numeric string such as ``"025"``."""
    if isinstance(value, bool):
        raise ValueError(f"{where} field 'answer' is a boolean, not an integer: {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{where} field 'answer' is not an integer: {value!r}") from None


def _jsonl_rows(path: Path) -> list[tuple[str, object]]:
    """``(where, row)`` per non-blank line of a JSON-lines file; ``where`` names the 1-based line, as an
    editor shows it. A line that is not JSON is an error naming it."""
    import json

    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}: line {n}", json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{path}: line {n} is not valid JSON ({getattr(e, 'msg', e)}, column "
                                 f"{getattr(e, 'colno', '?')})") from None
    return rows


def load_problems(path: str | os.PathLike) -> list[dict]:
    """Rows ``{"question": str, "answer": int}`` in file order.

    Raises FileNotFoundError naming the path when it does not exist, and ValueError naming the place
    (``line N`` of a .jsonl file, 1-based; ``row N`` of a .json/.parquet table, 0-based) and the field
    when a line is not JSON, or a row has no ``question``/``answer`` or a non-integer answer."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"problem file not found: {path}")
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: unsupported problem file type {path.suffix!r}; use .jsonl, .json or .parquet")
    if path.suffix.lower() == ".jsonl":
        rows = _jsonl_rows(path)
    else:
        from datasets import load_dataset

        try:
            ds = load_dataset(fmt, data_files=str(path), split="train")
        except Exception as e:  # noqa: BLE001 -- pyarrow/datasets errors do not name the file
            raise ValueError(f"{path}: could not read as {fmt}: {str(e).splitlines()[0] if str(e) else e!r}") from None
        rows = [(f"{path}: row {i}", row) for i, row in enumerate(ds)]
    problems = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object with 'question' and 'answer'")
        for key in ("question", "answer"):
            if row.get(key) is None:
                raise ValueError(f"{where} has no {key!r} field (every row needs 'question' and 'answer')")
        question = row["question"]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where} field 'question' must be a non-empty string, got {question!r}")
        problems.append({"question": question, "answer": _answer_int(row["answer"], where)})
    if not problems:
        raise ValueError(f"{path}: no problems (the file is empty)")
    return problems
