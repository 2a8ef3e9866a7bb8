"""The embedded demo learns: a shortened version of the README's main job raises the held-out reward.

Shortened to stay near a few minutes on a quiet two-core machine: the bootstrap's task is the default
one (the teacher boxes a quarter of its answers) on operands 0..5, so 80 SFT steps do what 120 do on
0..9; the RL run is 6 steps at lr 2e-3; problems go through .jsonl files, so the real loop, data and
eval paths run. Everything is
seeded and single-threaded, so the run is deterministic (the same bits on the same torch build and CPU
kernels). The assertion is a floor below the measured numbers (``MEASURED``), not their exact values,
so that another CPU's kernels (a different summation order) do not fail a run that learns as well;
the parity checks are exact at every step."""
from __future__ import annotations

import json
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"

# Held-out mean reward (32 problems x 2 samples) before the first update and after step 6, measured on
# the 2-core CPU box with exactly this file's settings.
MEASURED = {"before": 0.046875, "after": 0.703125}  # 339 s, other jobs on both cores (after the rollout_seed change)
MIN_GAIN = 0.3


def _write(path: Path, problems: list[dict]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    return path


def test_shortened_demo_raises_the_heldout_reward(tmp_path):
    from zmrl.rl.bootstrap import BootstrapRecipe, bootstrap_model
    from zmrl.rl.config import load_recipe
    from zmrl.rl.loop import RLRunner
    from zmrl.rl.synthetic import HELDOUT_SEED, TaskSpec, make_dataset

    task = TaskSpec(add_max=5, sub_max=5)
    t0 = time.perf_counter()
    model = bootstrap_model(tmp_path / "boot", recipe=BootstrapRecipe(task=task, max_steps=80), evaluate=False,
                            progress=False)
    train = _write(tmp_path / "train.jsonl", make_dataset(48, seed=7, spec=task))
    heldout = _write(tmp_path / "heldout.jsonl", make_dataset(32, seed=HELDOUT_SEED, spec=task))
    steps = 6
    cfg = load_recipe(str(RECIPE), [
        f"trainer.out_dir={tmp_path}/run", f"model.path={model}", f"data.train={train}", f"data.eval={heldout}",
        f"trainer.total_steps={steps}", "trainer.save_every=0", "data.prompts_per_step=8", "rollout.n=4", "trainer.lr=0.002",
        f"eval.every={steps}", "eval.n=2", "logging.wandb_mode=disabled", "trainer.num_threads=1"])
    history = RLRunner(cfg).run()
    elapsed = time.perf_counter() - t0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/heldout_mean@2"]) for r in rows if "eval/heldout_mean@2" in r]
    print(f"held-out curve {curve}, step rewards {[round(h['reward/mean'], 3) for h in history]}, {elapsed:.0f} s")
    assert [s for s, _ in curve] == [0, steps]
    for h in history:  # learning never costs the contract
        assert h["mismatch/tokens_compared"] > 0 and h["mismatch/bitwise_equal_frac"] == 1.0
        assert h["mismatch/kl_k3"] == 0.0 and h["rollout/errors"] == 0
    (_, before), (_, after) = curve
    assert after - before >= MIN_GAIN, (curve, MEASURED)
