"""Honest progress and status: the loop writes running / finished / failed / interrupted into the run
folder, the dashboard shows it (and stops reloading a run that is over or dead), Ctrl-C ends cleanly
with the resume command, log lines go around progress bars; and the CLI polish around it."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zmrl.rl.dashboard import render_html
from zmrl.rl.run_files import RunStatus, read_status, write_status

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from zmrl.model import build_model, save_pretrained
    from zmrl.rl.bootstrap import tiny_byte_config
    from zmrl.rl.tokenizer import write_byte_tokenizer_marker

    folder = tmp_path_factory.mktemp("model")
    save_pretrained(build_model(tiny_byte_config(), seed=0, dtype="float32"), folder)
    write_byte_tokenizer_marker(folder)
    return folder


def _overrides(out: Path, model: Path, steps: int = 1) -> list[str]:
    return [f"trainer.out_dir={out}", f"model.path={model}", f"trainer.total_steps={steps}", "trainer.save_every=1",
            "data.prompts_per_step=1", "rollout.n=2", "rollout.max_tokens=3", "eval.every=0",
            "logging.wandb_mode=disabled", "trainer.num_threads=1"]


def _state(html: str) -> str:
    return html.split('id="run-status" data-state="', 1)[1].split('"', 1)[0]


# ----------------------------------------------------------------------------- the dashboard's tag
def test_dashboard_shows_the_run_state_and_reloads_only_while_running():
    rec = [{"step": 1, "reward/mean": 0.1}]
    now = time.time()
    running = RunStatus("running", step=3, total_steps=30, updated=now, pid=os.getpid())
    page = render_html(rec, status=running)
    assert _state(page) == "running" and 'http-equiv="refresh"' in page and "step 3/30" in page
    finished = render_html(rec, status=RunStatus("finished", 30, 30, now, "", os.getpid()))
    assert _state(finished) == "finished" and 'http-equiv="refresh"' not in finished
    failed = render_html(rec, status=RunStatus("failed", 4, 30, now, "RolloutFailure: step 5: 4 of 4", 1))
    assert _state(failed) == "failed" and "RolloutFailure: step 5" in failed and "refresh" not in failed
    stopped = render_html(rec, status=RunStatus("interrupted", 7, 30, now, "continue with trainer.resume=true"))
    assert _state(stopped) == "interrupted" and "trainer.resume=true" in stopped
    # a "running" status whose writer is gone (SIGKILL) or silent for an hour is not shown as live
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = render_html(rec, status=RunStatus("running", 2, 30, now, "", dead.pid))
    assert _state(gone) == "stale" and "refresh" not in gone
    silent = render_html(rec, status=RunStatus("running", 2, 30, now - 7200, "", os.getpid()))
    assert _state(silent) == "stale"


def test_status_file_round_trip(tmp_path):
    assert read_status(tmp_path) is None
    write_status(tmp_path, RunStatus("finished", 5, 5, 1.0, "", 1))
    assert read_status(tmp_path) == RunStatus("finished", 5, 5, 1.0, "", 1)
    (tmp_path / "status.json").write_text("{broken")
    assert read_status(tmp_path) is None


# ----------------------------------------------------------------------------- the loop writes it
def test_loop_writes_finished_and_failed(tmp_path, model_dir, monkeypatch):
    from zmrl.rl import loop
    from zmrl.rl.config import load_recipe

    ok = tmp_path / "ok"
    loop.RLRunner(load_recipe(str(RECIPE), _overrides(ok, model_dir))).run()
    st = read_status(ok)
    assert st.state == "finished" and st.step == 1 and st.total_steps == 1
    assert _state((ok / "dashboard.html").read_text()) == "finished"

    def boom(self, step):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(loop.RLRunner, "train_step", boom)
    bad = tmp_path / "bad"
    with pytest.raises(RuntimeError, match="disk on fire"):
        loop.RLRunner(load_recipe(str(RECIPE), _overrides(bad, model_dir))).run()
    st = read_status(bad)
    assert st.state == "failed" and st.step == 0 and "RuntimeError: disk on fire" in st.message
    assert _state((bad / "dashboard.html").read_text()) == "failed"


def test_ctrl_c_is_clean_and_prints_the_resume_command(tmp_path, model_dir):
    out = tmp_path / "run"
    args = _overrides(out, model_dir, steps=50)
    # SIG_DFL in the child: a test run started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler (the run would finish instead)
    proc = subprocess.Popen([sys.executable, "-m", "zmrl.train", str(RECIPE), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 600
    while not (out / "checkpoints" / "latest").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "zmrl train: interrupted" in err and f"trainer.out_dir={out}" in err
    assert err.rstrip().endswith("trainer.resume=true"), err[-500:]
    assert read_status(out).state == "interrupted"
    assert _state((out / "dashboard.html").read_text()) == "interrupted"


# ----------------------------------------------------------------------------- logging and CLI
def test_log_lines_go_through_tqdm_write(capsys):
    from tqdm import tqdm

    from zmrl.train import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging()
        with tqdm(total=3, desc="bar", file=sys.stderr) as bar:
            bar.update(1)
            logging.getLogger("zmrl.test").info("a log line")
            bar.update(1)
        err = capsys.readouterr().err
        line = next(x for x in err.replace("\r", "\n").splitlines() if "a log line" in x)
        assert line.rstrip().endswith("INFO zmrl.test: a log line") and "bar" not in line  # a line of its own
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])


def test_help_does_not_import_torch():
    code = ("import sys\nfrom zmrl.cli import main\n"
            "for argv in (['--help'], ['train', '--help']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "usage: zmrl" in r.stdout and "trainer.total_steps" in r.stdout, r.stderr[-2000:]


def test_smoke_with_a_bogus_preset_is_one_line():
    r = subprocess.run([sys.executable, "-m", "zmrl", "smoke", "--preset", "bogus"], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("zmrl smoke: error: unknown preset 'bogus'; available: "
                                                 "['bench', 'k3', 'k3.1-pro', 'tiny']")


def test_lazy_subcommands_parse_their_own_options(capsys):
    from zmrl.cli import main

    assert main(["plan", "--preset", "bogus"]) == 2
    assert "zmrl plan: error: unknown preset 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["parity", "--help"])
    assert e.value.code == 0 and "--num-requests" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["smoke", "--bogus-flag"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


def test_train_without_a_recipe_uses_the_readme_recipe(monkeypatch):
    from zmrl import train

    seen = {}

    def fake_load(path, overrides):
        seen["path"], seen["overrides"] = path, overrides
        from zmrl.rl.config import RecipeError

        raise RecipeError("stop here")

    monkeypatch.setattr("zmrl.rl.config.load_recipe", fake_load)
    assert train.main(["trainer.total_steps=2"]) == 2
    assert Path(seen["path"]) == RECIPE and seen["overrides"] == ["trainer.total_steps=2"]


def test_local_ray_binds_to_loopback(tmp_path):
    """The Ray the runner starts registers its node at 127.0.0.1, so its servers listen there only."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is already running in this process")
    import tempfile

    from zmrl.rl.cluster import RayCluster
    from zmrl.rl.config import DistributedSection

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="zb", dir="/tmp")  # short unix socket paths
    try:
        with RayCluster(DistributedSection(ray=True, ray_num_cpus=1)):
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
            assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    finally:
        os.environ.pop("RAY_TMPDIR", None)
    assert not ray.is_initialized()


def test_metrics_and_dashboard_do_not_import_each_other():
    code = ("import sys\nimport zmrl.rl.dashboard\nassert 'zmrl.rl.metrics' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "from zmrl.rl.metrics" not in (ROOT / "zmrl/rl/dashboard.py").read_text()
