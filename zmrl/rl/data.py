"""Problem sets (jsonl/parquet with ``question`` and integer ``answer``) loaded through HF ``datasets``."""
from __future__ import annotations

import os
from pathlib import Path


def default_aime_path(name: str) -> Path:
    """``aime24`` / ``aime25``: the copies shipped in the repository's ``data/aime/``."""
    if name not in ("aime24", "aime25"):
        raise ValueError(f"unknown problem set {name!r}; shipped sets: aime24, aime25")
    return Path(__file__).resolve().parents[2] / "data" / "aime" / f"{name}.jsonl"


def load_problems(path: str | os.PathLike) -> list[dict]:
    """Rows ``{"question": str, "answer": int}``; a missing file or field is a clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"problem file not found: {path}")
    fmt = "parquet" if path.suffix == ".parquet" else "json"
    from datasets import load_dataset

    ds = load_dataset(fmt, data_files=str(path), split="train")
    problems = []
    for i, row in enumerate(ds):
        for key in ("question", "answer"):
            if row.get(key) is None:
                raise ValueError(f"{path}: row {i} has no {key!r} field")
        try:
            answer = int(str(row["answer"]).strip())
        except ValueError:
            raise ValueError(f"{path}: row {i} field 'answer' is not an integer: {row['answer']!r}") from None
        problems.append({"question": str(row["question"]), "answer": answer})
    return problems
