"""The kernel-mode switch as a user-facing setting: ``EngineConfig.kernel_mode``, the recipe's
``model.kernel_mode`` and ``zmrl parity --kernel-mode``. Bitwise is the default everywhere; "fast"
swaps in stock kernels (no parity expected) and must reach both the engine and the trainer."""
from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch

import zmrl.kernels_batch_invariant as kbi
from zmrl.model import ModelConfig, build_model
from zmrl.parity import add_parity_subcommand, run_audit
from zmrl.rl.config import RecipeError, load_recipe
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams

from tests.device import TEST_DEVICE


@pytest.fixture(autouse=True)
def _restore_mode():
    before = kbi.get_mode()
    yield
    kbi.set_mode(before)


def test_engine_config_default_and_validation():
    assert EngineConfig().kernel_mode is None  # follows the process mode, "bitwise" by default
    EngineConfig(kernel_mode="fast").validate()
    EngineConfig(kernel_mode="bitwise").validate()
    with pytest.raises(ValueError, match=r"EngineConfig\.kernel_mode must be None .* 'bitwise', 'fast'.*'turbo'"):
        EngineConfig(kernel_mode="turbo").validate()


def _spy_modes(model: torch.nn.Module) -> list[str]:
    seen: list[str] = []
    model.register_forward_pre_hook(lambda *_: seen.append(kbi.get_mode()))
    return seen


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(ModelConfig.preset("tiny"), seed=0, device=TEST_DEVICE)


def test_engine_default_follows_the_process_mode(tiny_model):
    assert kbi.get_mode() == "bitwise"
    engine = RolloutEngine(copy.deepcopy(tiny_model), EngineConfig(num_blocks=8))
    seen = _spy_modes(engine.model)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, seed=1))
    first = len(seen)  # forwards of the first request (on a GPU: graph warm-up + capture, replays run no hooks)
    with kbi.kernel_mode("fast"):
        engine.generate([[4, 5]], SamplingParams(max_tokens=1))
    assert first >= 2 and set(seen[:first]) == {"bitwise"} and seen[first:] == ["fast"]
    assert kbi.get_mode() == "bitwise"


def test_engine_mode_is_applied_and_kept(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="zmrl.rollout.engine"):
        engine = RolloutEngine(copy.deepcopy(tiny_model), EngineConfig(num_blocks=8, kernel_mode="fast"))
    assert kbi.get_mode() == "fast", "an explicit engine mode applies to the process (the trainer follows)"
    assert "not expected to be bitwise equal" in caplog.text
    seen = _spy_modes(engine.model)
    outs = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, seed=1))
    assert len(outs[0].token_ids) == 2 and outs[0].logprobs.device == tiny_model.device
    assert seen == ["fast", "fast"]
    # the process mode changed after the engine was built: the engine keeps its own (and says so)
    kbi.set_mode("bitwise")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zmrl.rollout.engine"):
        engine.generate([[4, 5]], SamplingParams(max_tokens=1))
    assert seen[-1] == "fast" and kbi.get_mode() == "bitwise"
    assert "the engine keeps 'fast'" in caplog.text


def test_recipe_kernel_mode():
    pytest.importorskip("verl")  # recipe validation reads verl's algorithm registries (the rl extra)
    assert load_recipe(None).model.kernel_mode == "bitwise"
    assert load_recipe(None, ["model.kernel_mode=fast"]).model.kernel_mode == "fast"
    with pytest.raises(RecipeError, match="model.kernel_mode.*'turbo'"):
        load_recipe(None, ["model.kernel_mode=turbo"])


def test_recipe_kda_form_reaches_the_runs_numerics():
    pytest.importorskip("verl")
    from zmrl.rl.loop import run_numerics

    default = load_recipe(None)
    assert default.model.kda_form is None and run_numerics(default).kda_form == kbi.current_numerics().kda_form
    for form in ("chunk", "recurrent"):
        assert run_numerics(load_recipe(None, [f"model.kda_form={form}"])).kda_form == form
    with pytest.raises(RecipeError, match="model.kda_form.*'parallel'"):
        load_recipe(None, ["model.kda_form=parallel"])


@pytest.mark.parametrize("field, values, bad", [("kda_recurrent_launch", ("8x1", "32x4"), "64x3"),
                                                 ("mla_mma_rows", ("keys", "heads"), "queries"),
                                                 ("mla_operands", ("bf16", "hi_lo"), "fp8")])
def test_recipe_numerics_choice_reaches_the_runs_numerics(field, values, bad):
    """A model numerics choice of the recipe: null keeps the process's value, a value reaches the run's
    contract, anything else is a one-line RecipeError naming the key and the value."""
    pytest.importorskip("verl")
    from zmrl.rl.loop import run_numerics

    default = load_recipe(None)
    assert getattr(default.model, field) is None
    assert getattr(run_numerics(default), field) == getattr(kbi.current_numerics(), field)
    for value in values:
        assert getattr(run_numerics(load_recipe(None, [f"model.{field}={value}"])), field) == value
    with pytest.raises(RecipeError, match=f"model.{field}.*'{bad}'"):
        load_recipe(None, [f"model.{field}={bad}"])


def test_recipe_file_documents_kernel_mode():
    pytest.importorskip("verl")
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml").read_text()
    assert "kernel_mode: bitwise" in text
    assert load_recipe(str(Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml")).model.kernel_mode \
        == "bitwise"


def test_audit_reports_the_mode_and_restores_it():
    r = run_audit(num_requests=2, seed=4, scenario="basic", steps=0, kernel_mode="fast", device=TEST_DEVICE)
    assert r.details["kernel mode"] == "fast (parity not expected)"
    assert "kernel mode" in r.table()
    assert kbi.get_mode() == "bitwise"
    with pytest.raises(ValueError, match="kernel_mode"):
        run_audit(num_requests=1, kernel_mode="turbo")


def test_cli_kernel_mode_flag():
    parser = argparse.ArgumentParser(prog="zmrl")
    add_parity_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["parity"])
    assert args.kernel_mode == "bitwise" and args.device == "cpu"
    args = parser.parse_args(["parity", "--kernel-mode", "fast", "--device", "cuda:0"])
    assert args.kernel_mode == "fast" and args.device == "cuda:0"
