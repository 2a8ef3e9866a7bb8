"""Atomic RL checkpoints: LoRA adapter (PEFT format), optimiser state, RNG state and step.

Everything is safetensors + JSON (no pickle). A checkpoint is written to ``step_N.tmp`` and renamed
to ``step_N`` in one ``os.replace``; ``latest`` names the newest complete one.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zmrl.lora import load_adapter, save_adapter


class ResumeError(ValueError):
    """The checkpoint does not match the model or recipe."""


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = {}, {"param_groups": [], "steps": {}}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        st = opt.state.get(p, {})
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{i}.{k}"] = v.detach().contiguous()
    for g in opt.param_groups:
        meta["param_groups"].append({k: v for k, v in g.items() if k != "params"})
    meta["num_params"] = len(params)
    return tensors, meta


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict | None = None) -> Path:
    root = Path(root)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_adapter(model, tmp / "adapter")
    tensors, meta = _optimizer_tensors(optimizer)
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "optimizer": meta, **(extra or {})}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    root = Path(root)
    if not (root / "latest").exists():
        return None
    path = root / (root / "latest").read_text().strip()
    return path if path.exists() else None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore adapter, optimiser and RNG; returns trainer_state.json."""
    path = Path(path)
    state = json.loads((path / "trainer_state.json").read_text())
    try:
        load_adapter(model, path / "adapter")
    except (ValueError, FileNotFoundError) as e:
        raise ResumeError(f"{path}: checkpoint does not match the model: {e}") from e
    tensors = load_file(str(path / "optimizer.safetensors"))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if state["optimizer"]["num_params"] != len(params):
        raise ResumeError(f"{path}: optimizer state has {state['optimizer']['num_params']} parameters, "
                          f"the model has {len(params)} LoRA parameters")
    for i, p in enumerate(params):
        # moments onto the parameter's device (a trainer on a GPU); AdamW keeps its "step" on the CPU
        st = {k.split(".", 1)[1]: v if k.endswith(".step") else v.to(p.device)
              for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
        if st:
            if st["exp_avg"].shape != p.shape:
                raise ResumeError(f"{path}: optimizer state for parameter {i} has shape "
                                  f"{tuple(st['exp_avg'].shape)}, the parameter {tuple(p.shape)}")
            optimizer.state[p] = st
    for g, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
        g.update(saved)
    torch.set_rng_state(tensors["rng.torch"])
    return state
