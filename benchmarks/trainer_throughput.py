"""Trainer throughput of the bench preset (bf16, LoRA r=32, H200): forward + backward per
activation-recompute policy, MFU, peak memory, bitwise vs fast kernels, and the KDA layer's
forward + backward next to fla-core's ``chunk_kda``.

    python benchmarks/trainer_throughput.py [--seq-lens 4096,4096,4096,4096] [--layers 16]
        [--modes bitwise,fast] [--recompute none,layer,selective,attention] [--backward-precision tf32,bf16] [--iters 3]
        [--kda-tokens 8192,32768] [--out FILE.json] [--smoke]

What is timed: one packed micro-batch (default 4 sequences x 4096 = 16K tokens, the second half of
each sequence being the "response") through ``zmrl.trainer.compute_logprobs`` with autograd on
(the RL trainer's forward: full-sequence logits, response-token log-probs), then ``backward`` of a
REINFORCE-style loss into the LoRA parameters (rank 32 on every attention projection and expert).
Per kernel mode and recompute policy (``zmrl.model.apply_recompute``; "fast" runs policy "none"
only): forward and forward+backward milliseconds (CUDA events, median of ``--iters`` after
``--warmup``), tokens/s (every packed token counts), peak allocated memory of the timed runs, and
MFU = FLOPs / time / measured bf16 matmul peak, FLOPs by the formula in ``benchmarks/_train_flops.py``
(matmul FLOPs of the forward, input-gradient and LoRA weight-gradient passes, plus MLA attention,
indexer and KDA FLOPs; recompute is not counted as useful work).

KDA layer (``--kda-tokens``, one sequence of T tokens, H = 16, d = 128, the model's dtypes: q, k, g,
beta fp32, v bf16): zmrl's Triton forward alone, zmrl forward + fla-core backward (what the trainer
runs), fla ``chunk_kda`` forward and forward + backward (q, k, v, beta bf16, g fp32), and at the
smallest T the previous backward (the torch composition under autograd) for comparison.

``--smoke``: CPU, tiny preset and shapes; checks the script end to end (numbers meaningless).
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Any, Callable

import torch

from _common import (build_bench_model, OOM_ERRORS, cuda_time_ms, default_out, empty_cache, env, model_config,
                     pick_device, print_profile, profile_step, setup_logging, table, write_json)
from _train_flops import expected_peak_memory, measured_matmul_peak_tflops, train_flops
from zmrl.kernels_batch_invariant import current_numerics, kernel_mode, numerics_scope
from zmrl.kernels_batch_invariant.numerics import BACKWARD_MATMUL_PRECISIONS
from zmrl.lora import lora_parameters
from zmrl.model import RECOMPUTE_POLICIES, apply_recompute
from zmrl.trainer import compute_logprobs

log = logging.getLogger("benchmarks.trainer")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    out = [x for x in s.split(",") if x]
    bad = [x for x in out if x not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown value(s) {bad} (allowed: {', '.join(allowed)})")
    return out


def _peak_reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()
        empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None


# ----------------------------------------------------------------------------- the model


def bench_model(a: argparse.Namespace, dev: torch.device, peak_tflops: float | None,
                on_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> list[dict[str, Any]]:
    """``on_row(rows)`` runs after each configuration (the caller writes the JSON: a run cut short by a
    time limit keeps every configuration it finished)."""
    t0 = time.perf_counter()
    cfg, model = build_bench_model(a.layers, a.smoke, dev, a.lora_r, a.seed)
    params = lora_parameters(model)
    log.info("model: %d layers, LoRA r=%d (%.1f M trainable), built in %.1fs", cfg.num_hidden_layers, a.lora_r,
             sum(p.numel() for p in params) / 1e6, time.perf_counter() - t0)
    g = torch.Generator().manual_seed(a.seed)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in a.seq_lens]
    plens = [max(1, n // 2) for n in a.seq_lens]
    tokens = sum(a.seq_lens)
    logit_rows = sum(n - p for n, p in zip(a.seq_lens, plens))
    flops = train_flops(cfg, a.seq_lens, a.lora_r, logit_rows=logit_rows)
    log.info("FLOPs per forward+backward: %.1f TFLOP (%s)", flops.total / 1e12,
             ", ".join(f"{k} {v / 1e12:.2f}" for k, v in flops.as_dict().items() if k != "total"))

    def forward() -> list[torch.Tensor]:
        with torch.enable_grad():
            return compute_logprobs(model, seqs, plens, 1.0, micro_batch_tokens=None,
                                    logprob_chunk_tokens=a.logprob_chunk)

    def forward_backward() -> None:
        lps = forward()
        n = sum(lp.numel() for lp in lps)
        loss = -sum(lp.sum() for lp in lps) / n
        loss.backward()

    def zero() -> None:
        for p in params:
            p.grad = None

    rows: list[dict[str, Any]] = []
    for mode in a.modes:
        fwd_ms = None
        policies = a.recompute if mode == "bitwise" else ["none"]
        for policy, precision in [(p, b) for p in policies for b in a.backward_precision]:
            row: dict[str, Any] = {"mode": mode, "recompute": policy, "backward_precision": precision, "tokens": tokens}
            expected = expected_peak_memory(cfg, a.seq_lens, a.lora_r, policy, a.logprob_chunk or logit_rows, logit_rows)
            row["expected_peak_gib"] = expected.total / 2**30
            row["expected_peak_parts_gib"] = {k: v / 2**30 for k, v in expected.as_dict().items() if k != "policy"}
            apply_recompute(model, policy)
            try:  # one configuration failing must not hide the others
                with kernel_mode(mode), numerics_scope(current_numerics().replace(backward_matmul_precision=precision)):
                    if fwd_ms is None:  # the forward does not depend on the policy
                        fwd_ms = cuda_time_ms(forward, warmup=a.warmup, iters=a.iters, setup=zero)["median_ms"]
                        log.info("%s: forward %.0f ms", mode, fwd_ms)
                    row["fwd_ms"] = fwd_ms
                    zero()
                    _peak_reset(dev)
                    fb = cuda_time_ms(forward_backward, warmup=a.warmup, iters=a.iters, setup=zero)
                row["fwdbwd_ms"] = fb["median_ms"]
                row["tok_s"] = tokens / (fb["median_ms"] * 1e-3)
                row["tflop_s"] = flops.total / (fb["median_ms"] * 1e-3) / 1e12
                if peak_tflops:
                    row["mfu"] = row["tflop_s"] / peak_tflops
                log.info("%s/%s/%s: forward %.0f ms, forward+backward %.0f ms", mode, policy, precision, fwd_ms,
                         fb["median_ms"])
            except OOM_ERRORS:
                row["error"] = "out of memory"
                log.warning("%s/%s/%s: out of memory", mode, policy, precision)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                log.exception("trainer benchmark %s/%s/%s failed", mode, policy, precision)
            finally:
                zero()
                row["peak_gib"] = _peak_gib(dev)
                empty_cache()
            rows.append(row)
            on_row(rows)
    apply_recompute(model, "none")
    extra: list[dict[str, Any]] = [{"flops": flops.as_dict()}]
    if a.profile and dev.type == "cuda":
        try:
            # the backward precision of the last configuration timed (the profile shows what was measured)
            precision = a.backward_precision[-1]
            with kernel_mode("bitwise"), numerics_scope(current_numerics().replace(backward_matmul_precision=precision)):
                zero()
                prof_fwd = profile_step(forward, cuda=True, steps=1, top=a.profile)
                zero()
                prof = profile_step(forward_backward, cuda=True, steps=1, top=a.profile)
                zero()
            print_profile(f"GPU time by kernel, one training forward (bitwise): "
                          f"{prof_fwd[-1]['ms_per_step']:.0f} ms busy", prof_fwd)
            print_profile(f"GPU time by kernel, one forward+backward (bitwise, recompute none, {precision} backward): "
                          f"{prof[-1]['ms_per_step']:.0f} ms busy", prof)
            extra.append({"profile_forward": prof_fwd, "profile": prof})
        except Exception as e:  # noqa: BLE001 (the profile is extra information)
            log.exception("profiling failed: %s", e)
    if a.sync_census and dev.type == "cuda":
        with kernel_mode("bitwise"), numerics_scope(current_numerics().replace(
                backward_matmul_precision=a.backward_precision[-1])):
            zero()
            sites = sync_census(forward_backward)
            zero()
        print(f"\nHost syncs in one forward+backward (bitwise): {sum(r['syncs'] for r in sites)}")
        print(table(sites, [("site", "call site", "s"), ("syncs", "syncs", "d")]))
        extra.append({"sync_census": sites})
    print(f"\nTrainer forward+backward, {'tiny (smoke)' if a.smoke else 'bench'} preset "
          f"({cfg.num_hidden_layers} layers) bf16, LoRA r={a.lora_r}, packed micro-batch "
          f"{'+'.join(map(str, a.seq_lens))} = {tokens} tokens; {flops.total / 1e12:.1f} TFLOP per fwd+bwd "
          f"(benchmarks/_train_flops.py); matmul peak {peak_tflops or float('nan'):.0f} TFLOP/s measured")
    print(table(rows, [("mode", "mode", "s"), ("recompute", "recompute", "s"),
                       ("backward_precision", "bwd GEMMs", "s"), ("fwd_ms", "fwd ms", ".0f"),
                       ("fwdbwd_ms", "fwd+bwd ms", ".0f"), ("tok_s", "tok/s", ".0f"),
                       ("tflop_s", "TFLOP/s", ".1f"), ("mfu", "MFU", ".1%"), ("peak_gib", "peak GiB", ".1f"),
                       ("expected_peak_gib", "expected GiB", ".1f"), ("error", "error", "s")]))
    return rows + extra


def sync_census(step: Callable[[], Any]) -> list[dict[str, Any]]:
    """The host syncs of one ``step`` on CUDA, by the Python line that asked for them (torch's sync debug mode
    warns at every synchronizing operation: ``.item()``, ``.tolist()``, ``unique``, a boolean-mask index...).
    Each one drains the GPU's queue; the step's time between kernels (wall minus busy) is where they show."""
    import warnings
    from collections import Counter

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    sites = Counter(f"{w.filename.split('/zmrl/')[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return [{"site": site, "syncs": n} for site, n in sites.most_common()]


# ----------------------------------------------------------------------------- the KDA layer


def _kda_inputs(t: int, dev: torch.device, seed: int = 0, h: int = 16, d: int = 128):
    """One sequence of T tokens with the model's dtypes and statistics (q, k L2-normalised, KDA's
    lower-bound gate as in the bench preset, beta in (0, 1))."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, h, d, device=dev, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, d, device=dev, generator=g), dim=-1)
    v = torch.randn(t, h, d, device=dev, generator=g).to(torch.bfloat16)
    gate = -5.0 * torch.sigmoid(torch.randn(t, h, d, device=dev, generator=g) - 4.0)
    beta = torch.sigmoid(torch.randn(t, h, device=dev, generator=g))
    cu = torch.tensor([0, t], dtype=torch.int64, device=dev)
    return q, k, v, gate, beta, cu


def bench_kda(a: argparse.Namespace, dev: torch.device) -> list[dict[str, Any]]:
    from zmrl.kernels_batch_invariant.kda import kda_chunk
    from zmrl.kernels_batch_invariant.triton import kda_chunk_bwd

    chunk_kda = None
    if dev.type == "cuda":  # fla's kernels need a GPU
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:  # noqa: BLE001 (any import failure: report it, time the rest)
            log.warning("fla-core unavailable (%s): the fla columns stay empty", e)
    h, d = (2, 16) if a.smoke else (16, 128)
    rows = []
    for i, t in enumerate(a.kda_tokens):
        q, k, v, gate, beta, cu = _kda_inputs(t, dev, h=h, d=d)
        w = torch.randn(t, h, d, device=dev, dtype=torch.float32)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gate, beta)]

        def zero() -> None:
            for x in leaves:
                x.grad = None

        def zmrl_fwd() -> None:
            with torch.no_grad():
                kda_chunk(q, k, v, gate, beta, cu)

        def zmrl_fwdbwd() -> None:
            o, _, _ = kda_chunk(*leaves, cu)
            (o.float() * w).sum().backward()

        row: dict[str, Any] = {"T": t, "H": h, "d": d}
        cases: list[tuple[str, Callable[[], None]]] = [("zmrl_fwd_ms", zmrl_fwd), ("zmrl_fwd_fla_bwd_ms", zmrl_fwdbwd)]
        if chunk_kda is not None:
            fq, fk, fv, fb = (x.to(torch.bfloat16)[None] for x in (q, k, v, beta))
            fg = gate[None]
            f_leaves = [x.clone().requires_grad_(True) for x in (fq, fk, fv, fg, fb)]

            def fla_fwd() -> None:
                with torch.no_grad():
                    chunk_kda(fq, fk, fv, fg, fb, cu_seqlens=cu)

            def fla_fwdbwd() -> None:
                o, _ = chunk_kda(*f_leaves, cu_seqlens=cu)
                (o[0].float() * w).sum().backward()
                for x in f_leaves:
                    x.grad = None

            cases += [("fla_fwd_ms", fla_fwd), ("fla_fwdbwd_ms", fla_fwdbwd)]
        if i == 0 and a.kda_old_backward:
            def old_fwdbwd() -> None:
                saved = kda_chunk_bwd.fla_backend_for
                kda_chunk_bwd.fla_backend_for = lambda _q: None  # the torch-composition backward
                try:
                    zmrl_fwdbwd()
                finally:
                    kda_chunk_bwd.fla_backend_for = saved

            cases.append(("zmrl_fwd_torch_bwd_ms", old_fwdbwd))
        for key, fn in cases:
            try:
                iters = 1 if key == "zmrl_fwd_torch_bwd_ms" else a.iters
                row[key] = cuda_time_ms(fn, warmup=1, iters=iters, setup=zero)["median_ms"]
            except OOM_ERRORS:
                row[key + "_error"] = "out of memory"
            except Exception as e:  # noqa: BLE001
                row[key + "_error"] = f"{type(e).__name__}: {e}"[:200]
                log.exception("KDA %s at T=%d failed", key, t)
            finally:
                zero()
                empty_cache()
        rows.append(row)
    print("\nKDA layer, one sequence, H=%d, d=%d (zmrl: q/k/g/beta fp32, v bf16; fla: q/k/v/beta bf16, g fp32)" % (h, d))
    print(table(rows, [("T", "T", "d"), ("zmrl_fwd_ms", "zmrl fwd", ".2f"),
                       ("zmrl_fwd_fla_bwd_ms", "zmrl fwd + fla bwd", ".2f"), ("fla_fwd_ms", "fla fwd", ".2f"),
                       ("fla_fwdbwd_ms", "fla fwd+bwd", ".2f"),
                       ("zmrl_fwd_torch_bwd_ms", "zmrl fwd + torch bwd (old)", ".1f")]))
    return rows


def print_expected_memory(a: argparse.Namespace) -> None:
    """The analytic peak-memory model (benchmarks/_train_flops.py) per recompute policy, in GiB."""
    cfg = model_config(a.layers, a.smoke)
    plens = [max(1, n // 2) for n in a.seq_lens]
    logit_rows = sum(n - p for n, p in zip(a.seq_lens, plens))
    rows = []
    for policy in RECOMPUTE_POLICIES:
        e = expected_peak_memory(cfg, a.seq_lens, a.lora_r, policy, a.logprob_chunk or logit_rows, logit_rows)
        rows.append({k: (v / 2**30 if isinstance(v, float) else v) for k, v in e.as_dict().items()})
    print(f"Expected peak memory (GiB), {'tiny' if a.smoke else 'bench'} preset, {cfg.num_hidden_layers} layers, "
          f"{'+'.join(map(str, a.seq_lens))} tokens, LoRA r={a.lora_r}, lm_head chunk {a.logprob_chunk}")
    print(table(rows, [("policy", "recompute", "s"), ("weights", "weights", ".2f"), ("lora", "LoRA+grad", ".2f"),
                       ("kept", "kept", ".2f"), ("working", "working", ".2f"), ("logits", "logits", ".2f"),
                       ("total", "total", ".1f")]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=_ints, default=[4096] * 4, help="packed sequences (default 4 x 4096)")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16 = the full bench preset)")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--modes", default="bitwise,fast")
    ap.add_argument("--recompute", default=",".join(RECOMPUTE_POLICIES),
                    help=f"policies to time in bitwise mode (allowed: {', '.join(RECOMPUTE_POLICIES)})")
    ap.add_argument("--backward-precision", default="tf32",
                    help="backward_matmul_precision values to measure, comma-separated (tf32, bf16, ieee)")
    ap.add_argument("--logprob-chunk", type=int, default=1024,
                    help="rows per lm_head + log-prob chunk (TrainerConfig.logprob_chunk_tokens; 0 = unchunked)")
    ap.add_argument("--expected-memory", action="store_true",
                    help="only print the expected peak memory per recompute policy (no device needed) and exit")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--kda-tokens", type=_ints, default=[8192, 32768],
                    help="T of the KDA layer comparison (empty: skip it)")
    ap.add_argument("--no-kda-old-backward", dest="kda_old_backward", action="store_false",
                    help="skip timing the previous (torch-composition) KDA backward")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile one forward+backward and list the N kernels with the most GPU time")
    ap.add_argument("--no-model", dest="model", action="store_false", help="only the KDA layer comparison")
    ap.add_argument("--sync-census", action="store_true",
                    help="CUDA: count the host syncs of one bitwise forward+backward by call site")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON result (default benchmarks/results/<date>_trainer_throughput_<device>.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny shapes: checks the script runs")
    a = ap.parse_args()
    setup_logging()
    a.modes = _names(a.modes, ("bitwise", "fast"), "--modes")
    a.recompute = _names(a.recompute, RECOMPUTE_POLICIES, "--recompute")
    a.backward_precision = _names(a.backward_precision, BACKWARD_MATMUL_PRECISIONS, "--backward-precision")
    a.logprob_chunk = a.logprob_chunk or None
    if a.expected_memory:
        print_expected_memory(a)
        return 0
    dev = pick_device("trainer_throughput.py", a.smoke)
    if a.smoke:
        a.seq_lens, a.iters, a.warmup = [100, 60, 130], 1, 1
        a.kda_tokens = [min(t, 130) for t in a.kda_tokens][:1]
    t_start = time.perf_counter()
    out = a.out or default_out("trainer_throughput" + ("_smoke" if a.smoke else ""))
    peak = measured_matmul_peak_tflops(dev) if dev.type == "cuda" else None
    result = {"benchmark": "trainer_throughput", **env(), "preset": "tiny" if a.smoke else "bench",
              "layers": a.layers, "dtype": "bfloat16", "seq_lens": a.seq_lens, "lora_r": a.lora_r,
              "warmup": a.warmup, "iters": a.iters, "matmul_peak_tflop_s": peak,
              "flop_formula": "benchmarks/_train_flops.py", "model": [], "kda_layer": []}
    # Written after each part: a run cut short by a time limit keeps what it measured.
    def partial(rows: list[dict[str, Any]]) -> None:
        write_json(out, {**result, "model": rows, "wall_s": time.perf_counter() - t_start})

    model_rows = result["model"] = bench_model(a, dev, peak, partial) if a.model else []
    write_json(out, {**result, "wall_s": time.perf_counter() - t_start})
    kda_rows = result["kda_layer"] = bench_kda(a, dev) if a.kda_tokens else []
    write_json(out, {**result, "wall_s": time.perf_counter() - t_start})
    failed = [r for r in model_rows if "error" in r] + [r for r in kda_rows if any(k.endswith("_error") for k in r)]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
