"""The KDA decode step: zmrl's ``kda_decode_step`` vs fla-core's ``fused_recurrent_kda`` (H200).

One decode step of one KDA layer for B sequences (bench preset heads: H = 16, dk = dv = 128; fp32 state,
bf16 v), averaged over 64 consecutive positions (a whole chunk: the rows a step reads grow from 1 to 64)
and over sequences spread over all chunk rows. Compared with:

* ``zmrl_step``: ``kda_decode_step`` (Triton; solves the new row only) — the engine's path;
* ``zmrl_resolve``: ``kda_chunk_step`` on gathered slots (the previous decode path: the whole partial
  chunk re-solved every step) — for the record;
* ``fla_recurrent``: fla-core's ``fused_recurrent_kda`` one token with ``initial_state`` and
  ``output_final_state`` (reads and writes the state every step; not bitwise equal to any chunked pass).

Bound: the bytes a step must move for each method (zmrl: the state read, the chunk rows so far and the kept
rows of the solve, the state written once per 64 steps; fla: the state read and written) over the
device-to-device copy bandwidth measured in the same run.

    python benchmarks/kda_decode_vs_fla.py [--batches 1 64 256] [--out FILE.json] [--sweep]

``--sweep`` (largest batch only) times the step under other launch configurations (warps of the two
kernels, the recurrence's state tile width BV, the intra kernel's register cap) over one whole chunk of
positions and says whether every output row is bitwise the default configuration's; it also times
configurations of the intra kernel's warps and column blocks (BK, BVI), which are shared numerics (prefill,
trainer and decode change bits together). For every configuration it checks that the decoded rows equal
``kda_chunk``'s under that configuration and, where the configuration reaches the chunk kernel, times its forward over a 16K-token
micro-batch.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from _common import copy_bandwidth_tb_s, default_out, env, setup_logging, table, write_json
from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.numerics import KDA_FORMS
from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, KDADecodeCache, kda_chunk_step, kda_decode_prime, kda_decode_step
from zmrl.kernels_batch_invariant.triton import triton_impl

log = logging.getLogger("benchmarks.kda_decode")
H, DK, DV, C = 16, 128, 128, CHUNK_SIZE


def events_ms(fn: Callable[[], Any], reps: int) -> float:
    """Mean ms of ``fn`` over ``reps`` calls after a warm-up call (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def inputs(lead: int | tuple[int, ...], dev: torch.device, gen: torch.Generator):
    """q, k (L2-normalised), v (bf16), g (log-decay in [-0.05, 0]), beta of leading shape ``lead`` ([B] for a
    decode step, [N, T] for sequences, [T] for packed tokens) on ``dev``."""
    lead = (lead,) if isinstance(lead, int) else lead
    q = F.normalize(torch.randn(*lead, H, DK, generator=gen), dim=-1).to(dev)
    k = F.normalize(torch.randn(*lead, H, DK, generator=gen), dim=-1).to(dev)
    v = torch.randn(*lead, H, DV, generator=gen).to(dev, torch.bfloat16)
    g = (-0.05 * torch.rand(*lead, H, DK, generator=gen)).to(dev)
    beta = torch.sigmoid(torch.randn(*lead, H, generator=gen)).to(dev)
    return q, k, v, g, beta


SWEEP_KDA = ({"decode_inter_warps": 2}, {"decode_BV": 32}, {"decode_intra_maxnreg": 128},
             {"decode_BV": 32, "decode_inter_maxnreg": 168},
             # Shared numerics: the intra kernel's warps (its reductions' layouts) and its dk / dv column blocks (the
             # K blocking of its products) move the bits of prefill and decode together, so these rows are judged by
             # "decode == chunk" and by the chunk forward's time, not by "same bits as the default".
             {"intra_warps": 8}, {"intra_warps": 2}, {"BK": 32, "BVI": 32},
             {"BK": 32, "BVI": 32, "decode_intra_maxnreg": 128})
SHARED_NUMERICS_KEYS = {"BK", "BVI", "intra_warps"}
CHUNK_TOKENS = (4096, 4096, 4096, 4096)  # the chunk forward timed per configuration: a 16K-token micro-batch


def decode_matches_chunk(dev: torch.device, n: int = 8, t: int = 80, seed: int = 1) -> bool:
    """n sequences decoded from position 0 for t steps: every output row bitwise the Triton ``kda_chunk``
    row of the same sequences in one pass (under whatever ``_launch_config`` is in force). The same inputs
    for every configuration (``seed``)."""
    from zmrl.kernels_batch_invariant.kda import kda_chunk

    q, k, v, g, beta = inputs((n, t), dev, torch.Generator().manual_seed(seed))
    cache = KDADecodeCache.allocate(n, H, DK, DV, torch.bfloat16, torch.float32, dev)
    slots = torch.arange(n, device=dev)
    with torch.no_grad():
        triton_impl(kda_decode_prime)(slots, torch.zeros_like(slots), cache)
        rows = [triton_impl(kda_decode_step)(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i],
                                              torch.full((n,), i, device=dev), slots, cache) for i in range(t)]
        cu = torch.arange(0, n * t + 1, t, device=dev, dtype=torch.int32)
        o, _, _ = triton_impl(kda_chunk)(*(x.reshape(n * t, *x.shape[2:]) for x in (q, k, v, g, beta)), cu)
    return torch.equal(torch.stack(rows, dim=1).reshape(n * t, H, DV), o)


def chunk_forward_us(inputs: tuple[torch.Tensor, ...], repeats: int = 5) -> float:
    """The Triton ``kda_chunk`` forward over ``inputs`` (``chunk_inputs``): median of ``repeats`` CUDA-event
    means of 10 calls (single means of this launch spread by ~5 % between configurations that do not touch it)."""
    from zmrl.kernels_batch_invariant.kda import kda_chunk

    fwd = triton_impl(kda_chunk)

    def run() -> None:
        with torch.no_grad():
            fwd(*inputs)

    return statistics.median(events_ms(run, 10) for _ in range(repeats)) * 1e3


def chunk_inputs(dev: torch.device, seed: int = 2) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta, cu_seqlens of CHUNK_TOKENS packed sequences on ``dev``."""
    q, k, v, g, beta = inputs(sum(CHUNK_TOKENS), dev, torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, *torch.tensor(CHUNK_TOKENS).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    return q, k, v, g, beta, cu


def sweep_rows(b: int, dev: torch.device, gen: torch.Generator) -> list[dict[str, Any]]:
    """Each SWEEP_KDA override of ``_launch_config``: mean step time over one chunk of positions, whether all
    outputs equal the default configuration's bitwise, whether decoded rows equal ``kda_chunk``'s under the
    same configuration, and (shared-numerics configurations and the default) the chunk forward's time at
    CHUNK_TOKENS."""
    from zmrl.kernels_batch_invariant.triton import kda_chunk as tk

    default = tk._launch_config
    q, k, v, g, beta = inputs(b, dev, gen)
    slots = torch.randperm(b, generator=gen).to(dev)
    pos0 = torch.randint(0, C, (b,), generator=gen).to(dev) + C  # mid-chunk starts, a chunk behind
    state0 = torch.randn(b, H, DK, DV, generator=gen).to(dev) * 0.1
    step = triton_impl(kda_decode_step)
    prime = triton_impl(kda_decode_prime)
    chunk_in = chunk_inputs(dev)

    def run(overrides: dict[str, Any]) -> dict[str, Any]:
        tk._launch_config = lambda dk, dv: {**default(dk, dv), **overrides}
        try:
            cache = KDADecodeCache.allocate(b, H, DK, DV, torch.bfloat16, torch.float32, dev)
            cache.state.copy_(state0)
            with torch.no_grad():
                prime(slots, torch.zeros_like(slots), cache)
                outs = [step(q * (1 + 0.01 * i), k, v, g, beta, pos0 + i, slots, cache) for i in range(C)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(C):
                    step(q, k, v, g, beta, pos0 + C + i, slots, cache)
                torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / C * 1e6
            # the chunk forward only where the configuration reaches the chunk kernel (the default for reference)
            chunk_us = chunk_forward_us(chunk_in) if not overrides or SHARED_NUMERICS_KEYS & set(overrides) else None
            return {"step_us": us, "out": torch.stack(outs), "decode_equals_chunk": decode_matches_chunk(dev),
                    "chunk_fwd_us": chunk_us}
        finally:
            tk._launch_config = default

    base = run({})
    base_out = base.pop("out")
    rows = [{"batch": b, "config": "default", "shared_numerics": False, "bitwise_equal": True, **base}]
    for ov in SWEEP_KDA:
        row: dict[str, Any] = {"batch": b, "config": ",".join(f"{key}={val}" for key, val in ov.items()),
                               "shared_numerics": bool(SHARED_NUMERICS_KEYS & set(ov))}
        try:
            res = run(ov)
            row.update(bitwise_equal=bool(torch.equal(res.pop("out"), base_out)), **res)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time other launch configurations (largest batch; "
                    "the chunked form's)")
    ap.add_argument("--kda-form", choices=KDA_FORMS, default=current_numerics().kda_form,
                    help="Numerics.kda_form to measure (default: the applied one)")
    a = ap.parse_args()
    if a.sweep and a.kda_form != "chunk":
        ap.error("--sweep times the chunked form's launch configurations: add --kda-form chunk")
    setup_logging()
    with numerics_scope(current_numerics().replace(kda_form=a.kda_form)):
        return _run(a)


def _run(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("kda_decode_vs_fla.py needs a CUDA device")
    dev = torch.device("cuda")
    bw = copy_bandwidth_tb_s(dev)
    gen = torch.Generator().manual_seed(0)
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception as exc:  # fla-core missing or failing to initialise
        fused_recurrent_kda, fla_error = None, f"{type(exc).__name__}: {exc}"
    else:
        fla_error = None
    step = triton_impl(kda_decode_step)
    resolve = triton_impl(kda_chunk_step)
    rows: list[dict[str, Any]] = []
    for b in a.batches:
        row: dict[str, Any] = {"batch": b}
        rows.append(row)
        q, k, v, g, beta = inputs(b, dev, gen)
        cache = KDADecodeCache.allocate(b, H, DK, DV, torch.bfloat16, torch.float32, dev)
        cache.state.normal_(0, 0.1)
        slots = torch.randperm(b, generator=gen).to(dev)
        # sequences spread over every chunk row; each call advances every position by one
        pos0 = torch.randint(0, C, (b,), generator=gen).to(dev)
        positions = [pos0 + i for i in range(C)]
        it = iter(range(1 << 30))

        def zmrl_step() -> None:
            with torch.no_grad():
                step(q, k, v, g, beta, positions[next(it) % C], slots, cache)

        for p in positions:  # fill the cache rows once (every row of every chunk written)
            with torch.no_grad():
                step(q, k, v, g, beta, p, slots, cache)
        row["zmrl_step_us"] = events_ms(zmrl_step, 4 * C) * 1e3
        state = H * DK * DV * 4
        if a.kda_form == "recurrent":  # the running state read and written, the new row stored
            zmrl_bytes = b * (2 * state + H * (DK * 4 + DV * 2 + DK * 4 + 4) + state / C)
        else:
            rows_read = (C + 1) / 2  # mean chunk rows so far
            per_row = H * (DK * 4 + DV * 2 + DK * 4 + 4) + H * (C * 4 + DV * 4)  # k, v, g, beta + kept T row, v_e row
            zmrl_bytes = b * (state + rows_read * per_row + state / C)
        row["zmrl_bound_us"] = zmrl_bytes / (bw * 1e12) * 1e6
        row["zmrl_frac"] = row["zmrl_bound_us"] / row["zmrl_step_us"]

        n_rows = (pos0 % C + 1)
        qc = torch.zeros(b, C, H, DK, device=dev)
        kc, gc = cache.k[slots], cache.g[slots]
        vc, bc = cache.v[slots], cache.beta[slots]

        def zmrl_resolve() -> None:
            with torch.no_grad():
                resolve(qc, kc, vc, gc, bc, n_rows, cache.state[slots])

        row["zmrl_resolve_us"] = events_ms(zmrl_resolve, 20) * 1e3
        if fused_recurrent_kda is not None:
            st = torch.randn(b, H, DK, DV, device=dev) * 0.1
            q4, k4, v4, b4 = (x[:, None].to(torch.bfloat16) for x in (q, k, v, beta))  # [B, T=1, H, ...]
            g4 = g[:, None]  # log-space gate stays fp32

            def fla_step() -> None:
                with torch.no_grad():
                    fused_recurrent_kda(q4, k4, v4, g4, b4, scale=DK**-0.5, initial_state=st, output_final_state=True)

            try:
                row["fla_recurrent_us"] = events_ms(fla_step, 50) * 1e3
                row["fla_bound_us"] = b * 2 * state / (bw * 1e12) * 1e6
                row["zmrl_over_fla"] = row["fla_recurrent_us"] / row["zmrl_step_us"]
            except Exception as exc:  # keep the zmrl numbers
                row["fla_error"] = f"{type(exc).__name__}: {exc}"[:200]
        del cache
        torch.cuda.empty_cache()
    cols = [("batch", "batch", "d"), ("zmrl_step_us", "zmrl step us", ".1f"), ("zmrl_bound_us", "bound us", ".1f"),
            ("zmrl_frac", "of bound", ".1%"), ("zmrl_resolve_us", "re-solve us", ".1f"),
            ("fla_recurrent_us", "fla recurrent us", ".1f"), ("zmrl_over_fla", "fla/zmrl time", ".2f")]
    print(f"\nKDA decode step, H={H} dk={DK} dv={DV}, copy bandwidth {bw:.2f} TB/s" +
          (f" (fla unavailable: {fla_error})" if fla_error else ""))
    print(table(rows, cols))
    sweep = sweep_rows(max(a.batches), dev, gen) if a.sweep else []
    if sweep:
        print(table(sweep, [("config", "config", "s"), ("step_us", "step us (host-timed)", ".1f"),
                            ("shared_numerics", "shared numerics", "s"),
                            ("bitwise_equal", "same bits as default", "s"), ("decode_equals_chunk", "decode == chunk", "s"),
                            ("chunk_fwd_us", "chunk fwd us", ".1f")]))
    write_json(a.out or default_out("kda_decode_vs_fla"),
               {"benchmark": "kda_decode_vs_fla", **env(), "copy_bandwidth_tb_s": bw, "heads": H, "dk": DK, "dv": DV,
                "fla_error": fla_error, "results": rows, "sweep": sweep, "time": time.time()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
