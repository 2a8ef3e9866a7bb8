"""``python -m zmrl.train [RECIPE.yaml] [key=value ...]``: GRPO/PPO with LoRA, rollout/trainer parity
logged every step. Without a recipe it runs ``recipes/aime_lora.yaml`` (the README's recipe).

This module imports nothing heavy at import time: ``--help`` answers without loading torch."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# The README's recipe: what ``zmrl train`` runs when no recipe file is given.
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "aime_lora.yaml"


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("recipe", nargs="?", default=None,
                   help=f"YAML recipe (default: {DEFAULT_RECIPE.relative_to(DEFAULT_RECIPE.parents[1])}, "
                        "the README's recipe; the dataclass defaults if that file is not there)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=30")
    p.add_argument("--debug", action="store_true",
                   help="show the full traceback of an error (user errors are one line otherwise)")
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the input is wrong" (one line, exit 2) rather than "zmrl has a bug"."""
    from zmrl.model.checkpoint import CheckpointError
    from zmrl.rl.checkpoint import ResumeError
    from zmrl.rl.cluster import ClusterError
    from zmrl.rl.config import RecipeError

    return RecipeError, ClusterError, ResumeError, CheckpointError


def run_train(args: argparse.Namespace) -> int:
    from zmrl.rl.config import RecipeError, load_recipe

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        overrides.insert(0, recipe)
        recipe = None
    if recipe is None and DEFAULT_RECIPE.is_file():
        recipe = str(DEFAULT_RECIPE)
    debug = getattr(args, "debug", False)
    try:
        cfg = load_recipe(recipe, overrides)
    except RecipeError as e:
        if debug:
            raise
        print(f"zmrl train: error: {e}", file=sys.stderr)
        return 2
    from zmrl.rl.loop import RLRunner, RolloutFailure

    try:
        history = RLRunner(cfg).run()
    except _user_errors() as e:
        if debug:
            raise
        print(f"zmrl train: error: {e}", file=sys.stderr)
        return 2
    except RolloutFailure as e:  # the step is in metrics.jsonl / the dashboard; the cause goes here
        if debug:
            raise
        print(f"zmrl train: error: {e}", file=sys.stderr)
        return 1
    if history:
        last = history[-1]
        logging.getLogger("zmrl.train").info(
            "done: %d steps, last reward %.3f, bitwise-equal fraction %.4f, k3 %.3g; dashboard: %s/dashboard.html",
            last["step"], last["reward/mean"], last["mismatch/bitwise_equal_frac"], last["mismatch/kl_k3"],
            cfg.trainer.out_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_train_arguments(argparse.ArgumentParser(prog="python -m zmrl.train", description=__doc__))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_train(args)


if __name__ == "__main__":
    sys.exit(main())
