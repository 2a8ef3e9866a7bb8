"""Dependencies by need: the core install (torch, safetensors, numpy, pyyaml, tqdm) runs the model,
the engine and the trainer; modules that need an extra stop with one line naming it."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from zmrl.extras import MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
EXTRA_MODULES = ("verl", "ray", "wandb", "datasets", "math_verify", "transformers", "omegaconf", "megatron",
                 "tensordict", "codetiming")

# Runs first in a subprocess: every extra's module fails to import, as in a core-only install.
_BLOCK = f"""
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRA_MODULES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Block())
"""


def _run_core_only(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _BLOCK + code, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_require():
    assert require("json", "rl", "x").dumps([1]) == "[1]"
    with pytest.raises(MissingExtraError) as e:
        require("zmrl_no_such_package.sub", "rl", "loading a recipe")
    msg = str(e.value)
    assert "\n" not in msg and "loading a recipe needs the 'zmrl_no_such_package' package" in msg
    assert "pip install -e '.[rl]'" in msg


def test_pyproject_core_and_extras():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("<")[0] for d in meta["dependencies"]}
    assert core == {"torch", "safetensors", "numpy", "pyyaml", "tqdm"}
    extras = meta["optional-dependencies"]
    assert {"verl", "ray", "wandb", "datasets", "math-verify", "transformers", "omegaconf"} <= \
        {d.split(">")[0].split("=")[0].split("<")[0] for d in extras["rl"]}
    assert extras["parallel"] == ["megatron-core==0.16.1"]
    assert "zmrl[rl,parallel]" in extras["test"] and any(d.startswith("ruff") for d in extras["test"])


def test_model_engine_and_trainer_run_without_extras():
    code = """
import sys, torch
from zmrl.model import ModelConfig, build_model
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer.logprobs import compute_logprobs
model = build_model(ModelConfig.preset("tiny"), seed=0)
out = RolloutEngine(model, EngineConfig(num_blocks=8)).generate([[1, 2, 3]], SamplingParams(max_tokens=3, seed=1))[0]
lp = compute_logprobs(model, [out.prompt_token_ids + out.token_ids], [3], 1.0)[0]
assert torch.equal(lp.detach(), out.logprobs)
import zmrl.parallel
assert not [m for m in sys.modules if m.split(".")[0] in %r]
print("OK")
""" % (EXTRA_MODULES,)
    proc = _run_core_only(code)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-2000:]


def test_rl_without_its_extra_says_which_to_install():
    proc = _run_core_only("import sys; from zmrl.train import main; sys.exit(main(sys.argv[1:]))",
                          str(ROOT / "recipes" / "aime_lora.yaml"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("zmrl train: error: loading a recipe needs the 'omegaconf' package") and "'.[rl]'" in last
    assert "Traceback" not in proc.stderr
