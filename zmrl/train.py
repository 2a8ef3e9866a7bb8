"""``python -m zmrl.train RECIPE.yaml [key=value ...]``: GRPO/PPO with LoRA, rollout/trainer parity logged
every step."""
from __future__ import annotations

import argparse
import logging
import sys

from zmrl.extras import MissingExtraError


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("recipe", nargs="?", default=None, help="YAML recipe (default: the embedded default)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=30")
    return p


def run_train(args: argparse.Namespace) -> int:
    from zmrl.rl.config import RecipeError, load_recipe

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        overrides.insert(0, recipe)
        recipe = None
    try:
        cfg = load_recipe(recipe, overrides)
    except RecipeError as e:
        print(f"zmrl train: error: {e}", file=sys.stderr)
        return 2
    from zmrl.kernels_batch_invariant import NumericsError
    from zmrl.rl.cluster import ClusterError
    from zmrl.rl.loop import RLRunner

    try:
        history = RLRunner(cfg).run()
    except (ClusterError, NumericsError) as e:  # the cluster cannot host the groups / the two sides' numerics differ
        print(f"zmrl train: error: {e}", file=sys.stderr)
        return 2
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
    try:
        return run_train(args)
    except MissingExtraError as e:  # names the pip extra to install
        print(f"zmrl train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
