"""Census of the kernel launches of one static (CUDA-graph-shaped) decode step: how many, which kernels, from
which layer and line.

    python benchmarks/decode_launch_census.py [--batch 4] [--layers 4] [--lora 32] [--context 256] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/decode_launch_census.py --interpret [...]   # on a CPU-only machine

A graph-replayed decode step at batch 256 runs ~1,150 kernels (benchmarks/results/
2026-12-05_h100_decode_gemms_summary.md); most of them take a few microseconds and are bound by launch and
ramp time, not by bytes, so the count itself is a cost. The count does not depend on the device: the step
is the same sequence of Triton launches and aten ops everywhere. So this census runs on a GPU or, with
``--interpret`` under ``TRITON_INTERPRET=1``, on the CPU with every invariant op forced onto its Triton
backend (the kernels run in Triton's interpreter), which gives the GPU's launch list on a machine without
one.

What runs: the bench preset (``--layers`` layers, the preset's layer pattern; ``--smoke``: the tiny preset),
bf16, LoRA rank ``--lora`` on every target, ``--batch`` sequences at ``--context`` tokens, one warm step and
then the counted one, both through ``DecodeGraphRunner`` in its eager "static" mode: the fixed-shape path a
CUDA graph captures.

What is counted: every Triton kernel launch (by kernel name), and every aten op that reaches a kernel outside
a Triton launch (views and allocations without a fill excluded: they launch nothing; an op the interpreter
issues while running a kernel is the kernel's own). Each launch is attributed to the decoder layer running
(its kind: KDA or MLA attention, MoE or dense MLP; or "head" for the embedding and the logits) and to the
innermost zmrl line outside the kernel floor. On CUDA an aten op can take more or fewer kernels than one
(a host-to-device copy is a memcpy, a fused op one kernel): the census counts ops, and is a faithful count of
Triton launches.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import build_bench_model, require_interpreter, default_out, env, setup_logging, table, write_json
from decode_throughput import PAGE, PENDING, fill_store, kda_template, make_seqs
from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.triton import triton_everywhere
from zmrl.model import ModelCache
from zmrl.rollout.graph_runner import DecodeGraphRunner
from zmrl.rollout.request import Request, SamplingParams

log = logging.getLogger("benchmarks.decode_launch_census")

ZMRL_DIR = str(Path(__file__).resolve().parents[1] / "zmrl") + "/"
# Ops that launch no kernel: views, and allocations that are not filled.
_NO_KERNEL = {"view", "_unsafe_view", "alias", "detach", "as_strided", "t", "transpose", "permute", "expand",
              "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "chunk", "reshape",
              "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "lift_fresh",
              "_reshape_alias", "unfold", "diagonal", "narrow", "view_as_real", "view_as_complex"}


def _site() -> str:
    """The innermost zmrl frame outside the kernel floor (which layer line issued the launch), else the
    innermost zmrl frame."""
    f = sys._getframe(2)
    inner = None
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(ZMRL_DIR):
            rel = f"{name[len(ZMRL_DIR) - 5:]}:{f.f_lineno}"
            inner = inner or rel
            if "/kernels_batch_invariant/" not in name and "/model/layers.py" not in name and "/lora/" not in name:
                return rel
        f = f.f_back
    return inner or "?"


def _interpreter_only(op: str) -> bool:
    """An op the GEMM wrapper adds only under the interpreter: it stores a 16-bit output in fp32 and rounds it
    with a torch copy (the interpreter's own conversion truncates), where the compiled kernel stores it."""
    if op != "copy_" or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    f = sys._getframe(3)
    while f is not None:
        if f.f_code.co_filename.startswith(ZMRL_DIR):
            return f.f_code.co_name == "_launch" and f.f_code.co_filename.endswith("triton/matmul.py")
        f = f.f_back
    return False


class LaunchCensus(TorchDispatchMode):
    """Counts Triton launches and kernel-reaching aten ops by (layer kind, kernel, site)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = "head"
        self.in_kernel = 0
        self.counts: collections.Counter = collections.Counter()  # (layer, kind, name, site) -> launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.in_kernel or func.is_view or name in _NO_KERNEL or _interpreter_only(name):
            return out
        self.counts[(self.layer, "aten", name, _site())] += 1
        return out

    def triton_launch(self, kernel: str) -> None:
        self.counts[(self.layer, "triton", kernel, _site())] += 1


def _patch_triton(census: LaunchCensus) -> list[tuple[Any, str, Any]]:
    """Count every Triton kernel launch (compiled ``JITFunction.run`` or the interpreter's), and mark the aten ops
    issued inside one as the kernel's own. Returns what to restore."""
    import triton.runtime.jit as jit

    patched = []
    targets = [(jit.JITFunction, "run")]
    try:
        import triton.runtime.interpreter as interp

        targets.append((interp.InterpretedFunction, "run"))
    except ImportError:
        pass
    for cls, attr in targets:
        original = getattr(cls, attr)

        def run(self, *args, __original=original, **kwargs):  # noqa: ANN001
            if not kwargs.get("warmup", False):
                census.triton_launch(getattr(self, "__name__", None) or self.fn.__name__)
            census.in_kernel += 1
            try:
                return __original(self, *args, **kwargs)
            finally:
                census.in_kernel -= 1

        setattr(cls, attr, run)
        patched.append((cls, attr, original))
    return patched


def _layer_kinds(model) -> dict[int, str]:
    from zmrl.model.kda import KimiDeltaAttention
    from zmrl.model.moe import MoE

    out = {}
    for i, layer in enumerate(model.model.layers):
        attn = "KDA" if isinstance(layer.self_attn, KimiDeltaAttention) else "MLA"
        out[i] = f"{attn}+{'MoE' if isinstance(layer.mlp, MoE) else 'MLP'}"
    return out


def census_step(model, batch: int, context: int, seed: int) -> tuple[LaunchCensus, dict[int, str]]:
    dev = next(model.parameters()).device
    cfg = model.config
    template = kda_template(model, dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ctx_tokens = context - PENDING
    pages = batch * -(-(ctx_tokens + 4) // PAGE) + 1
    cache = ModelCache(cfg, num_pages=pages, page_size=PAGE, dtype=model.dtype, device=dev)
    fill_store(cache, gen)
    seqs = make_seqs(cache, template, batch, ctx_tokens, 3)
    prompt = [1] * (ctx_tokens + 4)
    reqs = []
    for i, s in enumerate(seqs):
        r = Request(str(i), prompt, SamplingParams())
        r.seq = s
        reqs.append(r)
    runner = DecodeGraphRunner(model, cache.store, scratch_page=pages - 1, max_num_seqs=batch,
                               max_pages=max(len(s.pages) for s in seqs), mode="static")
    kinds = _layer_kinds(model)
    census = LaunchCensus()
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: setattr(census, "layer", kinds[i]))
             for i, layer in enumerate(model.model.layers)]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda mod, args: setattr(census, "layer", "head")))

    def step() -> None:
        census.layer = "head"
        runner.run(reqs)
        for s in seqs:
            s.num_tokens += 1

    with kernel_mode("bitwise"):
        step()  # warm: pool loads, table uploads, first-call caches
        patched = _patch_triton(census)
        try:
            with census:
                step()
        finally:
            for cls, attr, original in patched:
                setattr(cls, attr, original)
            for h in hooks:
                h.remove()
    return census, kinds


def summarize(census: LaunchCensus, kinds: dict[int, str]) -> dict[str, Any]:
    per_kind_layers = collections.Counter(kinds.values())
    by_layer: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_site: collections.Counter = collections.Counter()
    for (layer, kind, name, site), n in census.counts.items():
        by_layer[layer][(kind, name)] += n
        by_site[(layer, kind, name, site)] += n
    layers = []
    for layer, c in sorted(by_layer.items()):
        n_layers = per_kind_layers.get(layer, 1)
        layers.append({"layer": layer, "layers": n_layers, "launches": sum(c.values()),
                       "per_layer": sum(c.values()) / n_layers,
                       "triton_per_layer": sum(v for (k, _), v in c.items() if k == "triton") / n_layers,
                       "aten_per_layer": sum(v for (k, _), v in c.items() if k == "aten") / n_layers})
    sites = [{"layer": layer, "kind": kind, "kernel": name, "site": site, "launches": n,
              "per_layer": n / per_kind_layers.get(layer, 1)}
             for (layer, kind, name, site), n in by_site.most_common()]
    total = sum(census.counts.values())
    triton_total = sum(n for (_, kind, _, _), n in census.counts.items() if kind == "triton")
    return {"total": total, "triton": triton_total, "aten": total - triton_total, "layers": layers, "sites": sites}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="bench-preset layers (its pattern: every 4th is MLA)")
    ap.add_argument("--context", type=int, default=256, help="tokens per sequence (the launch list does not "
                    "depend on it while the key lists fit one MLA split)")
    ap.add_argument("--lora", type=int, default=32, metavar="R")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU: every invariant op on its Triton backend, run by Triton's interpreter "
                         "(needs TRITON_INTERPRET=1)")
    ap.add_argument("--smoke", action="store_true", help="the tiny preset on CPU, interpreted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    setup_logging()
    if a.smoke:
        a.interpret = True
    if a.interpret:
        require_interpreter("decode_launch_census.py --interpret")
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    else:
        raise SystemExit("decode_launch_census.py: no CUDA device; run with --interpret under TRITON_INTERPRET=1")
    if a.batch < 1 or a.context <= PENDING + PAGE:
        raise SystemExit(f"--batch must be >= 1 and --context > {PENDING + PAGE}, got {a.batch}, {a.context}")
    t0 = time.perf_counter()
    torch.manual_seed(a.seed)
    cfg, model = build_bench_model(a.layers, a.smoke, dev, a.lora, a.seed)
    with triton_everywhere() if a.interpret else contextlib.nullcontext():  # the Triton backends on the CPU too
        census, kinds = census_step(model, a.batch, a.context, a.seed)
    s = summarize(census, kinds)
    print(f"\nLaunches of one static decode step: {'tiny' if a.smoke else 'bench'} preset, "
          f"{cfg.num_hidden_layers} layers, LoRA r={a.lora}, batch {a.batch}, {dev.type}"
          f"{' (interpreted)' if a.interpret else ''}: {s['total']} ({s['triton']} Triton, {s['aten']} aten ops)")
    print(table(s["layers"], [("layer", "layer", "s"), ("layers", "layers", "d"), ("launches", "launches", "d"),
                              ("per_layer", "per layer", ".1f"), ("triton_per_layer", "Triton", ".1f"),
                              ("aten_per_layer", "aten", ".1f")]))
    print()
    print(table(s["sites"][:a.top], [("layer", "layer", "s"), ("kind", "kind", "s"), ("kernel", "kernel", "s"),
                                     ("site", "site", "s"), ("per_layer", "per layer", ".1f")]))
    payload = {"benchmark": "decode_launch_census", **env(), "preset": "tiny" if a.smoke else "bench",
               "layers": cfg.num_hidden_layers, "batch": a.batch, "lora_r": a.lora, "device": dev.type,
               "interpreted": a.interpret, "wall_s": time.perf_counter() - t0, **s}
    write_json(a.out or default_out("decode_launch_census" + ("_smoke" if a.smoke else "")), payload)
    return payload


if __name__ == "__main__":
    main()
