"""zmrl's own RL loop (``RLRunner`` on recipes/aime_lora.yaml) set up to sample what a verl run samples: the
same checkpoint, problems, group size, response length and seed. Shared by the verl tests that compare the
two rollouts."""
from __future__ import annotations

import json
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


def loop_runner(model: str | Path, problems: list[dict], out: Path, prompts_per_step: int, n: int, max_tokens: int,
                seed: int = 0):
    """An ``RLRunner`` whose training set is ``problems`` (in order: step s takes rows s*prompts_per_step ..),
    no evaluation, single-threaded, run folder ``out``."""
    from zmrl.rl.config import load_recipe
    from zmrl.rl.loop import RLRunner

    out.mkdir(parents=True, exist_ok=True)
    train = out / "train.jsonl"
    train.write_text("".join(json.dumps(p) + "\n" for p in problems))
    return RLRunner(load_recipe(str(RECIPE), [
        f"model.path={model}", f"data.train={train}", f"data.prompts_per_step={prompts_per_step}", f"rollout.n={n}",
        f"rollout.max_tokens={max_tokens}", "rollout.num_blocks=64", f"trainer.seed={seed}",
        f"trainer.out_dir={out / 'run'}", "trainer.save_every=0", "trainer.num_threads=1", "eval.every=0",
        "eval.before_training=false", "logging.wandb_mode=disabled"]))


def groups_of(samples) -> dict[tuple[int, ...], list]:
    """Samples by prompt, each prompt's in sample-index order (the loop returns a group's samples in index
    order, and a prompt that comes again continues the numbering)."""
    groups: dict[tuple[int, ...], list] = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    return groups
