"""Metrics logging (JSONL, wandb offline) and the self-contained HTML dashboard.

The browser tests open the dashboard in a real headless Chromium (``.ci/install-browser.sh``
installs Debian's) and read the plotted data back from the rendered DOM; they skip when no
Chromium is installed.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

from zmrl.rl import dashboard, metrics
from zmrl.rl.dashboard import build_dashboard, nice_ticks, render_html
from zmrl.rl.metrics import MetricsLogger, read_metrics

N_STEPS = 30
EVAL_EVERY = 10


# ---------------------------------------------------------------------- helpers
def fake_step_metrics(step: int) -> dict:
    """Plausible metrics of a healthy zero-mismatch run: reward rises, KL is exactly 0."""
    return {
        "reward/mean": 0.1 + 0.5 * (1 - math.exp(-step / 12)) + 0.02 * math.sin(step),
        "reward/max": 1.0 if step > 3 else 0.5,
        "response/length_mean": 800.0 + 17.5 * step,
        "perf/tokens_per_s": 15000.0 + 300 * math.cos(step),
        "loss/policy": -0.02 + 0.005 * math.sin(3 * step),
        "mismatch/bitwise_equal_frac": 1.0,
        "mismatch/max_abs_dlogp": 0.0,
        "mismatch/kl_k1": 0.0,
        "mismatch/kl_k3": 0.0,
        "mismatch/tokens_compared": 4096,
        "mismatch/sequences_compared": 32,
        "rollout/error_frac": 0.0,
    }


def write_fake_run(run_dir: Path) -> dict[int, dict]:
    """30 steps, eval every 10 steps logged as a separate call on the same step; returns step -> metrics."""
    logged: dict[int, dict] = {}
    with MetricsLogger(run_dir, run_name="fake-aime-run", config={"lr": 1e-5, "lora_rank": 32},
                       wandb_mode="disabled", dashboard_every=10) as lg:
        for step in range(1, N_STEPS + 1):
            m = fake_step_metrics(step)
            lg.log(m, step=step)
            logged[step] = dict(m)
            if step % EVAL_EVERY == 0:
                ev = {"eval/aime25_mean@8": 0.05 + 0.01 * step}
                lg.log(ev, step=step)
                logged[step].update(ev)
    return logged


class Dom(HTMLParser):
    """Charts, series points and texts of a dashboard page (as written, or as a browser dumped it)."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "area", "base", "col", "source", "wbr"}

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, dict]] = []
        self.charts: dict[str, dict] = {}          # data-metric of the figure -> info
        self.points: dict[str, list[tuple[str, str]]] = {}  # series data-metric -> [(step, value)]
        self.badge: dict | None = None
        self.badge_text = ""
        self.scripts: list[dict] = []
        self.feed(text)

    def _open(self, tag: str, attrs: dict) -> None:
        cls = attrs.get("class") or ""
        if tag == "script":
            self.scripts.append(attrs)
        if tag == "figure" and "chart" in cls.split():
            self.charts[attrs["data-metric"]] = {"attrs": attrs, "yticks": [], "xticks": [], "title": "",
                                                  "nodata": False, "points": 0}
        if attrs.get("id") == "kl-badge":
            self.badge = attrs
        if "data-step" in attrs and "data-value" in attrs and "pt" in cls.split():
            series = next((a for t, a in reversed(self.stack) if t == "g" and "series" in (a.get("class") or "")), None)
            assert series is not None, f"data point outside a series: {attrs}"
            self.points.setdefault(series["data-metric"], []).append((attrs["data-step"], attrs["data-value"]))
            fig = self._figure()
            if fig is not None:
                fig["points"] += 1

    def _figure(self) -> dict | None:
        a = next((a for t, a in reversed(self.stack) if t == "figure"), None)
        return self.charts.get(a.get("data-metric")) if a else None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._open(tag, attrs)
        if tag not in self.VOID:
            self.stack.append((tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self._open(tag, dict(attrs))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        if not self.stack:
            return
        classes = set()
        for _, a in self.stack:
            classes.update((a.get("class") or "").split())
            if a.get("id") == "kl-badge":
                self.badge_text += data
        fig = self._figure()
        cls = (self.stack[-1][1].get("class") or "").split()
        if fig is None:
            return
        if "ytick" in cls:
            fig["yticks"].append(data)
        elif "xtick" in cls:
            fig["xticks"].append(data)
        elif "ctitle" in cls:
            fig["title"] += data
        elif "nodata" in cls:
            fig["nodata"] = True


def as_float(text: str) -> float:
    return float(text)  # "NaN", "Infinity", "-Infinity" parse too


def check_run_data(dom: Dom, logged: dict[int, dict]) -> None:
    """The plotted points are exactly the logged values, for every panel of the fake run."""
    for metric in ["reward/mean", "reward/max", "loss/policy", "perf/tokens_per_s", "response/length_mean",
                   "mismatch/bitwise_equal_frac", "mismatch/max_abs_dlogp", "mismatch/kl_k1", "mismatch/kl_k3"]:
        pts = dom.points[metric]
        assert [int(s) for s, _ in pts] == list(range(1, N_STEPS + 1)), metric
        # data-value is repr(float): it must round-trip bit for bit
        assert [as_float(v) for _, v in pts] == [logged[s][metric] for s in range(1, N_STEPS + 1)], metric
    ev = dom.points["eval/aime25_mean@8"]
    assert [(int(s), as_float(v)) for s, v in ev] == [(s, logged[s]["eval/aime25_mean@8"])
                                                      for s in range(EVAL_EVERY, N_STEPS + 1, EVAL_EVERY)]
    assert dom.charts["reward/mean"]["points"] == 2 * N_STEPS       # mean and max overlaid
    for metric, chart in dom.charts.items():
        assert chart["title"].strip(), metric
        assert len(chart["yticks"]) >= 2 and len(chart["xticks"]) >= 2, metric
        assert not chart["nodata"], metric
    assert dom.badge is not None and dom.badge["data-status"] == "ok"
    assert "rollout/trainer KL = 0 at every step" in dom.badge_text


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    run_dir = tmp_path_factory.mktemp("run")
    logged = write_fake_run(run_dir)
    return run_dir, logged


# ---------------------------------------------------------------------- MetricsLogger
def test_jsonl_lines_are_flushed_and_scalars_converted(tmp_path, caplog):
    lg = MetricsLogger(tmp_path, wandb_mode="disabled", dashboard_every=0)
    with caplog.at_level(logging.WARNING, logger="zmrl.rl.metrics"):
        lg.log({"reward/mean": np.float32(0.5), "loss/policy": torch.tensor(-0.25), "n": np.int64(3),
                "ok": True, "hist": torch.zeros(3)}, step=1)
        lg.log({"reward/mean": 0.75, "hist": torch.zeros(3)}, step=2)
    # read while the logger is still open: a killed run keeps every completed line
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["reward/mean"] == 0.5 and first["loss/policy"] == -0.25
    assert first["n"] == 3 and first["ok"] is True and "hist" not in first and isinstance(first["time"], float)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert sum("not a scalar" in r.message for r in caplog.records) == 1  # warned once per key
    lg.close()
    assert (tmp_path / "dashboard.html").exists()  # close() writes the final dashboard
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["project"] == "zmrl" and info["run_name"] == tmp_path.name


def test_truncated_last_line_is_tolerated_and_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.2}\n{"step": 3, "rew')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    with MetricsLogger(tmp_path, wandb_mode="disabled", dashboard_every=0) as lg:
        lg.log({"reward/mean": 0.3}, step=3)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # every line parses again


def test_resume_truncates_instead_of_duplicating(tmp_path):
    with MetricsLogger(tmp_path, wandb_mode="disabled", dashboard_every=0) as lg:
        for s in range(1, 11):
            lg.log({"reward/mean": s / 10}, step=s)
    # resume from a checkpoint taken after step 5: steps 6.. are redone
    with MetricsLogger(tmp_path, wandb_mode="disabled", dashboard_every=0, resume_step=6) as lg:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
        for s in range(6, 9):
            lg.log({"reward/mean": 1 + s}, step=s)
        assert lg.truncate_from(8) == 1  # also works on an open logger, which keeps appending
        lg.log({"reward/mean": 42.0}, step=8)
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert recs[-1]["reward/mean"] == 42.0 and recs[5]["reward/mean"] == 7


def test_wandb_offline_writes_files_under_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    # the logger sets these process-wide; monkeypatch restores them afterwards
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with MetricsLogger(tmp_path, run_name="offline-test", config={"lr": 1e-5}, dashboard_every=0) as lg:
        assert lg.wandb_mode == "offline"
        assert lg._wandb_run is not None, "wandb.init failed (see warnings)"
        for s in range(3):
            lg.log({"reward/mean": 0.1 * s, "mismatch/kl_k3": 0.0}, step=s)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_missing_wandb_warns_once_and_keeps_logging(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    monkeypatch.setattr(metrics, "_warned_no_wandb", False)
    with caplog.at_level(logging.WARNING, logger="zmrl.rl.metrics"):
        for sub in ("a", "b"):
            with MetricsLogger(tmp_path / sub, wandb_mode="offline", dashboard_every=0) as lg:
                lg.log({"reward/mean": 1.0}, step=0)
    assert sum("wandb is not installed" in r.message for r in caplog.records) == 1
    assert read_metrics(tmp_path / "b")[0]["reward/mean"] == 1.0


# ---------------------------------------------------------------------- dashboard HTML
def test_nice_ticks():
    assert nice_ticks(1, 30, n=6, integer=True)[2] == [0, 10, 20, 30]
    assert nice_ticks(0, 1)[2] == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    lo, hi, ticks = nice_ticks(0.9987, 1.0)
    assert lo <= 0.9987 and hi >= 1.0 and len(ticks) >= 3
    lo, hi, ticks = nice_ticks(0.0, 1.5e-9)
    assert ticks[0] == 0 and ticks[-1] >= 1.5e-9 and len(ticks) >= 3
    with pytest.raises(ValueError):
        nice_ticks(1.0, 1.0)


def test_dashboard_is_self_contained_and_carries_the_data(fake_run):
    run_dir, logged = fake_run
    path = build_dashboard(run_dir)
    assert path == run_dir / "dashboard.html"
    text = path.read_text(encoding="utf-8")
    # nothing fetched from anywhere: no URLs at all, no external script/style/font
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", text, re.I)
    assert "http://" not in text and "https://" not in text
    assert "<script" not in text.lower() and "<link" not in text.lower()
    assert "@import" not in text and "url(" not in text
    dom = Dom(text)
    check_run_data(dom, logged)
    assert 'http-equiv="refresh"' not in text  # built after close(): a finished run doesn't reload


def test_badge_on_mismatch_and_edge_cases():
    nan, inf = float("nan"), float("inf")
    records = [{"step": s, "reward/mean": 0.5, "mismatch/bitwise_equal_frac": 1.0, "mismatch/kl_k3": 0.0,
                "mismatch/tokens_compared": 8, "loss/policy": nan if s == 4 else 0.1 * s} for s in range(1, 10)]
    records[6]["mismatch/bitwise_equal_frac"] = 0.999  # step 7
    records[8]["mismatch/kl_k3"] = 3e-9                   # step 9
    records.append({"step": 5, "eval/aime25_mean@8": 0.3})  # a single eval point
    records.append({"step": 2, "weird": inf})
    text = render_html(records, {"run_name": "<edge>"}, "/runs/edge")
    dom = Dom(text)
    assert dom.badge["data-status"] == "mismatch" and dom.badge["data-first-step"] == "7"
    assert "mismatch at step 7" in dom.badge_text and "2 of 9" in dom.badge_text
    assert "&lt;edge&gt;" in text  # run name escaped
    # missing metrics: the panel is there and says so
    for metric in ("perf/tokens_per_s", "response/length_mean", "mismatch/kl_k1", "mismatch/max_abs_dlogp"):
        assert dom.charts[metric]["nodata"] and dom.charts[metric]["attrs"].get("data-empty") == "1", metric
    # NaN is plotted as a marker (and breaks the line), not dropped and not a crash
    assert ("4", "NaN") in dom.points["loss/policy"] and len(dom.points["loss/policy"]) == 9
    assert dom.points["weird"] == [("2", "Infinity")]
    assert dom.points["eval/aime25_mean@8"] == [("5", "0.3")]
    # constant series (reward 0.5 every step): a flat line inside a non-empty y-range
    ys = re.findall(r'<g class="series" data-metric="reward/mean".*?</g>', text, re.S)[0]
    cys = {float(c) for c in re.findall(r'cy="([\d.]+)"', ys)}
    assert len(cys) == 1 and dashboard.MT < cys.pop() < dashboard.H - dashboard.MB
    assert 'class="flag" data-step="7"' in text  # first mismatch marked on the parity charts


def test_badge_ok_with_constant_zero_kl_and_none_without_parity_metrics():
    ok = render_html([{"step": s, "mismatch/bitwise_equal_frac": 1.0, "mismatch/kl_k3": 0.0,
                       "mismatch/kl_k1": 0.0, "mismatch/max_abs_dlogp": 0.0, "mismatch/tokens_compared": 5}
                      for s in range(3)])
    dom = Dom(ok)
    assert dom.badge["data-status"] == "ok"
    # KL == 0 everywhere: flat line at 0 on a [0, 1] axis, not a degenerate range
    assert dom.charts["mismatch/kl_k3"]["yticks"][0] == "0" and dom.charts["mismatch/kl_k3"]["yticks"][-1] == "1.0"
    none = Dom(render_html([{"step": 1, "reward/mean": 0.2}]))
    assert none.badge["data-status"] == "none"


def test_nan_parity_metric_is_a_mismatch():
    dom = Dom(render_html([{"step": 1, "mismatch/bitwise_equal_frac": 1.0, "mismatch/kl_k3": float("nan"),
                            "mismatch/tokens_compared": 3}]))
    assert dom.badge["data-status"] == "mismatch" and dom.badge["data-first-step"] == "1"


# ---------------------------------------------------------------------- CLI
def test_cli_missing_dir_and_missing_metrics(tmp_path, capsys):
    assert dashboard.main([str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    assert dashboard.main(["dashboard", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.1}\n')
    assert dashboard.main(["dashboard", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (tmp_path / "dashboard.html").resolve().as_uri() and out.startswith("file://")


def test_cli_subprocess_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zmrl.rl.dashboard", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not found" in r.stderr


# ---------------------------------------------------------------------- real browser
def find_chromium() -> str | None:
    for cand in (os.environ.get("ZMRL_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def run_chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
           f"--user-data-dir={profile}", *args]
    env = dict(os.environ, HOME=str(profile))  # keep crash reports etc. out of the real home
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def png_info(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, decompressed filtered scanlines) of a PNG, by hand (no PIL needed)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, width, height, idat = 8, 0, 0, []
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    return width, height, zlib.decompress(b"".join(idat))


@pytest.mark.timeout(300)
def test_dashboard_in_headless_chromium(fake_run, tmp_path):
    browser = find_chromium()
    if browser is None:
        pytest.skip("no Chromium installed (run .ci/install-browser.sh)")
    run_dir, logged = fake_run
    url = build_dashboard(run_dir).resolve().as_uri()

    r = run_chromium(browser, tmp_path / "profile-dom", "--dump-dom", url)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = Dom(r.stdout)
    # every learning panel (reward, eval, loss, length, throughput) and every parity panel
    assert len(dom.charts) == 5 + len(dashboard.PARITY_SPECS) == 11, sorted(dom.charts)
    check_run_data(dom, logged)
    assert not dom.scripts

    shot = tmp_path / "shot.png"
    r = run_chromium(browser, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1400,2000", url)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    data = shot.read_bytes()
    assert len(data) > 40_000, len(data)  # a blank 1400x2000 page compresses to a few KB
    width, height, raw = png_info(data)
    assert (width, height) == (1400, 2000)
    # a single-colour image filters to (almost) all zeros; a page of charts does not
    assert len(set(raw)) > 100 and sum(b != 0 for b in raw[::97]) > len(raw[::97]) // 200
    try:
        from PIL import Image  # optional: exact pixel check when Pillow happens to be installed
    except ImportError:
        return
    img = Image.open(shot).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50
    present = {c for _, c in colors}
    assert (0xEC, 0xFD, 0xF5) in present      # the green KL badge background
    assert (0x25, 0x63, 0xEB) in present      # the primary series colour (lines/points)


def test_dashboard_rebuilt_every_n_steps_live_until_close(tmp_path):
    lg = MetricsLogger(tmp_path, wandb_mode="disabled", dashboard_every=2)
    page = tmp_path / "dashboard.html"
    lg.log({"reward/mean": 0.1}, step=0)
    assert not page.exists()
    lg.log({"reward/mean": 0.2}, step=1)
    assert 'http-equiv="refresh"' in page.read_text()  # a running job's page reloads itself
    assert len(Dom(page.read_text()).points["reward/mean"]) == 2
    lg.close()
    assert 'http-equiv="refresh"' not in page.read_text()
