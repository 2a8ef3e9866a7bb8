"""The zmrl dashboard (zmrl/rl/dashboard.py) of a verl run: verl's metric names mapped onto the same panels.

verl's file logger (``trainer.logger=[...,file]``, path ``VERL_FILE_LOGGER_PATH``) writes one
``{"step": n, "data": {metric: value}}`` line per step. ``verl_records`` turns those into zmrl's metric
records:

* learning: ``critic/score/mean|max`` -> ``reward/mean|max``, ``actor/pg_loss`` -> ``loss/policy``,
  ``response_length/mean`` -> ``response/length_mean``, ``perf/throughput`` -> ``perf/tokens_per_s``,
  ``val-core/<source>/<name>/mean@<n>`` -> ``eval/<source>_mean@<n>``;
* parity: ``rollout_corr/kl`` (mean of log p_rollout - log p_trainer over response tokens, zmrl's k1) ->
  ``mismatch/kl_k1``, ``rollout_corr/k3_kl`` -> ``mismatch/kl_k3``; the response tokens and sequences
  verl compared, ``mismatch/tokens_compared`` / ``mismatch/sequences_compared``, follow from its length
  metrics (sequences = total tokens / (mean prompt + mean response length)) and are 0 at a step whose
  ``training/rollout_probs_diff_valid`` is not 1, so such a step reads "not checked", never "equal".
  verl logs no bitwise-equal fraction and no per-token |Δ log-prob|; its probability-space differences
  (``training/rollout_probs_diff_*``) and the Pearson correlation are kept under their own names.

CLI: ``zmrl verl-dashboard METRICS.jsonl [--out FILE.html]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from zmrl.rl.dashboard import K1, K3, SEQUENCES, TOKENS, render_html

RENAMED = {
    "critic/score/mean": "reward/mean",
    "critic/score/max": "reward/max",
    "actor/pg_loss": "loss/policy",
    "response_length/mean": "response/length_mean",
    "perf/throughput": "perf/tokens_per_s",
    "rollout_corr/kl": K1,
    "rollout_corr/k3_kl": K3,
}
KEPT = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
        "training/rollout_actor_probs_pearson_corr", "rollout_corr/log_ppl_abs_diff", "actor/grad_norm",
        "actor/entropy", "timing_s/step")
_VAL = re.compile(r"^val-core/(?P<source>[^/]+)/[^/]+/mean@(?P<n>\d+)$")


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def verl_record(step: int, data: dict) -> dict:
    """One verl step's metrics as a zmrl metrics record."""
    rec: dict = {"step": step}
    for src, dst in RENAMED.items():
        if (v := _num(data.get(src))) is not None:
            rec[dst] = v
    for key in KEPT:
        if (v := _num(data.get(key))) is not None:
            rec[key] = v
    for key, value in data.items():
        m = _VAL.match(key)
        if m and (v := _num(value)) is not None:
            rec[f"eval/{m['source']}_mean@{m['n']}"] = v
    if K1 in rec or K3 in rec:
        total, prompt, response = (_num(data.get(k)) for k in ("perf/total_num_tokens", "prompt_length/mean",
                                                                 "response_length/mean"))
        checked = data.get("training/rollout_probs_diff_valid") == 1
        if checked and total and prompt is not None and response and math.isfinite(total):
            sequences = round(total / (prompt + response))
            rec[SEQUENCES], rec[TOKENS] = float(sequences), float(round(sequences * response))
        else:
            rec[SEQUENCES], rec[TOKENS] = 0.0, 0.0
    return rec


def read_verl_metrics(path: str | os.PathLike) -> list[dict]:
    """zmrl records of a verl file-logger jsonl (a truncated last line is dropped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("data"), dict) and _num(row.get("step")) is not None:
            records.append(verl_record(int(row["step"]), row["data"]))
    return records


def build_verl_dashboard(metrics_path: str | os.PathLike, out: str | os.PathLike | None = None,
                         run_name: str | None = None) -> Path:
    """Write the dashboard of a verl run (default: ``dashboard.html`` beside the metrics file)."""
    metrics_path = Path(metrics_path)
    out = Path(out) if out else metrics_path.with_name("dashboard.html")
    page = render_html(read_verl_metrics(metrics_path), {"run_name": run_name or metrics_path.stem, "project": "verl"},
                       str(metrics_path.resolve()))
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out


def add_verl_dashboard_subcommand(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verl-dashboard", help="the zmrl dashboard of a verl run's file-logger metrics")
    p.add_argument("metrics", help="verl's metrics jsonl (VERL_FILE_LOGGER_PATH)")
    p.add_argument("--out", default=None, help="HTML file (default: dashboard.html beside the metrics)")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    if not Path(args.metrics).is_file():
        print(f"zmrl verl-dashboard: error: metrics file not found: {args.metrics}", file=sys.stderr)
        return 2
    print(build_verl_dashboard(args.metrics, args.out).resolve().as_uri())
    return 0
