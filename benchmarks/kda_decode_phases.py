"""Where the KDA decode step's intra-chunk kernel spends its time: the step timed with one phase of
``_kda_intra_kernel`` (``DECODE=True``) cut out at a time.

The decode step runs the chunk kernel's own code for the new row (zmrl/kernels_batch_invariant/triton/
kda_chunk.py), as a chain of phases separated by barriers and scratch round trips. Which phase costs what
cannot be read from the source, so this times variants of the kernel, each with one phase removed from a
copy of its source (the outputs of a variant are wrong; only its time is used). The time a phase costs is
the full step's minus the variant's. Phases:

* ``scan``: the in-chunk cumulative decay (``tl.cumsum`` over the [64, dk] gate tile, stored, a barrier);
* ``offdiag``: the new row's 16-row block of A against the earlier blocks (the ``tl.dot`` products);
* ``diag``: its diagonal-block entries (one tile reduction);
* ``solve``: storing A, the forward-substitution row of T and its store;
* ``u``: U's products over the block's rows;
* ``w``: W's products, the decay factors and the read-out factors.

The deltas are indicative, not a partition: they overlap and need not add up to the step (the compiler drops
work a cut phase fed, e.g. cutting ``solve`` drops the A_kk diagonal reduction too, and each variant spills
differently), and each phase is cut at its main work (``scan`` keeps the store and the barrier). Variants are
timed in interleaved rounds, the median kept. Each variant is built from anchors in the kernel source; an
anchor that is not found stops the script (the kernel changed: update the anchors here).

    python benchmarks/kda_decode_phases.py [--batch 256] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import default_out, env, setup_logging, table, write_json  # noqa: E402
from kda_decode_vs_fla import DK, DV, H, inputs  # noqa: E402  (this directory: the script's own)
from zmrl.kernels_batch_invariant import current_numerics, numerics_scope  # noqa: E402
from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, KDADecodeCache, kda_decode_prime, kda_decode_step  # noqa: E402
from zmrl.kernels_batch_invariant.triton import kda_chunk as tk  # noqa: E402
from zmrl.kernels_batch_invariant.triton import triton_impl  # noqa: E402

C = CHUNK_SIZE
_SOURCES = tempfile.TemporaryDirectory(prefix="kda_phases_")  # the variants' source files, removed at exit

# phase -> (anchor, replacement) pairs applied to the kernel's source
PHASES: dict[str, list[tuple[str, str]]] = {
    "scan": [("gc = tl.cumsum(g.to(tl.float32), axis=0)", "gc = g.to(tl.float32)")],
    "offdiag": [("        if blk > 0:\n", "        if False:\n")],
    # both branches: with only the decode branch cut, Triton would compile the general per-column loop instead
    "diag": [("        if DECODE:\n            # Only row r = nr - 1 is new", "        if False:\n            # Only row r = nr - 1 is new"),
             ("        else:\n            m16 = ", "        elif False:\n            m16 = ")],
    "solve": [("for ii in range(tl.maximum(row0 - lo, 0), n_real):", "for ii in range(0, 0):")],
    "u": [("for vb in range(0, DVP // BVI):", "for vb in range(0, 0):")],
    "w": [("for kb in range(0, DKP // BK):", "for kb in range(0, 0):")],
}


def variant_kernel(cut: str | None):
    """``_kda_intra_kernel`` with phase ``cut`` removed (None: the kernel as it is), built from a copy of its
    source in a temporary module (Triton's JIT reads a kernel's source from its file)."""
    if cut is None:
        return tk._kda_intra_kernel
    src = inspect.getsource(tk._kda_intra_kernel.fn)
    for anchor, repl in PHASES[cut]:
        if anchor not in src:
            raise SystemExit(f"kda_decode_phases.py: anchor of phase {cut!r} not in _kda_intra_kernel: {anchor!r}")
        src = src.replace(anchor, repl, 1)
    header = ("import triton\nimport triton.language as tl\n\n"
              "from zmrl.kernels_batch_invariant.triton._common import await_previous_kernel\n\n\n")
    path = Path(_SOURCES.name) / f"kda_intra_without_{cut}.py"
    path.write_text(header + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module._kda_intra_kernel


def step_inputs(b: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta of ``b`` sequences, their cache slots and first positions (spread over every chunk row)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = inputs(b, dev, gen)
    return q, k, v, g, beta, torch.randperm(b, generator=gen).to(dev), torch.randint(0, C, (b,), generator=gen).to(dev)


def step_us(step_in: tuple[torch.Tensor, ...], dev: torch.device, kernel, reps: int = 2) -> float:
    """Mean time of one decode step (all three launches) on ``step_in`` (``step_inputs``) over ``reps`` passes of
    a whole chunk of positions, with ``kernel`` as the intra kernel."""
    q, k, v, g, beta, slots, pos0 = step_in
    b = q.shape[0]
    step, prime = triton_impl(kda_decode_step), triton_impl(kda_decode_prime)
    original = tk._kda_intra_kernel
    tk._kda_intra_kernel = kernel
    try:
        cache = KDADecodeCache.allocate(b, H, DK, DV, torch.bfloat16, torch.float32, dev)
        cache.state.normal_(0, 0.1)
        with torch.no_grad():
            prime(slots, torch.zeros_like(slots), cache)
            for i in range(C):  # compile, fill every row once
                step(q, k, v, g, beta, pos0 + i, slots, cache)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(reps * C):
                step(q, k, v, g, beta, pos0 + C + i, slots, cache)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (reps * C) * 1e6
    finally:
        tk._kda_intra_kernel = original


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2, help="whole chunks of positions timed per variant and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (the median is kept)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    setup_logging()
    if not torch.cuda.is_available():
        raise SystemExit("kda_decode_phases.py needs a CUDA device (timings of Triton kernels)")
    with numerics_scope(current_numerics().replace(kda_form="chunk")):  # its variants are the chunked form's
        return _run(a)


def _run(a: argparse.Namespace) -> int:
    dev = torch.device("cuda")
    kernels = {cut: variant_kernel(cut) for cut in (None, *PHASES)}
    step_in = step_inputs(a.batch, dev)
    times: dict[str | None, list[float]] = {cut: [] for cut in kernels}
    for _ in range(a.rounds):  # interleaved: a drift of the machine spreads over every variant alike
        for cut, kernel in kernels.items():
            times[cut].append(step_us(step_in, dev, kernel, a.reps))
    full = statistics.median(times[None])
    rows: list[dict[str, Any]] = [{"variant": "full step", "step_us": full, "rounds_us": times[None]}]
    for cut in PHASES:
        us = statistics.median(times[cut])
        rows.append({"variant": f"without {cut}", "step_us": us, "phase_us": full - us, "phase_share": (full - us) / full,
                     "rounds_us": times[cut]})
    print(f"\nKDA decode step, batch {a.batch}, H={H} dk={DK} dv={DV} (host-timed, all three launches)")
    print(table(rows, [("variant", "variant", "s"), ("step_us", "step us", ".1f"), ("phase_us", "phase us", ".1f"),
                       ("phase_share", "share", ".1%")]))
    write_json(a.out or default_out("kda_decode_phases"),
               {"benchmark": "kda_decode_phases", **env(), "batch": a.batch, "heads": H, "dk": DK, "dv": DV,
                "launch_config": {k: v for k, v in tk._launch_config(DK, DV).items()}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
