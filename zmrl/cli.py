"""``zmrl`` command line: one subcommand per job.

Building the parser imports nothing heavy: ``zmrl --help`` and ``zmrl train --help`` answer without
loading torch. The subcommands whose options live next to their code (``plan``, ``parity``, ``convert``,
``verl-prepare``, ``verl-dashboard``) are listed
with a short help and their real parser is built only when one of them is run."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from zmrl.extras import MissingExtraError

# name -> (module, function registering the subcommand on a subparsers object, one-line help)
_LAZY = {
    "plan": ("zmrl.capacity.planner", "add_plan_subcommand", "KV-cache capacity: tokens and full-length contexts "
             "that fit"),
    "parity": ("zmrl.parity.audit", "add_parity_subcommand", "randomized rollout/trainer log-prob parity audit on the "
               "tiny model"),
    "convert": ("zmrl.model.convert", "add_convert_subcommand", "what a checkpoint folder maps to in zmrl; a zmrl-ready "
                "copy only when something must change"),
    "verl-prepare": ("zmrl.integrations.verl.data", "add_verl_prepare_subcommand", "parquet data + a verl-readable "
                     "checkpoint for verl's main_ppo (README: verl)"),
    "verl-dashboard": ("zmrl.integrations.verl.dashboard", "add_verl_dashboard_subcommand", "the zmrl dashboard of "
                       "a verl run's metrics (verl's file logger)"),
}


def _smoke(args: argparse.Namespace) -> int:
    print(f"zmrl smoke: building the {args.preset} model, decoding {args.num_prompts} prompts x "
          f"{args.max_new_tokens} tokens with the engine, recomputing them with the trainer ...", file=sys.stderr,
          flush=True)
    from zmrl.model.config import ConfigError
    from zmrl.parity.smoke import run_smoke

    try:
        r = run_smoke(preset=args.preset, dtype=args.dtype, num_prompts=args.num_prompts,
                      max_new_tokens=args.max_new_tokens, seed=args.seed)
    except ConfigError as e:  # an unknown preset: a user error, as in `zmrl plan`
        print(f"zmrl smoke: error: {e}", file=sys.stderr)
        return 2
    print(f"{'tokens compared':<24}{r.tokens_compared}")
    frac = f"{r.tokens_equal / r.tokens_compared:.4f}" if r.tokens_compared else "undefined: nothing compared"
    print(f"{'bitwise equal':<24}{r.tokens_equal} ({frac})")
    print(f"{'max |dlogp|':<24}{r.max_abs_diff:.3e}")
    print(f"{'decode tokens/s':<24}{r.decode_tokens_per_s:.1f}")
    print("PASS: engine and trainer log-probs are bitwise equal" if r.ok else "FAIL: log-prob mismatch")
    return 0 if r.ok else 1


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser(real: str | None = None) -> argparse.ArgumentParser:
    """The ``zmrl`` parser; ``real`` names a lazy subcommand whose full parser is built (imports its module)."""
    from zmrl.rl.dashboard import add_dashboard_subcommand
    from zmrl.train import add_train_arguments, run_train

    parser = argparse.ArgumentParser(prog="zmrl", description="zero-mismatch RL toolkit")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("smoke", help="decode with the engine path, recompute with the trainer path, compare bitwise")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=_positive_int, default=4)
    p.add_argument("--max-new-tokens", type=_positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_smoke)
    p = add_train_arguments(sub.add_parser("train", help="run an RL recipe (GRPO/PPO with LoRA); no recipe: the "
                                                          "README's recipes/aime_lora.yaml"))
    p.set_defaults(func=run_train)
    for name, (module, register, help_text) in _LAZY.items():
        if name == real:
            getattr(importlib.import_module(module), register)(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False).set_defaults(func=None)
    add_dashboard_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A lazy subcommand's stub takes anything (its own parser reads it below): unknown options pass here.
    args, unknown = build_parser().parse_known_args(argv)
    if args.func is None:  # a lazy subcommand: parse again with its real parser
        args = build_parser(real=args.command).parse_args(argv)
    elif unknown:  # any other subcommand: argparse's own one-line error
        build_parser().parse_args(argv)
    from zmrl.train import setup_logging

    setup_logging(logging.DEBUG if args.verbose or getattr(args, "debug", False) else logging.INFO)
    if args.command == "parity":  # the audit prints its table only at the end: say what is running
        print(f"zmrl parity: auditing {args.num_requests} requests over {args.steps + 1} rollout round(s) "
              f"(seed {args.seed}, scenario {args.scenario}, {args.device}) ...", file=sys.stderr, flush=True)
    try:
        return args.func(args)
    except MissingExtraError as e:  # names the pip extra to install
        print(f"zmrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
