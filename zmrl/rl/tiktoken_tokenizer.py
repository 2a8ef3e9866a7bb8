"""Kimi's tiktoken-based tokenizer, read by zmrl itself (the checkpoint's own ``tokenization_*.py`` is remote
code, which zmrl never runs).

The files: ``tiktoken.model`` (one ``<base64 token> <rank>`` line per BPE token; the rank is the token id)
and ``tokenizer_config.json``, whose ``added_tokens_decoder`` names the special tokens that follow the BPE
ids (``[BOS]``, ``[EOS]``, ``<|im_end|>``, ...) and whose ``bos_token`` / ``eos_token`` / ``pad_token`` say
which is which. Special ids between the BPE ids and the highest named special id that the config leaves
unnamed are reserved: they get the name ``<|reserved_token_{id}|>``. The chat template is the config's
``chat_template`` or a ``chat_template.jinja`` file beside it.

Text is split by ``KIMI_PAT_STR`` (Kimi's pre-tokenizer: runs of Han characters apart, case-aware letter
runs with English contractions, digits in groups of up to three, punctuation, whitespace), then BPE-merged by
tiktoken. Special-token text inside the string (a rendered chat template's ``<|im_user|>``) encodes to its
special id, as Kimi's own tokenizer does.
"""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zmrl.extras import require

from .chat_template import ChatPrompt, read_chat_template

__all__ = ["KIMI_PAT_STR", "TIKTOKEN_FILE", "TiktokenTokenizer", "read_tiktoken_ranks"]

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Kimi's pre-tokenizer (one alternative per line; ``&&`` is a character-class intersection)
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "*" + _LETTERS_LOWER + "+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "+" + _LETTERS_LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


# Kimi's tokenizer encodes at most this many characters at a time, and cuts a run of whitespace or of
# non-whitespace characters longer than MAX_RUN_CHARS (tiktoken's regex can overflow its stack on such a
# run); zmrl cuts at the same places, so long texts get the same ids.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def _pieces(text: str):
    """``text`` cut where Kimi's tokenizer cuts it (see MAX_RUN_CHARS)."""
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[i:i + MAX_ENCODE_CHARS]
        if len(chunk) <= MAX_RUN_CHARS:
            yield chunk
            continue
        start, run, prev = 0, 0, None
        for j, ch in enumerate(chunk):
            space = ch.isspace()
            run = run + 1 if space == prev else 1
            prev = space
            if run > MAX_RUN_CHARS:
                yield chunk[start:j]
                start, run = j, 1
        yield chunk[start:]


class TiktokenFileError(ValueError):
    """A tiktoken tokenizer file is malformed; the message names the file, the line or the setting."""


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model`` -> {token bytes: rank}; a bad line is an error naming its (1-based) number."""
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError("expected '<base64 token> <rank>'")
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error) as e:
                raise TiktokenFileError(f"{path}: line {n} is not '<base64 token> <rank>' ({e})") from None
            if token in ranks or rank in seen:
                raise TiktokenFileError(f"{path}: line {n} repeats a token or rank {rank} (first on line "
                                        f"{seen.get(rank, '?')})")
            ranks[token] = rank
            seen[rank] = n
    if not ranks:
        raise TiktokenFileError(f"{path}: no tokens")
    if sorted(seen) != list(range(len(seen))):
        raise TiktokenFileError(f"{path}: ranks are not 0..{len(seen) - 1} without gaps")
    return ranks


def _token_text(config: dict[str, Any], key: str) -> str | None:
    """``bos_token`` & co. are a string or an AddedToken-like ``{"content": ...}`` object."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TiktokenTokenizer(ChatPrompt):
    """The ``ByteTokenizer`` interface (zmrl/rl/tokenizer.py) over a ``tiktoken.model`` folder; the chat
    template is rendered by transformers' sandboxed Jinja renderer, given the special tokens' texts."""

    def __init__(self, folder: str | Path, extra_stop_ids: Iterable[int] = ()) -> None:
        tiktoken = require("tiktoken", "rl", f"the tiktoken tokenizer of {str(folder)!r}")
        root = Path(folder)
        cfg_path = root / TOKENIZER_CONFIG
        if not cfg_path.is_file():
            raise TiktokenFileError(f"{root}: {TIKTOKEN_FILE} needs a {TOKENIZER_CONFIG} beside it (its "
                                    "added_tokens_decoder names the special tokens)")
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise TiktokenFileError(f"{cfg_path}: not valid JSON ({e})") from None
        ranks = read_tiktoken_ranks(root / TIKTOKEN_FILE)
        num_base = len(ranks)
        named: dict[int, str] = {}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not str(key).isdigit() or not isinstance(content, str):
                raise TiktokenFileError(f"{cfg_path}: added_tokens_decoder[{key!r}] must map an integer id to "
                                        f"{{'content': str, ...}}, got {entry!r}")
            if int(key) < num_base:
                raise TiktokenFileError(f"{cfg_path}: added_tokens_decoder id {key} ({content!r}) is one of the "
                                        f"{num_base} BPE ids of {TIKTOKEN_FILE}; special ids start at {num_base}")
            named[int(key)] = content
        last = max(named, default=num_base - 1)
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, last + 1)}
        if len(self.special_tokens) != last + 1 - num_base:
            raise TiktokenFileError(f"{cfg_path}: added_tokens_decoder names one special token twice")
        self.encoding = tiktoken.Encoding(name=root.name or "tiktoken", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.name_or_path = str(root)
        self.num_base_tokens = num_base
        self._vocab_size = last + 1
        self._special_ids = frozenset(self.special_tokens.values())
        self._ids = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config, key)
            if text is not None and text not in self.special_tokens and key in ("pad_token", "unk_token"):
                text = None  # not used for generation: a pad / unk the config does not define is left out
            if text is not None and text not in self.special_tokens:
                raise TiktokenFileError(f"{cfg_path}: {key} = {text!r} is not a special token of "
                                        "added_tokens_decoder")
            self._ids[key] = None if text is None else self.special_tokens[text]
        if self._ids["eos_token"] is None:
            raise TiktokenFileError(f"{cfg_path}: no 'eos_token' (generation needs an end-of-sequence token)")
        self.special_token_texts = {k: _token_text(config, k) for k, i in self._ids.items() if i is not None}
        self.chat_template = read_chat_template(root, config)
        self._extra_stop_ids = [int(i) for i in extra_stop_ids]

    # ---------------------------------------------------------------- the ByteTokenizer interface
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._ids["bos_token"]

    @property
    def eos_token_id(self) -> int:
        return self._ids["eos_token"]  # type: ignore[return-value]  # checked in __init__

    @property
    def pad_token_id(self) -> int:
        pad = self._ids["pad_token"]
        return self.eos_token_id if pad is None else pad

    @property
    def stop_token_ids(self) -> list[int]:
        return list(dict.fromkeys([self.eos_token_id, *self._extra_stop_ids]))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [i for piece in _pieces(text) for i in self.encoding.encode(piece, allowed_special="all")]
        bos = self.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Special ids dropped (``skip_special``) or written as their text; ids past the vocabulary (a model's
        padded embedding rows) dropped or written ``<|id:N|>``."""
        keep: list[int] = []
        parts: list[str] = []
        for i in ids:
            i = int(i)
            if 0 <= i < self.num_base_tokens:
                keep.append(i)
                continue
            if skip_special:
                continue
            parts.append(self.encoding.decode(keep, errors="replace"))
            keep = []
            parts.append(self.encoding.decode([i]) if i in self._special_ids else f"<|id:{i}|>")
        parts.append(self.encoding.decode(keep, errors="replace"))
        return "".join(parts)

    def _render(self, messages: list[dict[str, str]]) -> str:
        utils = require("transformers.utils.chat_template_utils", "rl", "rendering a chat template")
        rendered, _ = utils.render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                                  add_generation_prompt=True, **self.special_token_texts)
        return rendered[0]

    def __repr__(self) -> str:
        return (f"TiktokenTokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"bpe={self.num_base_tokens}, special={len(self.special_tokens)})")
