"""Tokenizers for the RL loop: a dependency-free byte tokenizer for the embedded default model, and a
thin wrapper giving a Hugging Face tokenizer the same interface.

Interface (both classes): ``encode(text, add_bos=True) -> list[int]``, ``decode(ids, skip_special=True)
-> str``, ``apply_chat_template(question) -> str`` (the prompt text, to be passed to ``encode``),
``eos_token_id``, ``bos_token_id``, ``pad_token_id``, ``stop_token_ids`` and ``vocab_size``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from zmrl.extras import require

__all__ = ["BYTE_TOKENIZER_FILE", "ByteTokenizer", "HFTokenizer", "PROMPT_TEMPLATE", "load_tokenizer"]

# Every prompt byte costs CPU time in rollout and training, so the instruction is as short as it can
# be while still naming the answer format that the reward (zmrl.rl.reward) reads.
PROMPT_TEMPLATE = "{question}\nAnswer in \\boxed{{}}.\n"

# A checkpoint folder holding this file uses the byte tokenizer (written by zmrl.rl.bootstrap).
BYTE_TOKENIZER_FILE = "zmrl_tokenizer.json"


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes; 256 = BOS, 257 = EOS, 258 = PAD (vocab_size 259).

    A model may have a larger vocabulary (the tiny preset has 2048 / the bootstrap model 512); ids
    >= 259 that such a model samples are not text and are dropped by ``decode`` (rendered as
    ``<|id:N|>`` when ``skip_special=False``)."""

    BOS = 256
    EOS = 257
    PAD = 258
    _NAMES = {BOS: "<|bos|>", EOS: "<|eos|>", PAD: "<|pad|>"}

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def pad_token_id(self) -> int:
        return self.PAD

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.EOS]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Bytes -> text with invalid UTF-8 replaced by U+FFFD; special / unknown ids dropped or named."""
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if skip_special:
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            parts.append(self._NAMES.get(i, f"<|id:{i}|>"))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, question: str) -> str:
        return PROMPT_TEMPLATE.format(question=question.strip())

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, bos=256, eos=257, pad=258)"


class HFTokenizer:
    """A ``transformers`` tokenizer behind the ByteTokenizer interface.

    ``apply_chat_template`` uses the tokenizer's chat template (one user turn holding the question and
    the \\boxed{} instruction, generation prompt added) when it has one, else ``PROMPT_TEMPLATE``.
    ``encode`` never lets the tokenizer add special tokens itself (a rendered chat template usually
    carries its own BOS text); with ``add_bos`` it prepends ``bos_token_id`` unless already there."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def bos_token_id(self) -> int | None:
        return self.tok.bos_token_id

    @property
    def eos_token_id(self) -> int:
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer {self.tok.name_or_path!r} defines no eos_token_id")
        return self.tok.eos_token_id

    @property
    def pad_token_id(self) -> int:
        pad = self.tok.pad_token_id
        return self.eos_token_id if pad is None else pad

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.eos_token_id]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False))
        bos = self.tok.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, question: str) -> str:
        if getattr(self.tok, "chat_template", None):
            content = f"{question.strip()}\nPut the final answer in \\boxed{{}}."
            return self.tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
        return PROMPT_TEMPLATE.format(question=question.strip())

    def __repr__(self) -> str:
        return f"HFTokenizer({self.tok.name_or_path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(model_path: str | os.PathLike | None = None) -> ByteTokenizer | HFTokenizer:
    """None (the embedded default) or a folder marked with ``zmrl_tokenizer.json`` -> ByteTokenizer;
    any other folder -> its Hugging Face tokenizer, loaded offline (``local_files_only=True``)."""
    if model_path is None:
        return ByteTokenizer()
    root = Path(model_path)
    marker = root / BYTE_TOKENIZER_FILE
    if marker.exists():
        kind = json.loads(marker.read_text()).get("type")
        if kind != "byte":
            raise ValueError(f"{marker}: unknown tokenizer type {kind!r} (expected 'byte')")
        return ByteTokenizer()
    if not root.exists():
        raise FileNotFoundError(f"tokenizer path {str(root)!r} does not exist")
    AutoTokenizer = require("transformers", "rl", f"the tokenizer of {str(root)!r}").AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- re-raised with the path and the way out
        raise ValueError(f"could not load a Hugging Face tokenizer from {str(root)!r} (offline): {e}. "
                         f"A byte-tokenizer checkpoint needs a {BYTE_TOKENIZER_FILE} file.") from e
    return HFTokenizer(tok)


def write_byte_tokenizer_marker(path: str | os.PathLike) -> None:
    """Mark a checkpoint folder as using the ByteTokenizer (read by ``load_tokenizer``)."""
    (Path(path) / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "byte", "vocab_size": 259}) + "\n")
