"""``python -m zmrl.train [RECIPE.yaml] [key=value ...]``: GRPO/PPO with LoRA, rollout/trainer parity
logged every step. Without a recipe it runs ``recipes/aime_lora.yaml`` (the README's recipe).

This module imports nothing heavy at import time: ``--help`` answers without loading torch."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from zmrl.extras import MissingExtraError

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


class TqdmLoggingHandler(logging.Handler):
    """Log records printed through ``tqdm.write`` to the current ``sys.stderr`` (looked up per record,
    so a stream swapped out by a test harness or a notebook is never written after it is closed): a
    line never lands inside a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 -- logging must not raise
            self.handleError(record)


def setup_logging(level: int = logging.INFO) -> None:
    """INFO lines to stderr through tqdm (bars stay intact); noisy libraries kept at WARNING."""
    handler = TqdmLoggingHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("datasets", "filelock", "urllib3", "wandb", "ray", "fsspec", "httpx"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run: the same recipe and overrides plus trainer.resume=true."""
    import shlex

    words = [sys.executable.rsplit("/", 1)[-1], "-m", "zmrl.train"]
    if args.recipe:
        words.append(args.recipe)
    words += [o for o in args.overrides if not o.startswith(("trainer.resume=", "trainer.overwrite="))]
    words.append("trainer.resume=true")
    return " ".join(shlex.quote(w) for w in words)


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
    from zmrl.kernels_batch_invariant import NumericsError
    from zmrl.rl.loop import RLRunner, RolloutFailure

    try:
        runner = RLRunner(cfg)
        history = runner.run()
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nzmrl train: interrupted; the run in {cfg.trainer.out_dir} continues from its last checkpoint "
              f"with:\n  {resume_command(args)}", file=sys.stderr)
        return 130
    except (*_user_errors(), NumericsError) as e:
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
        logging.getLogger("zmrl.train").info("%s", summary_line(history, cfg.trainer.out_dir, runner.initial_eval))
    return 0


def summary_line(history: list[dict], out_dir: str, initial_eval: dict | None = None) -> str:
    """The end-of-run line: reward at the start and the end (means of the first and last fifth of the
    steps, not one noisy step), the held-out curve's ends, and the parity verdict over every step."""
    n = max(1, len(history) // 5)
    first = sum(h["reward/mean"] for h in history[:n]) / n
    last = sum(h["reward/mean"] for h in history[-n:]) / n
    tokens = sum(int(h.get("mismatch/tokens_compared", 0)) for h in history)
    equal = all(h.get("mismatch/tokens_compared", 0) > 0 and h["mismatch/bitwise_equal_frac"] == 1.0
                and h["mismatch/kl_k3"] == 0.0 for h in history)
    evals = [(h["step"], v) for h in [{"step": 0, **(initial_eval or {})}, *history]
             for k, v in h.items() if k.startswith("eval/")]
    parts = [f"done: {history[-1]['step']} steps",
             f"mean reward {first:.3f} (first {n} steps) -> {last:.3f} (last {n})"]
    if evals:
        parts.append(f"held-out {evals[0][1]:.3f} (step {evals[0][0]}) -> {evals[-1][1]:.3f} (step {evals[-1][0]})")
    parts.append(f"parity: {tokens} tokens compared, " + ("all bitwise equal, KL 0 at every step" if equal else
                 "NOT bitwise equal at every step (see the dashboard)"))
    parts.append(f"dashboard: {out_dir}/dashboard.html")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = add_train_arguments(argparse.ArgumentParser(prog="python -m zmrl.train", description=__doc__))
    args = parser.parse_args(argv)
    setup_logging(logging.DEBUG if args.debug else logging.INFO)
    try:
        return run_train(args)
    except MissingExtraError as e:  # names the pip extra to install
        print(f"zmrl train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
