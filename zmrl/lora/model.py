"""Attach LoRA to a model, and save/load adapters in the PEFT format."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zmrl.model.layers import Linear
from zmrl.model.moe import MoE

from .config import ATTENTION_TARGETS, EXPERT_TARGETS, LoraConfig
from .layers import ExpertLoRA, LoraAdapter

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _is_target(name: str, cfg: LoraConfig) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in cfg.target_modules:
        return False
    if ".self_attn." in name:
        return leaf in ATTENTION_TARGETS
    return ".mlp.shared_experts." in name and leaf in EXPERT_TARGETS


@torch.no_grad()
def apply_lora(model: torch.nn.Module, cfg: LoraConfig | None = None) -> torch.nn.Module:
    """Add LoRA to every targeted projection; afterwards only LoRA parameters are trainable.

    A and B are initialised from ``cfg.init_seed`` (A: Kaiming-uniform as in PEFT; B: zeros, or
    N(0, init_b_std) for tests that need a non-trivial adapter)."""
    cfg = cfg or LoraConfig()
    pcfg = getattr(model, "parallel_config", None)
    if pcfg is not None and (pcfg.virtual_shards > 1 or pcfg.ep > 1):
        # sharded pieces would get independent adapters (and no gradient sync): shard after this
        raise ValueError("apply_lora: the model is already sharded by zmrl.parallel.shard_model; apply LoRA "
                         "(or load the adapter) to the full model first, then shard it")
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.init_seed)
    device = next(model.parameters()).device

    def init(a: torch.Tensor, b: torch.Tensor) -> None:
        bound = 1.0 / math.sqrt(a.shape[-1])
        a.copy_((torch.rand(a.shape, generator=gen) * 2 - 1) * bound)
        b.copy_(torch.randn(b.shape, generator=gen) * cfg.init_b_std)

    for name, module in model.named_modules():
        if isinstance(module, Linear) and _is_target(name, cfg):
            module.adapter = LoraAdapter(module.in_features, module.out_features, cfg.r, cfg.scale).to(device)
            init(module.adapter.lora_A, module.adapter.lora_B)
        elif isinstance(module, MoE):
            projs = tuple(p for p in EXPERT_TARGETS if p in cfg.target_modules)
            if projs:
                first = module.experts[0]
                lora = ExpertLoRA(len(module.experts), first.gate_proj.in_features, first.gate_proj.out_features,
                                  cfg.r, cfg.scale, projs).to(device)
                for p in projs:
                    init(getattr(lora, f"{p}_lora_A"), getattr(lora, f"{p}_lora_B"))
                module.experts_lora = lora
    model.lora_config = cfg
    return model


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if _is_lora_name(n)]


def _is_lora_name(name: str) -> bool:
    return ".adapter.lora_" in name or ".experts_lora." in name


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors under the model's own parameter names."""
    return {n: p.detach() for n, p in model.named_parameters() if _is_lora_name(n)}


@torch.no_grad()
def load_lora_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy LoRA tensors into a model that already has adapters (e.g. the engine's copy)."""
    own = dict((n, p) for n, p in model.named_parameters() if _is_lora_name(n))
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"LoRA state does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}")
    for n, p in own.items():
        if p.shape != state[n].shape:
            raise ValueError(f"LoRA tensor {n}: got {tuple(state[n].shape)}, expected {tuple(p.shape)}")
        p.copy_(state[n])


# ---------------------------------------------------------------------- PEFT format
_EXPERT_RE = re.compile(r"^(.*)\.mlp\.experts_lora\.(gate_proj|up_proj|down_proj)_lora_([AB])$")


def to_peft_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT names: ``base_model.model.<module>.lora_A.weight`` [r, in] / ``lora_B.weight`` [out, r];
    batched expert tensors are written per expert (``...mlp.experts.{e}.gate_proj.lora_A.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in lora_state_dict(model).items():
        m = _EXPERT_RE.match(name)
        if m:
            prefix, proj, ab = m.groups()
            for e in range(t.shape[0]):
                out[f"{PEFT_PREFIX}{prefix}.mlp.experts.{e}.{proj}.lora_{ab}.weight"] = t[e].contiguous()
        else:
            module, ab = name.rsplit(".adapter.lora_", 1)
            out[f"{PEFT_PREFIX}{module}.lora_{ab}.weight"] = t.contiguous()
    return out


def from_peft_state_dict(model: torch.nn.Module, peft: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``to_peft_state_dict`` for this model's adapters (experts re-batched).

    Raises ValueError naming a tensor the model needs that ``peft`` lacks, or one that ``peft`` holds
    but no adapter of the model takes (an adapter for another architecture must not load partially)."""
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, p in lora_state_dict(model).items():
        m = _EXPERT_RE.match(name)
        if m:
            prefix, proj, ab = m.groups()
            keys = [f"{PEFT_PREFIX}{prefix}.mlp.experts.{e}.{proj}.lora_{ab}.weight" for e in range(p.shape[0])]
            absent = [k for k in keys if k not in peft]
            if absent:
                raise ValueError(f"adapter is missing tensor {absent[0]}")
            state[name] = torch.stack([peft[k] for k in keys])
        else:
            module, ab = name.rsplit(".adapter.lora_", 1)
            key = f"{PEFT_PREFIX}{module}.lora_{ab}.weight"
            if key not in peft:
                raise ValueError(f"adapter is missing tensor {key}")
            keys = [key]
            state[name] = peft[key]
        used.update(keys)
    unexpected = sorted(set(peft) - used)
    if unexpected:
        raise ValueError(f"adapter has {len(unexpected)} tensor(s) that no LoRA module of the model takes, "
                         f"e.g. {unexpected[:3]}")
    return state


def save_adapter(model: torch.nn.Module, path: str | os.PathLike, base_model_name_or_path: str = "") -> None:
    cfg: LoraConfig = model.lora_config
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_peft_state_dict(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.r, "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.target_modules), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": False, "base_model_name_or_path": base_model_name_or_path,
    }, indent=2) + "\n")


def load_adapter(model: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """Apply LoRA as described by ``adapter_config.json`` (if not applied yet) and load the weights.

    A model that already has adapters must have the file's r, lora_alpha and target_modules (else the
    weights would be applied with another scale, or only partly). ``lora_dropout`` is a training-time
    setting that zmrl never applies (dropout 0 on the parity path), so a file's value is ignored."""
    root = Path(path)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (root / f).exists():
            raise FileNotFoundError(f"{root}: no {f}")
    meta = json.loads((root / ADAPTER_CONFIG).read_text())
    file_cfg = LoraConfig(r=meta["r"], alpha=meta["lora_alpha"], target_modules=tuple(meta["target_modules"]))
    own: LoraConfig | None = getattr(model, "lora_config", None)
    if own is None:
        apply_lora(model, file_cfg)
    else:
        for field, ours, theirs in (("r", own.r, file_cfg.r), ("lora_alpha", own.alpha, file_cfg.alpha),
                                    ("target_modules", sorted(own.target_modules), sorted(file_cfg.target_modules))):
            if ours != theirs:
                raise ValueError(f"{root}: adapter has {field}={theirs}, but the model's LoRA has {field}={ours}")
    load_lora_state_dict(model, from_peft_state_dict(model, load_file(str(root / ADAPTER_WEIGHTS))))
    return model
