"""HF-style checkpoints: ``config.json`` + ``*.safetensors`` (never pickle), in zmrl's own layout or the
released Kimi K3's (k3_release.py)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, ModelConfig
from .hf_config import config_to_hf, fused_expert_source, is_hf_config, skipped_tensor, slice_fused_expert
from .k3_release import (Source, config_to_release, convert_tensor, converted_shape, is_release_config,
                         map_release_tensors, release_state, tensor_prefix)
from .mxfp4 import MXFP4Error
from .model import DTYPES, HybridForCausalLM, cast_model, checkpoint_state

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# `architectures` of zmrl-format config.json files: what transformers-based tools (verl's model config
# path) read to name the model class; zmrl ignores it when reading the file back (config.py IGNORED_HF_KEYS).
ZMRL_ARCHITECTURE = "ZmrlForCausalLM"
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint does not match the model: the message names the tensors."""


FORMATS = ("zmrl", "k3", "hf")


def save_pretrained(model: HybridForCausalLM, path: str | os.PathLike, max_shard_bytes: int | None = None,
                    format: str = "zmrl", quantize_experts: bool = True) -> None:
    """Write ``config.json`` and the weights (sharded with an index when ``max_shard_bytes`` is set).

    ``format="zmrl"``: zmrl's flat config and module names. ``format="k3"``: the released Kimi K3 layout
    (k3_release.py): nested config, ``language_model.`` names, routed experts as MXFP4 when
    ``quantize_experts`` (exact or an error: weights read from MXFP4 write back the same values).
    ``format="hf"``: the transformers config of the model's ``model_type`` (hf_config.py: deepseek_v3,
    deepseek_v32, glm_moe_dsa), with zmrl's tensor names, which are transformers' for those types."""
    if format not in FORMATS:
        raise ValueError(f"save_pretrained: format must be one of {FORMATS}, got {format!r}")
    out = Path(path)
    cfg = model.config
    cfg.torch_dtype = {v: k for k, v in DTYPES.items()}[model.dtype]
    state = {k: v.detach().contiguous().cpu() for k, v in checkpoint_state(model).items()}
    if format == "hf":
        config = config_to_hf(cfg)  # before writing anything: a model it cannot express is refused
    if format == "k3":
        config = config_to_release(cfg, quantized_experts=quantize_experts and cfg.n_routed_experts > 0)
        state = release_state(cfg, state, quantize_experts)
    out.mkdir(parents=True, exist_ok=True)
    if format in ("k3", "hf"):
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        config = {**cfg.to_dict(), "architectures": [ZMRL_ARCHITECTURE]}
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if max_shard_bytes is None:
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _tensor_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    if (path / INDEX_NAME).exists():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (pickled checkpoints are not loaded, by design)")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.update({k: f for k in sf.keys()})
    return names


def _plan(root: Path) -> tuple[ModelConfig, dict[str, tuple[int, ...]], dict[str, Path], dict[str, Source]]:
    """(config, expected zmrl shapes, tensor name -> file, zmrl name -> where it comes from); raises
    ConfigError / CheckpointError naming the field or the missing and unexpected tensors."""
    if not (root / "config.json").exists():
        raise CheckpointError(f"{root}: no config.json")
    try:
        raw = json.loads((root / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{root / 'config.json'}: not valid JSON ({e})") from e
    try:
        cfg = ModelConfig.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{root / 'config.json'}: {e}") from e
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, dtype=torch.float32)
    expected = {k: tuple(v.shape) for k, v in checkpoint_state(model).items()}
    files = _tensor_files(root)
    if is_release_config(raw):
        sources, missing, unexpected, skipped = map_release_tensors(cfg, expected, files, tensor_prefix(raw))
        for reason, names in skipped.items():
            log.info("%s: skipped %d tensor(s) outside the text model (%s), e.g. %s", root, len(names), reason,
                     names[0])
    else:
        sources = {k: Source((k,), "plain") for k in expected if k in files}
        missing = sorted(set(expected) - set(files))
        unexpected = sorted(set(files) - set(expected))
        if is_hf_config(raw):
            # transformers' fused in-memory expert layout, where a file stores it
            available = set(files)
            for k in list(missing):
                fused = fused_expert_source(k, available)
                if fused is not None:
                    sources[k] = Source((fused[0],), f"fused_{fused[1]}", fused[2])
                    missing.remove(k)
            used = {n for src in sources.values() for n in src.names}
            unexpected = sorted(set(files) - used)
            mtp = [n for n in unexpected if skipped_tensor(raw, n)]
            if mtp:
                log.info("%s: skipped %d tensor(s) of the multi-token-prediction layer(s), e.g. %s", root, len(mtp),
                         mtp[0])
                unexpected = sorted(set(unexpected) - set(mtp))
    if missing or unexpected:
        raise CheckpointError(f"{root}: checkpoint does not match the config: missing tensors {missing[:20]}"
                              f"{' ...' if len(missing) > 20 else ''}; unexpected tensors {unexpected[:20]}"
                              f"{' ...' if len(unexpected) > 20 else ''}")
    return cfg, expected, files, sources


def _source_shape(src: Source, shapes: list[tuple[int, ...]], cfg: ModelConfig) -> tuple[int, ...]:
    """The zmrl shape ``src`` gives from its tensors' shapes. A fused expert tensor ([E, ...]) holding
    another number of experts than the config gives its own shape, so the check reports it."""
    if src.kind.startswith("fused_") and (not shapes[0] or shapes[0][0] != cfg.n_routed_experts):
        return shapes[0]
    return converted_shape(src, shapes, cfg.linear_attn_config.num_heads)


def check_checkpoint(path: str | os.PathLike) -> ModelConfig:
    """What ``load_pretrained`` checks before reading any weight, from the safetensors headers only:
    the config parses, and the files hold exactly the tensors it builds (names and shapes, in any
    layout ``load_pretrained`` reads). Returns the config."""
    root = Path(path)
    cfg, expected, files, sources = _plan(root)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted({files[n] for src in sources.values() for n in src.names}):
        with safe_open(str(f), framework="pt") as sf:
            shapes.update({n: tuple(sf.get_slice(n).get_shape()) for n in sf.keys()})
    bad = []
    for k, src in sources.items():
        got = _source_shape(src, [shapes[n] for n in src.names], cfg)
        if got != expected[k]:
            bad.append(f"{'+'.join(src.names)}: checkpoint {got} vs model {expected[k]}")
    if bad:
        raise CheckpointError(f"{root}: mis-shaped tensors: " + "; ".join(dict.fromkeys(bad)))
    return cfg


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu") -> HybridForCausalLM:
    """Load a checkpoint folder (zmrl's format, the released Kimi K3 / Kimi-Linear's, or a transformers
    deepseek_v3 / deepseek_v32 / glm_moe_dsa);
    missing, unexpected or mis-shaped tensors are refused by name. Release tensors outside the text model
    are skipped (logged)."""
    root = Path(path)
    cfg, expected, files, sources = _plan(root)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or DTYPES[cfg.torch_dtype])
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    bad = []
    num_heads = cfg.linear_attn_config.num_heads
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                   for f in sorted({files[n] for src in sources.values() for n in src.names})}

        def read(name: str) -> torch.Tensor:
            return handles[files[name]].get_tensor(name)

        for k, src in sources.items():
            try:
                if src.kind.startswith("fused_"):  # read only this expert's rows of the fused tensor
                    sl = handles[files[src.names[0]]].get_slice(src.names[0])
                    shape = _source_shape(src, [tuple(sl.get_shape())], cfg)
                    if shape != expected[k]:
                        bad.append(f"{src.names[0]}: checkpoint {tuple(sl.get_shape())} vs model {expected[k]} "
                                   f"per expert x {cfg.n_routed_experts} experts")
                        continue
                    t = slice_fused_expert(sl[src.expert:src.expert + 1], src.kind[len("fused_"):], 0).contiguous()
                else:
                    t = convert_tensor(src, read, num_heads)
                    shape = tuple(t.shape)
            except MXFP4Error as e:
                raise CheckpointError(f"{root}: {e}") from e
            if shape != expected[k]:
                bad.append(f"{'+'.join(src.names)}: checkpoint {shape} vs model {expected[k]}")
            state[k] = t
    if bad:
        raise CheckpointError(f"{root}: mis-shaped tensors: " + "; ".join(dict.fromkeys(bad)))
    model = model.to_empty(device="cpu")
    model.tie_weights()
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    # exact for fp32/bf16 sources (and MXFP4, dequantised exactly): fp32 then the model dtype is lossless
    return cast_model(model, dtype).to(device)
