"""The RL loop's health metrics cannot lie: what was compared is logged, an empty comparison is not
"all equal", rollout errors are counted and stop the run past ``rollout.max_error_frac``, and the
dashboard badge is green only when every step compared tokens and all of them were equal."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zmrl.parity import compare_logprobs
from zmrl.rl.config import RecipeError, load_recipe
from zmrl.rl.dashboard import build_dashboard, collect_series, parity_verdict

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _badge_status(run_dir: Path) -> str:
    text = build_dashboard(run_dir).read_text()
    return text.split('id="kl-badge" data-status="', 1)[1].split('"', 1)[0]


def _tiny_model(folder: Path, poison: bool = False) -> Path:
    """An untrained tiny byte-tokenizer checkpoint (the pipeline is under test, not the policy);
    ``poison`` puts NaN into the output head, as a broken checkpoint would."""
    from zmrl.model import build_model, save_pretrained
    from zmrl.rl.bootstrap import tiny_byte_config
    from zmrl.rl.tokenizer import write_byte_tokenizer_marker

    model = build_model(tiny_byte_config(), seed=0, dtype="float32")
    if poison:
        with torch.no_grad():
            model.lm_head.weight.fill_(float("nan"))
    save_pretrained(model, folder)
    write_byte_tokenizer_marker(folder)
    return folder


def _overrides(out_dir: Path, model_dir: Path, steps: int = 1) -> list[str]:
    return [f"trainer.out_dir={out_dir}", f"model.path={model_dir}", f"trainer.total_steps={steps}",
            "trainer.save_every=0", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=4",
            "eval.every=0", "logging.wandb_mode=disabled", "trainer.num_threads=1"]


# ----------------------------------------------------------------------------- the measurement
def test_empty_comparison_is_undefined_not_equal():
    empty = compare_logprobs([], [])
    assert empty.tokens_compared == 0 and empty.sequences_compared == 0 and not empty.ok
    assert math.isnan(empty.bitwise_equal_frac) and math.isnan(empty.kl_k3) and math.isnan(empty.max_abs_dlogp)
    no_tokens = compare_logprobs([torch.zeros(0), torch.zeros(0)], [torch.zeros(0), torch.zeros(0)])
    assert no_tokens.num_sequences == 2 and no_tokens.sequences_compared == 0
    assert math.isnan(no_tokens.bitwise_equal_frac) and not no_tokens.ok


def test_one_ulp_is_a_mismatch():
    roll = [torch.tensor([-0.5, -1.25, -3.0]), torch.tensor([-0.75])]
    train = [t.clone() for t in roll]
    train[0][1] = torch.nextafter(train[0][1], torch.tensor(0.0))  # one float32 ulp towards 0
    r = compare_logprobs(roll, train)
    assert not r.ok and r.tokens_compared == 4 and r.tokens_equal == 3 and r.sequences_compared == 2
    assert r.bitwise_equal_frac == 0.75 and r.max_abs_dlogp == 2.0 ** -23  # the float32 spacing in [1, 2)
    assert r.kl_k1 != 0.0


# ----------------------------------------------------------------------------- the dashboard badge
def _parity_row(step: int, tokens: float, frac: float = 1.0, kl: float = 0.0) -> dict:
    return {"step": step, "mismatch/bitwise_equal_frac": frac, "mismatch/kl_k1": kl, "mismatch/kl_k3": kl,
            "mismatch/max_abs_dlogp": abs(kl), "mismatch/tokens_compared": tokens}


def test_badge_is_green_only_when_every_step_compared_tokens():
    ok = [_parity_row(s, 10) for s in (1, 2, 3)]
    assert parity_verdict(collect_series(ok)).status == "ok"
    assert parity_verdict(collect_series(ok)).tokens_compared == 30
    empty_step = ok[:1] + [_parity_row(2, 0, frac=math.nan, kl=math.nan)] + ok[2:]
    v = parity_verdict(collect_series(empty_step))
    assert v.status == "unchecked" and v.first_bad_step == 2 and "nothing compared" in v.first_bad_detail
    unlogged = [{k: v for k, v in r.items() if k != "mismatch/tokens_compared"} for r in ok]
    assert parity_verdict(collect_series(unlogged)).status == "unchecked"
    off = empty_step + [_parity_row(4, 10, frac=0.9, kl=1e-9)]
    v = parity_verdict(collect_series(off))
    assert v.status == "mismatch" and v.first_bad_step == 4  # a real mismatch wins over "unchecked"


# ----------------------------------------------------------------------------- the loop
def test_max_error_frac_is_validated():
    with pytest.raises(RecipeError, match=r"rollout.max_error_frac.*\[0, 1\]"):
        load_recipe(str(RECIPE), ["rollout.max_error_frac=1.5"])
    with pytest.raises(RecipeError, match=r"rollout.prefix_cache_kda_gib.*>= 0"):
        load_recipe(str(RECIPE), ["rollout.prefix_cache_kda_gib=-2"])


def test_nan_weights_stop_the_run_and_turn_the_badge_red(tmp_path):
    """Every rollout of a NaN checkpoint ends in "non-finite logits": the step is logged with 0 tokens
    compared, an undefined (NaN) equal fraction and its error count, and the run stops with the cause."""
    from zmrl.rl.loop import RLRunner, RolloutFailure

    model = _tiny_model(tmp_path / "nan_model", poison=True)
    run_dir = tmp_path / "run"
    runner = RLRunner(load_recipe(str(RECIPE), _overrides(run_dir, model, steps=3)))
    with pytest.raises(RolloutFailure, match=r"step 1: 4 of 4 rollouts failed .*rollout.max_error_frac=0.5.*"
                                             r"non-finite logits"):
        runner.run()
    (rec,) = _records(run_dir)
    assert rec["step"] == 1 and rec["mismatch/tokens_compared"] == 0 and rec["mismatch/sequences_compared"] == 0
    assert math.isnan(rec["mismatch/bitwise_equal_frac"]) and rec["rollout/errors"] == 4
    assert rec["rollout/error_frac"] == 1.0 and rec["reward/mean"] == 0.0
    assert _badge_status(run_dir) == "unchecked"
    assert not (run_dir / "checkpoints").exists()  # stopped before any update


def test_one_ulp_in_the_loop_turns_the_badge_red(tmp_path, monkeypatch):
    """A rollout log-prob off by one ulp (as a slightly different kernel would give) is caught by the
    per-step parity check, logged, and shown red; a healthy run of the same model is green."""
    from zmrl.rl import loop

    model = _tiny_model(tmp_path / "model")
    healthy = tmp_path / "healthy"
    loop.RLRunner(load_recipe(str(RECIPE), _overrides(healthy, model))).run()
    (rec,) = _records(healthy)
    assert rec["mismatch/bitwise_equal_frac"] == 1.0 and rec["mismatch/tokens_compared"] == 16
    assert rec["mismatch/sequences_compared"] == 4 and rec["rollout/errors"] == 0
    assert _badge_status(healthy) == "ok"

    rollout = loop.RLRunner._rollout

    def off_by_one_ulp(self, *args, **kwargs):
        batch = rollout(self, *args, **kwargs)
        lp = batch.samples[0].logprobs
        lp[0] = torch.nextafter(lp[0], torch.tensor(0.0, dtype=lp.dtype))
        return batch

    monkeypatch.setattr(loop.RLRunner, "_rollout", off_by_one_ulp)
    broken = tmp_path / "broken"
    loop.RLRunner(load_recipe(str(RECIPE), _overrides(broken, model))).run()
    (rec,) = _records(broken)
    assert rec["mismatch/bitwise_equal_frac"] == 15 / 16 and 0 < rec["mismatch/max_abs_dlogp"] < 1e-6
    assert _badge_status(broken) == "mismatch"


def test_backward_matmul_precision_reaches_the_numerics(tmp_path):
    """trainer.backward_matmul_precision is part of the run's numerics contract (carried to Ray actors too)."""
    from zmrl.kernels_batch_invariant import apply_numerics, current_numerics
    from zmrl.rl.loop import RLRunner

    before = current_numerics()
    try:
        runner = RLRunner(load_recipe(str(RECIPE), _overrides(tmp_path / "run", _tiny_model(tmp_path / "model")) +
                                      ["trainer.backward_matmul_precision=bf16"]))
        runner.close()
        assert runner.numerics.backward_matmul_precision == "bf16"
        assert current_numerics().backward_matmul_precision == "bf16"
    finally:
        apply_numerics(before)
