"""Optional dependencies, grouped into the pip extras of pyproject.toml.

The core install (torch, safetensors, numpy, pyyaml, tqdm) runs the model, the kernels, the rollout
engine and the trainer. The RL loop needs the ``rl`` extra (verl, ray, omegaconf, transformers,
datasets, wandb, math-verify); megatron-core's process groups are the ``parallel`` extra (without it
``zmrl.parallel`` builds the same groups with torch.distributed). Modules import these lazily through
``require``, so a missing one stops with a one-line message naming the extra to install.
"""
from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the pip extra that provides it."""


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """``import module``, or raise MissingExtraError: "<needed_for> needs <package> (pip install -e '.[extra]')"."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = (e.name or module).split(".")[0]
        raise MissingExtraError(f"{needed_for} needs the '{package}' package, which is not installed: "
                                f"pip install -e '.[{extra}]' (from a checkout) or pip install 'zmrl[{extra}]'") from None
