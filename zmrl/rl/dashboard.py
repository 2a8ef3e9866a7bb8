"""A self-contained HTML dashboard of one run: ``run_dir/metrics.jsonl`` -> ``run_dir/dashboard.html``.

One file, inline CSS and server-rendered inline SVG: no scripts, fonts or network, so it opens
from disk in any browser, offline, and renders identically with JavaScript off. Every chart is a
``<figure class="chart" data-metric=PRIMARY data-metrics="A B ...">``; each series is a
``<g class="series" data-metric=NAME>`` whose markers carry ``data-step`` / ``data-value``
(``repr`` of the float, or ``NaN`` / ``Infinity`` / ``-Infinity``), so tools and tests can read the
plotted data back out of the rendered DOM. Hovering a marker shows its value (SVG ``<title>``).

The header carries the run summary and the parity badge (``#kl-badge``): green "rollout/trainer
KL = 0 at every step" when every step that logged ``mismatch/*`` metrics has bitwise-equal fraction
1.0 and k3 KL (and k1 KL, max |Δlogp|, when logged) exactly 0.0; red with the first offending step
otherwise; grey when no parity metrics were logged yet.

CLI: ``zmrl dashboard RUN_DIR`` (``add_dashboard_subcommand``) or ``python -m zmrl.rl.dashboard RUN_DIR``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import html
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from zmrl.rl.run_files import DASHBOARD_FILE, METRICS_FILE, RUN_FILE, RunStatus, read_metrics, read_status
REFRESH_S = 30          # live dashboards (written while the run is going) reload themselves
MAX_MARKERS = 400       # markers per series; the line always uses every point
COLORS = ("#2563eb", "#f59e0b", "#10b981", "#8b5cf6", "#ef4444", "#0ea5e9")

FRAC = "mismatch/bitwise_equal_frac"
DLOGP = "mismatch/max_abs_dlogp"
K1 = "mismatch/kl_k1"
K3 = "mismatch/kl_k3"
TOKENS = "mismatch/tokens_compared"
SEQUENCES = "mismatch/sequences_compared"
ERRORS = "rollout/error_frac"
# metric -> the value a zero-mismatch step must show exactly
PARITY_TARGETS = {FRAC: 1.0, DLOGP: 0.0, K1: 0.0, K3: 0.0}

Point = tuple[int, float]  # (step, value); value may be NaN/inf


@dataclass(frozen=True)
class ChartSpec:
    """One panel: a title, the metrics it overlays, and how to pick its y-range."""

    title: str
    metrics: tuple[str, ...]
    note: str = ""
    include_zero: bool = False             # y-range always contains 0 (non-negative quantities)
    y_bounds: tuple[float, float] | None = None   # y-range always contains these
    flat_range: tuple[float, float] | None = None  # y-range of a constant series (default: around it)
    eval_points: bool = False              # sparse eval points: bigger markers


LEARNING = "Learning"
PARITY = "Rollout / trainer parity"


def _eval_metrics(keys: Iterable[str]) -> list[str]:
    """The eval/* metrics (held-out split, AIME sets, a file), aime25 first as the headline when logged."""
    evals = sorted(k for k in keys if k.startswith("eval/"))
    return [k for k in evals if k.startswith("eval/aime25")] + [k for k in evals if not k.startswith("eval/aime25")]


def _learning_specs(keys: Iterable[str]) -> list[ChartSpec]:
    evals = _eval_metrics(keys)
    title = "AIME mean@8" if evals and all(k.startswith("eval/aime") for k in evals) else "Held-out eval"
    return [
        ChartSpec("Reward", ("reward/mean", "reward/max"), "mean (and max) reward of the step's rollouts"),
        ChartSpec(title, tuple(evals) or ("eval/aime25_mean@8",),
                  "eval: mean reward over n samples of problems never trained on (step 0: before any update)",
                  include_zero=True, y_bounds=(0.0, 1.0), eval_points=True),
        ChartSpec("Policy loss", ("loss/policy",), "PPO/GRPO clipped surrogate"),
        ChartSpec("Response length", ("response/length_mean",), "mean tokens per response", include_zero=True),
        ChartSpec("Throughput", ("perf/tokens_per_s",), "tokens per second", include_zero=True),
    ]


PARITY_SPECS = [
    # Not pinned to [0, 1]: a drop to 0.9987 must be visible, so the axis spans [min, 1] and only an
    # all-1.0 series gets the [0, 1] band.
    ChartSpec("Bitwise-equal fraction", (FRAC,), "tokens with lp_roll == lp_train · target 1",
              y_bounds=(1.0, 1.0), flat_range=(0.0, 1.0)),
    ChartSpec("Max |Δ log-prob|", (DLOGP,), "max |lp_roll − lp_train| · target 0", include_zero=True),
    ChartSpec("KL (k1)", (K1,), "k1 estimate of KL(rollout ‖ trainer) · target 0", include_zero=True),
    ChartSpec("KL (k3)", (K3,), "k3 estimate of KL(rollout ‖ trainer) · target 0", include_zero=True),
    ChartSpec("Compared", (TOKENS, SEQUENCES), "response tokens and sequences compared · must be > 0 "
              "(0: nothing was checked)", include_zero=True),
    ChartSpec("Rollout errors", (ERRORS,), "fraction of the step's rollouts that ended in an error · target 0",
              y_bounds=(0.0, 1.0)),
]


# ---------------------------------------------------------------------- data
def _numeric(v: object) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def collect_series(records: Sequence[dict]) -> dict[str, list[Point]]:
    """metric -> [(step, value)] sorted by step; a later record for the same step wins."""
    by_metric: dict[str, dict[int, float]] = {}
    for rec in records:
        step = _numeric(rec.get("step"))
        if step is None or not math.isfinite(step):
            continue
        for key, value in rec.items():
            if key in ("step", "time"):
                continue
            v = _numeric(value)
            if v is not None:
                by_metric.setdefault(key, {})[int(step)] = v
    return {k: sorted(d.items()) for k, d in by_metric.items()}


@dataclass
class ParityVerdict:
    status: str                 # "ok" | "mismatch" | "unchecked" | "none"
    steps_checked: int
    first_bad_step: int | None = None
    first_bad_detail: str = ""
    bad_steps: int = 0
    tokens_compared: int = 0    # over all steps


def parity_verdict(series: dict[str, list[Point]]) -> ParityVerdict:
    """Is every step that logged parity metrics exactly on-policy *and* actually checked?

    Green ("ok") needs, at every step, ``mismatch/tokens_compared`` > 0 and the parity metrics on
    target (frac 1.0, KLs/Δlogp 0.0). A step that compared nothing (every rollout failed, or an old
    history without token counts) is "unchecked": an empty comparison proves nothing. A step off target
    is a "mismatch", which wins over "unchecked"."""
    per_step: dict[int, dict[str, float]] = {}
    for metric in (*PARITY_TARGETS, TOKENS):
        for step, v in series.get(metric, []):
            per_step.setdefault(step, {})[metric] = v
    per_step = {s: m for s, m in per_step.items() if set(m) - {TOKENS}}  # steps with a parity metric
    if not per_step:
        return ParityVerdict("none", 0)
    off: list[tuple[int, str]] = []
    unchecked: list[tuple[int, str]] = []
    total = 0
    for step in sorted(per_step):
        values = per_step[step]
        tokens = values.get(TOKENS)
        if tokens is not None and math.isfinite(tokens):
            total += int(tokens)
        if tokens is None:
            unchecked.append((step, "tokens compared not logged"))
        elif not tokens > 0:
            unchecked.append((step, f"nothing compared ({_fmt_value(tokens)} tokens)"))
            continue  # the metrics of an empty comparison are undefined (NaN), not a mismatch
        diffs = [f"{_short(m)} = {_fmt_value(v)}" for m, v in values.items()
                 if m != TOKENS and not v == PARITY_TARGETS[m]]  # NaN != target: counts as a mismatch
        if diffs:
            off.append((step, ", ".join(diffs)))
    if off:
        return ParityVerdict("mismatch", len(per_step), off[0][0], off[0][1], len(off), total)
    if unchecked:
        return ParityVerdict("unchecked", len(per_step), unchecked[0][0], unchecked[0][1], len(unchecked), total)
    return ParityVerdict("ok", len(per_step), tokens_compared=total)


def _short(metric: str) -> str:
    return metric.split("/", 1)[-1]


# ---------------------------------------------------------------------- numbers
def _value_attr(v: float) -> str:
    """Exact, JS-``Number()``-parsable text of a value."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _fmt_value(v: float | None, digits: int = 4) -> str:
    """Human text of a value: 4 significant digits, k/M suffixes for big ones."""
    if v is None:
        return "–"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "∞" if v > 0 else "−∞"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.{digits - 1}g}M"
    if a >= 1e4:
        return f"{v / 1e3:.{digits - 1}g}k"
    if a < 1e-3:
        return f"{v:.2e}".replace("e-0", "e-")
    return f"{v:.{digits}g}"


def _nice(x: float, round_: bool) -> float:
    """A 1/2/5 x 10^k number near ``x`` (Heckbert's "nice numbers")."""
    exp = math.floor(math.log10(x))
    f = x / 10**exp
    if round_:
        nf = 1 if f < 1.5 else 2 if f < 3 else 5 if f < 7 else 10
    else:
        nf = 1 if f <= 1 else 2 if f <= 2 else 5 if f <= 5 else 10
    return nf * 10**exp


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> tuple[float, float, list[float]]:
    """Expanded range ``[lo', hi']`` and the ticks on it, about ``n`` of them, at 1/2/5 steps."""
    if not hi > lo:
        raise ValueError(f"empty range [{lo}, {hi}]")
    step = _nice(_nice(hi - lo, False) / (n - 1), True)
    if integer:
        step = max(step, 1.0)
    lo2, hi2 = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    decimals = max(0, -math.floor(math.log10(step)) + 1)
    ticks = [round(lo2 + i * step, decimals) for i in range(int(round((hi2 - lo2) / step)) + 1)]
    return lo2, hi2, ticks


def _tick_labels(ticks: list[float]) -> list[str]:
    """Labels for one axis, in one style: all in k/M when the axis reaches 10^4, else fixed decimals."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    top = max(abs(t) for t in ticks)
    for scale, suffix, at in ((1e6, "M", 1e6), (1e3, "k", 1e4)):
        if top >= at:
            decimals = max(0, -math.floor(math.log10(step / scale) + 1e-9))
            return [f"{t / scale:.{decimals}f}{suffix}" if t else "0" for t in ticks]
    if top < 1e-3:  # all tiny (KL-sized): scientific, with enough digits to tell the ticks apart
        digits = max(1, min(6, math.floor(math.log10(top) + 1e-9) - math.floor(math.log10(step) + 1e-9)))
        return [f"{t:.{digits}e}".replace("e-0", "e-") if t else "0" for t in ticks]
    # fixed decimals down to the tick step (e.g. 0.9990 / 0.9995 / 1.0000 near a bitwise fraction of 1)
    decimals = min(10, max(0, -math.floor(math.log10(step) + 1e-9)))
    return [f"{t:.{decimals}f}" if t else "0" for t in ticks]


def _y_range(values: list[float], spec: ChartSpec) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if spec.include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if spec.y_bounds is not None:
        lo, hi = min(lo, spec.y_bounds[0]), max(hi, spec.y_bounds[1])
    if lo == hi:  # constant series: a flat line in a sensible band rather than a zero-height range
        if spec.flat_range is not None:
            return min(spec.flat_range[0], lo), max(spec.flat_range[1], hi)
        if lo == 0:
            return 0.0, 1.0
        pad = abs(lo) * 0.1
        return lo - pad, hi + pad
    return lo, hi


# ---------------------------------------------------------------------- SVG
W, H = 560, 230
ML, MR, MT, MB = 56, 14, 10, 30          # margins: tick labels left and bottom
INSET = 6                                # keeps a line at y_min/y_max off the frame


def _svg_chart(spec: ChartSpec, series: dict[str, list[Point]], steps: tuple[int, int],
               flag_step: int | None = None) -> str:
    """One panel; ``steps`` is the run's (first, last) step, shared by every chart's x-axis.

    ``flag_step`` draws a red vertical rule there (the first rollout/trainer mismatch).
    """
    present = [m for m in spec.metrics if series.get(m)]
    attrs = (f'class="chart" data-metric="{html.escape(spec.metrics[0])}" '
             f'data-metrics="{html.escape(" ".join(spec.metrics))}"')
    legend = "".join(
        f'<span class="key"><i style="background:{COLORS[i % len(COLORS)]}"></i>{html.escape(m)}</span>'
        for i, m in enumerate(spec.metrics) if m in present or i == 0)
    head = (f'<figcaption><div class="ctitle">{html.escape(spec.title)}</div>'
            f'<div class="legend">{legend}</div>')
    if not present:
        return (f'<figure {attrs} data-empty="1">{head}<div class="note"><span class="desc">{html.escape(spec.note)}</span></div></figcaption>'
                f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(spec.title)}: no data">'
                f'<rect x="{ML}" y="{MT}" width="{W - ML - MR}" height="{H - MT - MB}" class="frame"/>'
                f'<text x="{(W + ML - MR) / 2}" y="{(H + MT - MB) / 2}" class="nodata">no data</text></svg></figure>')

    primary = series.get(spec.metrics[0]) or series[present[0]]
    last_step, last_v = primary[-1]
    flag = (f'<span class="flagnote">mismatch from step {flag_step}</span> · ' if flag_step is not None else "")
    head += (f'<div class="note"><span class="desc">{html.escape(spec.note)}</span><span class="last">{flag}last '
             f'<b>{_fmt_value(last_v)}</b> @ step {last_step}</span></div></figcaption>')

    all_pts = [p for m in present for p in series[m]]
    x_lo, x_hi = steps
    if x_lo == x_hi:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    x_lo, x_hi, x_ticks = nice_ticks(x_lo, x_hi, n=6, integer=True)
    y_lo, y_hi, y_ticks = nice_ticks(*_y_range([v for _, v in all_pts], spec), n=5)
    px0, px1, py0, py1 = ML, W - MR, H - MB - INSET, MT + INSET

    def sx(s: float) -> float:
        return px0 + (s - x_lo) / (x_hi - x_lo) * (px1 - px0)

    def sy(v: float) -> float:
        return py0 + (v - y_lo) / (y_hi - y_lo) * (py1 - py0)

    out = [f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(spec.title)}">',
           f'<rect x="{ML}" y="{MT}" width="{W - ML - MR}" height="{H - MT - MB}" class="frame"/>']
    for t, label in zip(y_ticks, _tick_labels(y_ticks)):
        y = sy(t)
        out.append(f'<line x1="{ML}" x2="{W - MR}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{ML - 6}" y="{y + 3.5:.1f}" class="ytick">{label}</text>')
    for t, label in zip(x_ticks, _tick_labels(x_ticks)):
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{H - MB}" y2="{H - MB + 4}" class="axis"/>'
                   f'<text x="{x:.1f}" y="{H - MB + 16}" class="xtick">{label}</text>')
    out.append(f'<text x="{W - MR}" y="{H - 2}" class="xlabel">step</text>')
    if flag_step is not None:
        x = sx(flag_step)
        out.append(f'<g class="flag" data-step="{flag_step}"><line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" '
                   f'y2="{H - MB}"/><title>first mismatch: step {flag_step}</title></g>')

    for i, m in enumerate(spec.metrics):
        pts = series.get(m)
        if not pts:
            continue
        color = COLORS[i % len(COLORS)]
        out.append(f'<g class="series" data-metric="{html.escape(m)}" style="--c:{color}">')
        runs: list[list[str]] = [[]]
        for s, v in pts:  # NaN/inf break the line
            if math.isfinite(v):
                runs[-1].append(f"{sx(s):.1f},{sy(v):.1f}")
            elif runs[-1]:
                runs.append([])
        d = " ".join("M" + " L".join(r) for r in runs if len(r) > 1)
        if d:
            out.append(f'<path class="line{" dashed" if i else ""}" d="{d}"/>')
        stride = max(1, math.ceil(len(pts) / MAX_MARKERS))
        r = 4 if spec.eval_points else (2.6 if len(pts) <= 120 else 1.6)
        for j, (s, v) in enumerate(pts):
            if math.isfinite(v) and j % stride and j != len(pts) - 1:
                continue
            tip = f"<title>step {s}: {html.escape(m)} = {_fmt_value(v, 6)}</title>"
            data = f'data-step="{s}" data-value="{_value_attr(v)}"'
            if math.isfinite(v):
                out.append(f'<circle class="pt" cx="{sx(s):.1f}" cy="{sy(v):.1f}" r="{r}" {data}>{tip}</circle>')
            else:  # pinned to the top (+inf) or bottom (NaN, -inf) edge, drawn as a red cross
                y = py1 if v > 0 else py0
                x = sx(s)
                out.append(f'<path class="pt nonfinite" d="M{x - 4:.1f},{y - 4:.1f} L{x + 4:.1f},{y + 4:.1f} '
                           f'M{x - 4:.1f},{y + 4:.1f} L{x + 4:.1f},{y - 4:.1f}" {data}>{tip}</path>')
        out.append("</g>")
    out.append("</svg>")
    return f'<figure {attrs}>{head}{"".join(out)}</figure>'


# ---------------------------------------------------------------------- page
CSS = """
:root{--fg:#111827;--muted:#6b7280;--line:#e5e7eb;--bg:#f5f6f8;--card:#fff;--ok:#047857;--okbg:#ecfdf5;
--bad:#b91c1c;--badbg:#fef2f2}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
header{background:var(--card);border-bottom:1px solid var(--line);padding:20px 32px}
h1{margin:0;font-size:22px;font-weight:650;letter-spacing:-.01em}
h1 small{color:var(--muted);font-weight:500;font-size:15px;margin-left:8px}
.meta{color:var(--muted);font-size:12.5px;margin-top:4px;word-break:break-all}
.live{display:inline-block;background:#eff6ff;color:#1d4ed8;border-radius:999px;padding:0 8px;margin-left:6px;
font-weight:600}
.live.state-finished{background:var(--okbg);color:var(--ok)}
.live.state-failed,.live.state-interrupted,.live.state-stale{background:var(--badbg);color:var(--bad)}
.summary{display:flex;flex-wrap:wrap;gap:12px;margin-top:16px;align-items:stretch}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:10px 16px;min-width:140px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:22px;font-weight:650;font-variant-numeric:tabular-nums}
.card .s{color:var(--muted);font-size:12px}
.badge{flex:1 1 360px;border-radius:10px;padding:10px 18px;border:1px solid;display:flex;flex-direction:column;
justify-content:center}
.badge .bt{font-size:18px;font-weight:700}
.badge .bs{font-size:12.5px;opacity:.85}
.badge.ok{background:var(--okbg);border-color:#a7f3d0;color:var(--ok)}
.badge.mismatch,.badge.unchecked{background:var(--badbg);border-color:#fecaca;color:var(--bad)}
.badge.none{background:#f3f4f6;border-color:var(--line);color:var(--muted)}
main{padding:8px 32px 32px}
h2{font-size:15px;font-weight:650;margin:22px 0 10px;color:#374151}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:16px}
figure.chart{margin:0;background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px 6px}
figcaption{margin-bottom:4px}
.ctitle{font-weight:650;font-size:14.5px;display:inline-block;margin-right:10px}
.legend{display:inline-flex;gap:12px;flex-wrap:wrap;font-size:12px;color:var(--muted)}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px;vertical-align:-1px}
.note{color:var(--muted);font-size:12px;display:flex;justify-content:space-between;gap:8px}
.note .desc{overflow:hidden;text-overflow:ellipsis;white-space:nowrap;min-width:0}
.note .last{white-space:nowrap;color:#374151}
svg{width:100%;height:auto;display:block}
svg text{font:11px system-ui,-apple-system,"Segoe UI",Roboto,Arial,sans-serif;fill:var(--muted)}
.frame{fill:none;stroke:#d1d5db}
line.grid{stroke:#eef0f3}
line.axis{stroke:#9ca3af}
.ytick{text-anchor:end}
.xtick{text-anchor:middle}
.xlabel{text-anchor:end;font-style:italic}
.nodata{text-anchor:middle;font-size:14px!important;fill:#9ca3af!important}
.series .line{fill:none;stroke:var(--c);stroke-width:2;stroke-linejoin:round;stroke-linecap:round}
.series .line.dashed{stroke-dasharray:5 4;stroke-width:1.6}
.series circle.pt{fill:var(--c);stroke:#fff;stroke-width:1}
.flag line{stroke:#dc2626;stroke-dasharray:4 3;stroke-width:1.2}
.flagnote{color:#dc2626;font-weight:600}
.series .nonfinite{stroke:#dc2626;stroke-width:2;fill:none}
details{margin-top:24px;background:var(--card);border:1px solid var(--line);border-radius:10px;padding:10px 14px}
summary{cursor:pointer;font-weight:600}
pre{font-size:12px;overflow:auto;max-height:420px}
footer{color:var(--muted);font-size:12px;padding:0 32px 24px}
"""


def _card(key: str, value: str, sub: str = "", ident: str = "") -> str:
    i = f' id="{ident}"' if ident else ""
    return (f'<div class="card"{i}><div class="k">{html.escape(key)}</div><div class="v">{value}</div>'
            f'<div class="s">{sub}</div></div>')


def _badge(v: ParityVerdict, series: dict[str, list[Point]]) -> str:
    extra = ""
    if v.status == "ok":
        worst = max((abs(x) for _, x in series.get(DLOGP, [])), default=0.0)
        title = "✓ rollout/trainer KL = 0 at every step"
        sub = (f"{v.tokens_compared} log-probs bitwise equal over {v.steps_checked}/{v.steps_checked} checked "
               f"steps · max |Δlogp| = {_fmt_value(worst)}")
    elif v.status in ("mismatch", "unchecked"):
        title = (f"✗ rollout/trainer mismatch at step {v.first_bad_step}" if v.status == "mismatch"
                 else f"✗ parity not checked at step {v.first_bad_step}")
        what = "off target" if v.status == "mismatch" else "without a comparison"
        sub = f"{html.escape(v.first_bad_detail)} · {v.bad_steps} of {v.steps_checked} steps {what}"
        extra = f' data-first-step="{v.first_bad_step}"'
    else:
        title, sub = "no rollout/trainer parity metrics logged yet", "expects mismatch/* metrics"
    return (f'<div class="badge {v.status}" id="kl-badge" data-status="{v.status}"{extra}>'
            f'<div class="bt">{title}</div><div class="bs">{sub}</div></div>')


def _status_tag(status: RunStatus | None, live: bool, now: _dt.datetime) -> tuple[str, bool]:
    """The header's run-state tag (``#run-status``) and whether the page reloads itself.

    With a status file the loop's word is shown: running (reloads), finished, failed or interrupted
    with the reason; a "running" status whose process is gone or silent for an hour shows as stale
    (no reload). Without one (an older run) ``live`` decides, as before."""
    if status is None:
        if not live:
            return "", False
        return f'<span class="live" id="run-status" data-state="live">live · reloads every {REFRESH_S} s</span>', True
    state = status.state
    when = _dt.datetime.fromtimestamp(status.updated, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    steps = f"step {status.step}/{status.total_steps}" if status.total_steps else f"step {status.step}"
    reload = False
    if state == "running" and status.is_stale(now.timestamp()):
        state, text = "stale", f"not running: no update since {when} at {steps} (killed?)"
    elif state == "running":
        text, reload = f"running · {steps} · reloads every {REFRESH_S} s", True
    elif state == "finished":
        text = f"finished · {steps} · {when}"
    else:
        text = f"{state} at {steps} · {when}"
    if status.message and state != "running":
        text += f" · {status.message}"
    return (f'<span class="live state-{state}" id="run-status" data-state="{state}">{html.escape(text)}</span>',
            reload)


def render_html(records: Sequence[dict], run_info: dict | None = None, run_dir: str = "",
                live: bool = False, now: _dt.datetime | None = None, status: RunStatus | None = None) -> str:
    """The dashboard page of ``records`` (``read_metrics`` output) as one HTML string."""
    run_info = run_info or {}
    series = collect_series(records)
    steps = sorted({s for pts in series.values() for s, _ in pts})
    verdict = parity_verdict(series)
    name = str(run_info.get("run_name") or Path(run_dir).name or "run")
    now = now or _dt.datetime.now(_dt.timezone.utc)

    def last(metric: str) -> Point | None:
        pts = series.get(metric)
        return pts[-1] if pts else None

    cards = [_card("Steps", str(len(steps)), f"last step {steps[-1]}" if steps else "no steps yet", "card-steps")]
    rew = series.get("reward/mean", [])
    if rew:
        delta = rew[-1][1] - rew[0][1]
        arrow = "▲" if delta > 0 else "▼" if delta < 0 else "·"
        sub = f"{arrow} {'+' if delta > 0 else ''}{_fmt_value(delta)} since step {rew[0][0]}" if len(rew) > 1 else f"step {rew[-1][0]}"
        cards.append(_card("Reward (mean)", _fmt_value(rew[-1][1]), sub, "card-reward"))
    else:
        cards.append(_card("Reward (mean)", "–", "no data", "card-reward"))
    evals = _eval_metrics(series)
    if evals:
        pts = series[evals[0]]
        label = evals[0].removeprefix("eval/").replace("_mean@", " mean@").replace("aime25", "AIME25")
        sub = (f"{_fmt_value(pts[0][1])} at step {pts[0][0]} → step {pts[-1][0]}" if len(pts) > 1
               else f"step {pts[-1][0]}")
        cards.append(_card(label, _fmt_value(pts[-1][1]), sub, "card-eval" if evals[0] != "eval/aime25_mean@8"
                           else "card-aime"))
    tps = last("perf/tokens_per_s")
    if tps:
        cards.append(_card("Tokens / s", _fmt_value(tps[1]), f"step {tps[0]}", "card-tps"))

    errors = series.get("rollout/errors", [])
    if errors:
        total = sum(v for _, v in errors if math.isfinite(v))
        worst = max(errors, key=lambda p: p[1] if math.isfinite(p[1]) else math.inf)
        sub = f"worst step {worst[0]}: {_fmt_value(worst[1])}" if total else "none in any step"
        cards.append(_card("Rollout errors", _fmt_value(total), sub, "card-errors"))

    known = set(PARITY_TARGETS)
    for spec in PARITY_SPECS:
        known.update(spec.metrics)
    learning = _learning_specs(series)
    for spec in learning:
        known.update(spec.metrics)
    other = [ChartSpec(k, (k,)) for k in sorted(series) if k not in known]

    x_span = (steps[0], steps[-1]) if steps else (0, 1)

    def section(title: str, specs: list[ChartSpec], flag: int | None = None) -> str:
        return (f'<h2>{html.escape(title)}</h2><div class="grid">'
                + "".join(_svg_chart(s, series, x_span, flag) for s in specs) + "</div>")

    body = [section(LEARNING, learning), section(PARITY, PARITY_SPECS, verdict.first_bad_step)]
    if other:
        body.append(section("Other metrics", other))
    if run_info.get("config"):
        cfg = json.dumps(run_info["config"], indent=2, sort_keys=True, default=str)
        body.append(f"<details><summary>Run config</summary><pre>{html.escape(cfg)}</pre></details>")

    live_tag, reload = _status_tag(status, live, now)
    refresh = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if reload else ""
    project = html.escape(str(run_info.get("project") or "zmrl"))
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8">{refresh}'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(name)} · zmrl dashboard</title><style>{CSS}</style></head><body>"
        f'<header><h1>{html.escape(name)}<small>{project}</small></h1>'
        f'<div class="meta">{html.escape(str(run_dir))} · updated {now.strftime("%Y-%m-%d %H:%M:%S UTC")}'
        f"{live_tag}</div>"
        f'<div class="summary">{"".join(cards)}{_badge(verdict, series)}</div></header>'
        f'<main>{"".join(body)}</main>'
        f"<footer>Generated by zmrl from {METRICS_FILE} ({len(records)} records). "
        "Self-contained: no scripts, no network.</footer></body></html>\n")


def build_dashboard(run_dir: str | os.PathLike, live: bool = False) -> Path:
    """Write ``run_dir/dashboard.html`` from ``run_dir/metrics.jsonl``; returns its path.

    ``live`` adds a meta refresh (used while the run is still logging). The file is replaced
    atomically, so a browser reloading it never sees half a page. Raises ``FileNotFoundError``
    when ``run_dir/metrics.jsonl`` is missing.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    run_info: dict = {}
    info_path = run_dir / RUN_FILE
    if info_path.exists():
        try:
            run_info = json.loads(info_path.read_text(encoding="utf-8"))
        except ValueError:
            run_info = {}
    page = render_html(records, run_info, str(run_dir.resolve()), live=live, status=read_status(run_dir))
    out = run_dir / DASHBOARD_FILE
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------- CLI
def _dashboard_cmd(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"zmrl dashboard: error: run directory not found: {run_dir}", file=sys.stderr)
        return 2
    if not (run_dir / METRICS_FILE).is_file():
        print(f"zmrl dashboard: error: no {METRICS_FILE} in {run_dir} (is it a zmrl run directory?)",
              file=sys.stderr)
        return 2
    path = build_dashboard(run_dir)
    print(path.resolve().as_uri())
    return 0


def add_dashboard_subcommand(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``dashboard RUN_DIR`` on a ``parser.add_subparsers(...)`` object; ``func`` returns an exit code."""
    p = subparsers.add_parser(
        "dashboard", help="write RUN_DIR/dashboard.html (self-contained) from RUN_DIR/metrics.jsonl",
        description="Build the self-contained HTML dashboard of a run and print its file:// URL.")
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.set_defaults(func=_dashboard_cmd)
    return p


def main(argv: list[str] | None = None) -> int:
    """``zmrl dashboard RUN_DIR`` as a standalone entry (``python -m zmrl.rl.dashboard RUN_DIR``)."""
    parser = argparse.ArgumentParser(prog="zmrl")
    add_dashboard_subcommand(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "dashboard":
        argv = ["dashboard", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
