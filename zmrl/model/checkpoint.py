"""HF-style checkpoints: ``config.json`` + ``*.safetensors`` (never pickle)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .model import DTYPES, HybridForCausalLM, cast_model, checkpoint_state

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: the message names the tensors."""


def save_pretrained(model: HybridForCausalLM, path: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (sharded with an index when ``max_shard_bytes`` is set)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    cfg.torch_dtype = {v: k for k, v in DTYPES.items()}[model.dtype]
    cfg.to_json(out / "config.json")
    state = {k: v.detach().contiguous().cpu() for k, v in checkpoint_state(model).items()}
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


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu") -> HybridForCausalLM:
    """Load a checkpoint folder; missing, unexpected or mis-shaped tensors are refused by name."""
    root = Path(path)
    if not (root / "config.json").exists():
        raise CheckpointError(f"{root}: no config.json")
    cfg = ModelConfig.from_json(root / "config.json")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or DTYPES[cfg.torch_dtype])
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, dtype=torch.float32)
    expected = {k: tuple(v.shape) for k, v in checkpoint_state(model).items()}
    files = _tensor_files(root)
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(set(files) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{root}: checkpoint does not match the config: missing tensors {missing[:20]}"
                              f"{' ...' if len(missing) > 20 else ''}; unexpected tensors {unexpected[:20]}"
                              f"{' ...' if len(unexpected) > 20 else ''}")
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    bad = []
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in keys:
                t = sf.get_tensor(k)
                if tuple(t.shape) != expected[k]:
                    bad.append(f"{k}: checkpoint {tuple(t.shape)} vs model {expected[k]}")
                state[k] = t
    if bad:
        raise CheckpointError(f"{root}: mis-shaped tensors: " + "; ".join(bad))
    model = model.to_empty(device="cpu")
    model.tie_weights()
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    # exact for fp32/bf16 sources: upcasting to fp32 then back to the file's dtype is lossless
    return cast_model(model, dtype).to(device)
