"""What verl's model-config path reads from a checkpoint folder, for zmrl checkpoints.

verl builds ``HFModelConfig`` from ``actor_rollout_ref.model.path`` with ``AutoConfig.from_pretrained``
and ``AutoTokenizer.from_pretrained``. ``register_auto_config`` teaches ``AutoConfig`` zmrl's model types
(a plain ``PretrainedConfig`` carrying the fields of ``config.json``; no remote code), and
``write_byte_tokenizer_files`` gives a byte-tokenizer checkpoint (``zmrl_tokenizer.json``,
zmrl/rl/tokenizer.py) a ``tokenizer.json`` + ``tokenizer_config.json`` that encode, decode and apply the
chat template exactly as ``ByteTokenizer`` does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from zmrl.model.checkpoint import ZMRL_ARCHITECTURE
from zmrl.rl.tokenizer import BYTE_TOKENIZER_FILE, PROMPT_TEMPLATE, ByteTokenizer

__all__ = ["ZMRL_ARCHITECTURE", "ZMRL_MODEL_TYPES", "ZmrlHFConfig", "byte_chat_template", "prepare_checkpoint",
           "register_auto_config", "write_byte_tokenizer_files"]

# model_type values of zmrl's own config.json (zmrl/model/config.py ModelConfig.model_type and presets)
ZMRL_MODEL_TYPES = ("kimi_k3",)


def _config_class():
    from transformers import PretrainedConfig

    class ZmrlHFConfig(PretrainedConfig):
        """zmrl's ``config.json`` as a transformers config: every field kept as an attribute (verl reads
        ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``tie_word_embeddings`` ...)."""

        model_type = ZMRL_MODEL_TYPES[0]

        def __init__(self, **kwargs):
            kwargs.setdefault("architectures", [ZMRL_ARCHITECTURE])
            super().__init__(**kwargs)

    return ZmrlHFConfig


ZmrlHFConfig = None  # set by register_auto_config (transformers is imported only there)


def register_auto_config() -> None:
    """``AutoConfig.for_model`` / ``from_pretrained`` know zmrl's model types (idempotent; leaves a model
    type that transformers itself defines alone)."""
    global ZmrlHFConfig
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if ZmrlHFConfig is None:
        ZmrlHFConfig = _config_class()
    for model_type in ZMRL_MODEL_TYPES:
        if model_type not in CONFIG_MAPPING:
            cls = ZmrlHFConfig if model_type == ZmrlHFConfig.model_type else type(
                f"ZmrlHFConfig_{model_type}", (ZmrlHFConfig,), {"model_type": model_type})
            AutoConfig.register(model_type, cls)


def byte_chat_template() -> str:
    """Jinja source rendering ``ByteTokenizer().apply_chat_template(question)`` with the BOS text in front:
    the last user message, stripped, in ``PROMPT_TEMPLATE``."""
    before, after = PROMPT_TEMPLATE.split("{question}")
    after = after.replace("{{}}", "{}")
    lit = lambda s: json.dumps(s)  # a JSON string literal is a valid Jinja string literal
    return ("{% set ns = namespace(q='') %}{% for m in messages %}{% if m['role'] == 'user' %}"
            "{% set ns.q = m['content'] | trim %}{% endif %}{% endfor %}"
            "{{ bos_token }}{{ " + lit(before) + " }}{{ ns.q }}{{ " + lit(after) + " }}")


def _gpt2_byte_chars() -> list[str]:
    # the standard byte -> printable-unicode table of byte-level BPE: printable Latin-1 bytes map to
    # themselves, the rest to 256 + n in order
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def write_byte_tokenizer_files(path: str | os.PathLike, vocab_size: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` for a byte-tokenizer checkpoint whose model has
    ``vocab_size`` logits: ids 0..255 are the bytes, 256/257/258 BOS/EOS/PAD, and every id above 258
    (logits the byte tokenizer never produces) a special ``<|id:N|>`` token, dropped when decoding with
    special tokens skipped -- as ``ByteTokenizer.decode`` drops them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte = ByteTokenizer()
    if vocab_size < byte.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the byte tokenizer's {byte.vocab_size} ids")
    vocab = {c: b for b, c in enumerate(_gpt2_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = dict(ByteTokenizer._NAMES)
    names.update({i: f"<|id:{i}|>" for i in range(byte.vocab_size, vocab_size)})
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(names)])
    for i, name in names.items():
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"byte tokenizer: {name} got id {tok.token_to_id(name)}, expected {i}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names[byte.BOS], eos_token=names[byte.EOS],
                                   pad_token=names[byte.PAD], clean_up_tokenization_spaces=False)
    fast.chat_template = byte_chat_template()
    fast.save_pretrained(str(path))


def prepare_checkpoint(path: str | os.PathLike) -> Path:
    """Make a zmrl checkpoint folder readable by verl's model config path: ``architectures`` in
    ``config.json`` (zmrl's save_pretrained writes it; older checkpoints get it here) and, for a byte-tokenizer checkpoint, the tokenizer files. Idempotent; returns the path."""
    root = Path(path).expanduser()
    cfg_file = root / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"actor_rollout_ref.model.path={str(root)!r}: no config.json (not a checkpoint folder)")
    cfg = json.loads(cfg_file.read_text())
    if "architectures" not in cfg:
        cfg["architectures"] = [ZMRL_ARCHITECTURE]
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (root / BYTE_TOKENIZER_FILE).exists() and not (root / "tokenizer.json").exists():
        write_byte_tokenizer_files(root, int(cfg["vocab_size"]))
    return root
