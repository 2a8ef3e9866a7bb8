"""``zmrl`` command line: one subcommand per job."""
from __future__ import annotations

import argparse
import logging
import sys

from zmrl.extras import MissingExtraError


def _smoke(args: argparse.Namespace) -> int:
    from zmrl.smoke import run_smoke

    r = run_smoke(preset=args.preset, dtype=args.dtype, num_prompts=args.num_prompts,
                  max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"{'tokens compared':<24}{r.tokens_compared}")
    print(f"{'bitwise equal':<24}{r.tokens_equal} ({r.tokens_equal / max(r.tokens_compared, 1):.4f})")
    print(f"{'max |dlogp|':<24}{r.max_abs_diff:.3e}")
    print(f"{'decode tokens/s':<24}{r.decode_tokens_per_s:.1f}")
    print("PASS: engine and trainer log-probs are bitwise equal" if r.ok else "FAIL: log-prob mismatch")
    return 0 if r.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zmrl", description="zero-mismatch RL toolkit")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("smoke", help="decode with the engine path, recompute with the trainer path, compare bitwise")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_smoke)

    from zmrl.rollout.planner import add_plan_subcommand
    from zmrl.train import add_train_arguments, run_train

    add_plan_subcommand(sub)
    p = add_train_arguments(sub.add_parser("train", help="run an RL recipe (GRPO/PPO with LoRA)"))
    p.set_defaults(func=run_train)
    from zmrl.parity import add_parity_subcommand
    from zmrl.rl.dashboard import add_dashboard_subcommand

    add_parity_subcommand(sub)
    add_dashboard_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MissingExtraError as e:  # names the pip extra to install
        print(f"zmrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
