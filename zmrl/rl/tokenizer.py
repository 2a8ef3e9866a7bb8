"""Tokenizers for the RL loop: a dependency-free byte tokenizer for the embedded default model, a thin
wrapper giving a Hugging Face tokenizer (``tokenizer.json`` & co., through ``transformers.AutoTokenizer``,
never with remote code) the same interface, and Kimi's tiktoken files (tiktoken_tokenizer.py).

Interface (every class): ``encode(text, add_bos=True) -> list[int]``, ``decode(ids, skip_special=True)
-> str``, ``apply_chat_template(question) -> str`` (the prompt text, to be passed to ``encode``),
``eos_token_id``, ``bos_token_id``, ``pad_token_id``, ``stop_token_ids`` and ``vocab_size``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from zmrl.extras import require

from .chat_template import PROMPT_FORMATS, PROMPT_TEMPLATE, ChatPrompt, NoChatTemplateError
from .tiktoken_tokenizer import TIKTOKEN_FILE, TiktokenTokenizer

__all__ = ["BYTE_TOKENIZER_FILE", "ByteTokenizer", "HFTokenizer", "NoChatTemplateError", "PROMPT_FORMATS",
           "PROMPT_TEMPLATE", "TiktokenTokenizer", "TokenizerError", "load_tokenizer"]

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

    chat_template = None  # no chat template: every prompt_format but chat_template gives PROMPT_TEMPLATE

    def apply_chat_template(self, question: str) -> str:
        return PROMPT_TEMPLATE.format(question=question.strip())

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, bos=256, eos=257, pad=258)"


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files cannot be used; the message names the file and the setting."""


class HFTokenizer(ChatPrompt):
    """A ``transformers`` tokenizer behind the ByteTokenizer interface.

    ``apply_chat_template`` follows ``prompt_format`` (chat_template.py). ``encode`` never lets the
    tokenizer add special tokens itself (a rendered chat template usually carries its own BOS text); with
    ``add_bos`` it prepends ``bos_token_id`` unless already there. ``stop_token_ids``: the EOS id, then
    ``extra_stop_ids`` (the checkpoint's ``generation_config.json`` end ids, e.g. an end-of-turn token)."""

    def __init__(self, tokenizer, extra_stop_ids: Iterable[int] = ()) -> None:
        self.tok = tokenizer
        self._extra_stop_ids = [int(i) for i in extra_stop_ids]

    @property
    def chat_template(self) -> str | None:  # type: ignore[override]
        template = getattr(self.tok, "chat_template", None)
        if isinstance(template, dict):  # named templates
            template = template.get("default")
        return template or None

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
        return list(dict.fromkeys([self.eos_token_id, *self._extra_stop_ids]))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False))
        bos = self.tok.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            chat_template=self.chat_template)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.tok.name_or_path!r}, vocab_size={self.vocab_size})"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def generation_stop_ids(root: Path) -> list[int]:
    """The end ids of ``generation_config.json`` (``eos_token_id``: an id or a list), if the file exists."""
    path = root / "generation_config.json"
    if not path.is_file():
        return []
    value = _read_json(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return ids


def _check_no_remote_code(root: Path) -> None:
    """A tokenizer whose class exists only in the checkpoint's own Python files is refused, in one line."""
    path = root / "tokenizer_config.json"
    if not path.is_file():
        return
    config = _read_json(path)
    auto = (config.get("auto_map") or {}).get("AutoTokenizer") if isinstance(config.get("auto_map"), dict) else None
    if not auto:
        return
    cls = config.get("tokenizer_class")
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    if cls is None or tokenizer_class_from_name(str(cls)) is None:
        remote = [a for a in (auto if isinstance(auto, list) else [auto]) if a]
        raise TokenizerError(f"{path}: tokenizer_class {cls!r} is remote code (auto_map.AutoTokenizer = {remote}), "
                             "which zmrl never runs (no trust_remote_code): give the folder a tokenizer.json whose "
                             "tokenizer_class is a transformers class, or Kimi's tiktoken.model")


def load_tokenizer(model_path: str | os.PathLike | None = None, prompt_format: str = "auto"
                   ) -> ByteTokenizer | HFTokenizer | TiktokenTokenizer:
    """The tokenizer of a checkpoint folder, loaded offline:

    - None (the embedded default) or a folder marked with ``zmrl_tokenizer.json``: ByteTokenizer;
    - a folder with ``tiktoken.model`` (Kimi): TiktokenTokenizer (zmrl's own loader);
    - any other folder: its Hugging Face tokenizer via ``AutoTokenizer`` (``local_files_only``, never remote
      code: a tokenizer class that lives in the checkpoint's Python files is a TokenizerError).

    ``prompt_format``: chat_template.py (``chat_template`` without a template raises NoChatTemplateError)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    if model_path is None:
        tok = ByteTokenizer()
    else:
        tok = _load_folder(Path(model_path))
    if prompt_format == "chat_template" and not tok.chat_template:
        raise NoChatTemplateError(f"the tokenizer {tok!r} has no chat template (looked for tokenizer_config.json "
                                  "'chat_template' and chat_template.jinja)")
    if isinstance(tok, ChatPrompt):
        tok.set_prompt_format(prompt_format)
    return tok


def _load_folder(root: Path) -> ByteTokenizer | HFTokenizer | TiktokenTokenizer:
    marker = root / BYTE_TOKENIZER_FILE
    if marker.exists():
        kind = json.loads(marker.read_text()).get("type")
        if kind != "byte":
            raise ValueError(f"{marker}: unknown tokenizer type {kind!r} (expected 'byte')")
        return ByteTokenizer()
    if not root.exists():
        raise FileNotFoundError(f"tokenizer path {str(root)!r} does not exist")
    stops = generation_stop_ids(root)
    if (root / TIKTOKEN_FILE).is_file():
        return TiktokenTokenizer(root, extra_stop_ids=stops)
    AutoTokenizer = require("transformers", "rl", f"the tokenizer of {str(root)!r}").AutoTokenizer
    _check_no_remote_code(root)
    try:
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 -- re-raised with the path and the way out
        raise ValueError(f"could not load a Hugging Face tokenizer from {str(root)!r} (offline): "
                         f"{' '.join(str(e).split())}. A byte-tokenizer checkpoint needs a {BYTE_TOKENIZER_FILE} "
                         f"file, a Kimi one {TIKTOKEN_FILE} + tokenizer_config.json.") from e
    return HFTokenizer(tok, extra_stop_ids=stops)


def write_byte_tokenizer_marker(path: str | os.PathLike) -> None:
    """Mark a checkpoint folder as using the ByteTokenizer (read by ``load_tokenizer``)."""
    (Path(path) / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "byte", "vocab_size": 259}) + "\n")
