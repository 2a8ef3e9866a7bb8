"""The recurrent-form KDA kernel (``triton/kda_recurrent.py``) under several launch configurations, against
fla-core on the same shapes (H = 16, dk = dv = 128, bf16 v, fp32 q / k / g / beta).

The launch configuration (the numerics field ``kda_recurrent_launch``: BV value columns per program x warps per
program) is shared numerics: it sets the layout of the kernel's two reductions over dk, so a configuration
moves the bits of the trainer, the prefill and the decode step together. A configuration is therefore judged by

* ``decode == packed``: sequences decoded token by token (``kda_decode_step``) give every output row
  bitwise the packed forward's (``kda_chunk``) under that same configuration: the contract;
* its error against the float64 recurrence (one 2,048-token sequence; the same inputs for every row);
* the packed forward's time on one 32K / 8K sequence, 4 x 4096 (a 16K-token training micro-batch) and
  16 x 1024 (RL-length sequences), and a decode step at batch 256.

fla-core's ``chunk_kda`` and ``fused_recurrent_kda`` are timed on the same shapes once (``--no-fla`` skips them:
they autotune for minutes on a fresh machine). ``--best FILE`` writes the configuration ``pick`` chooses, for a
script to run what follows under it (``ZMRL_KDA_RECURRENT_LAUNCH=$(cat FILE)``).

    python benchmarks/kda_recurrent_configs.py [--configs 32x4,16x1,...] [--no-fla] [--best FILE] [--out FILE]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from _common import copy_bandwidth_tb_s, default_out, env, require_cuda, setup_logging, table, write_json
from kda_decode_vs_fla import H, DK, DV, decode_matches_chunk, events_ms, inputs
from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.numerics import KDA_RECURRENT_LAUNCHES
from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, KDADecodeCache, kda_chunk, kda_decode_step, kda_recurrent_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

# (tokens per sequence, sequences) of the packed forward
SHAPES = ((32768, 1), (8192, 1), (4096, 4), (1024, 16))
TRAIN_SHAPE = (4096, 4)
DECODE_BATCH = 256
# pick(): the time ratios to the reference configuration that are averaged (geometric mean), and how much slower
# than the reference a decode step may get
PICK_KEYS = ("fwd_1x32768_ms", "fwd_4x4096_ms", "fwd_16x1024_ms", "decode_b256_ms")
PICK_DECODE_SLACK = 1.05


def pick(rows: list[dict[str, Any]], reference: str) -> str:
    """The configuration with the lowest geometric mean of its PICK_KEYS times over the reference's, among those
    whose decoded rows equal the packed forward's and whose decode step is at most PICK_DECODE_SLACK x the
    reference's; the reference if none qualifies."""
    ref = next(r for r in rows if r["config"] == reference)
    if ref.get("error"):
        return reference
    best, best_score = reference, 1.0
    for r in rows:
        if r.get("error") or not r.get("decode_equals_packed") or \
                r["decode_b256_ms"] > PICK_DECODE_SLACK * ref["decode_b256_ms"]:
            continue
        score = 1.0
        for key in PICK_KEYS:
            score *= (r[key] / ref[key]) ** (1 / len(PICK_KEYS))
        if score < best_score:
            best, best_score = r["config"], score
    return best


def packed(t: int, n: int, dev: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    q, k, v, g, beta = inputs(t * n, dev, torch.Generator().manual_seed(seed))
    cu = torch.arange(0, t * n + 1, t, dtype=torch.int32, device=dev)
    return q, k, v, g, beta, cu


def median_ms(fn: Callable[[], Any], reps: int, repeats: int = 3) -> float:
    return statistics.median(events_ms(fn, reps) for _ in range(repeats))


@functools.lru_cache(maxsize=1)
def _float64_case(dev: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x = packed(2048, 1, dev, seed=5)
    ref, _ = kda_recurrent_ref(*(t.double() for t in x[:5]), DK**-0.5, None)
    return x, ref


def float64_error(dev: torch.device) -> float:
    """max |o - o_ref| / max |o_ref| of the packed forward on one 2,048-token sequence, o_ref the float64
    token recurrence on the same (rounded) inputs."""
    x, ref = _float64_case(dev)
    with torch.no_grad():
        o = triton_impl(kda_chunk)(*x)[0].double()
    return ((o - ref).abs().max() / ref.abs().max()).item()


def decode_step_ms(dev: torch.device) -> float:
    q, k, v, g, beta = inputs(DECODE_BATCH, dev, torch.Generator().manual_seed(3))
    cache = KDADecodeCache.allocate(DECODE_BATCH, H, DK, DV, torch.bfloat16, torch.float32, dev)
    cache.state.normal_(0, 0.1)
    slots = torch.arange(DECODE_BATCH, device=dev)
    positions = [torch.full((DECODE_BATCH,), i, device=dev) for i in range(CHUNK_SIZE)]
    step = triton_impl(kda_decode_step)
    it = iter(range(1 << 30))

    def run() -> None:
        with torch.no_grad():
            step(q, k, v, g, beta, positions[next(it) % CHUNK_SIZE], slots, cache)

    return median_ms(run, 4 * CHUNK_SIZE)


def measure(dev: torch.device, data: dict[tuple[int, int], tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    fwd = triton_impl(kda_chunk)
    row: dict[str, Any] = {"decode_equals_packed": decode_matches_chunk(dev), "fp64_rel_err": float64_error(dev)}
    for (t, n), x in data.items():
        with torch.no_grad():
            fwd(*x)
            torch.cuda.synchronize()
            row[f"fwd_{n}x{t}_ms"] = median_ms(lambda: fwd(*x), 3)
    row["decode_b256_ms"] = decode_step_ms(dev)
    return row


def fla_row(data: dict[tuple[int, int], tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    row: dict[str, Any] = {"config": "fla-core"}
    for (t, n), (q, k, v, g, beta, cu) in data.items():
        args = [a[None] for a in (q.bfloat16(), k.bfloat16(), v, g, beta.bfloat16())]
        cpu_cu = cu.cpu()
        with torch.no_grad():
            row[f"chunk_{n}x{t}_ms"] = median_ms(
                lambda: chunk_kda(*args, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cpu_cu), 3)
            row[f"recurrent_{n}x{t}_ms"] = median_ms(
                lambda: fused_recurrent_kda(*args, output_final_state=True, cu_seqlens=cu), 3)
    # forward + backward of chunk_kda on the training micro-batch's shape (what the trainer's KDA backward runs;
    # this also leaves fla's backward autotuning in Triton's cache for later steps)
    q, k, v, g, beta, cu = data[TRAIN_SHAPE]
    leaves = [a[None].detach().requires_grad_() for a in (q.bfloat16(), k.bfloat16(), v, g, beta.bfloat16())]
    cpu_cu = cu.cpu()

    def fwd_bwd() -> None:
        o = chunk_kda(*leaves, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cpu_cu)[0]
        o.backward(torch.ones_like(o))

    n, t = TRAIN_SHAPE[1], TRAIN_SHAPE[0]
    row[f"chunk_fwd_bwd_{n}x{t}_ms"] = median_ms(fwd_bwd, 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(KDA_RECURRENT_LAUNCHES),
                    help="comma-separated kda_recurrent_launch values (BVxWARPS); the first is the reference of --best")
    ap.add_argument("--best", default=None, help="write the configuration pick() chooses to this file")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    setup_logging()
    dev = require_cuda("kda_recurrent_configs.py")
    bw = copy_bandwidth_tb_s(dev)
    data = {(t, n): packed(t, n, dev) for t, n in SHAPES}
    rows: list[dict[str, Any]] = []
    configs = a.configs.split(",")
    for text in configs:
        row: dict[str, Any] = {"config": text}
        t0 = time.perf_counter()
        try:
            with numerics_scope(current_numerics().replace(kda_form="recurrent", kda_recurrent_launch=text)):
                row.update(measure(dev, data))
        except Exception as exc:  # a configuration that does not compile or run: keep the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["wall_s"] = time.perf_counter() - t0
        print(row, flush=True)
        rows.append(row)
    best = pick(rows, configs[0])
    print(f"picked: {best}", flush=True)
    if a.best:
        Path(a.best).write_text(best + "\n")
    state = H * DK * DV * 4
    decode_bound_ms = DECODE_BATCH * (2 * state + H * (3 * DK * 4 + DV * 2 + 4)) / (bw * 1e12) * 1e3
    cols = [("config", "BVxwarps", "s"), ("decode_equals_packed", "decode == packed", "s"),
            ("fp64_rel_err", "err vs fp64", ".1e")]
    cols += [(f"fwd_{n}x{t}_ms", f"{n}x{t} ms", ".2f") for t, n in SHAPES]
    cols += [("decode_b256_ms", "decode b256 ms", ".3f")]
    print(f"\nKDA recurrent form, H={H} dk={DK} dv={DV}; decode step bound at batch {DECODE_BATCH}: "
          f"{decode_bound_ms:.3f} ms ({bw:.2f} TB/s)")
    print(table(rows, cols))
    out = a.out or default_out("kda_recurrent_configs")
    result = {"benchmark": "kda_recurrent_configs", **env(), "copy_bandwidth_tb_s": bw, "shapes": SHAPES,
              "decode_batch": DECODE_BATCH, "decode_bound_ms": decode_bound_ms, "rows": rows, "picked": best,
              "pick_rule": {"keys": PICK_KEYS, "decode_slack": PICK_DECODE_SLACK, "reference": configs[0]},
              "fla": None}
    write_json(out, result)  # written before fla-core's baselines, which autotune for minutes on a fresh machine
    if not a.no_fla:
        try:
            result["fla"] = fla_row(data)
        except Exception as exc:  # fla-core missing or failing: keep zmrl's rows
            result["fla"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(result["fla"], flush=True)
        write_json(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
