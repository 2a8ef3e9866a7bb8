"""Census of the torch ops one trainer forward + backward issues: which aten ops, how many, how many
bytes they move, and which line of zmrl issued them.

    python benchmarks/trainer_op_census.py [--layers 2] [--seq-lens 256,256] [--lora-r 32]
        [--device cpu|cuda] [--top 25] [--out FILE.json] [--smoke]

What runs: the bench preset (``benchmarks/_common.py``: ``model_config`` / ``build_on_device``) with
``--layers`` layers (the preset's own pattern; fewer than 4: the last is MLA+DSA), bf16, LoRA rank
``--lora-r`` on every target (``zmrl.lora.apply_lora``), one packed micro-batch of ``--seq-lens``
(the second half of each sequence is the response), ``zmrl.trainer.compute_logprobs`` with autograd,
then ``backward`` of the sum of the log-probs: the path ``benchmarks/trainer_throughput.py`` times.

How: a ``TorchDispatchMode`` sees every aten op that reaches a kernel (views are counted but move no
bytes). Per op it records the phase (forward = the log-prob forward and the loss; backward =
``loss.backward()``), the output dtype, elements written, bytes moved (inputs read + outputs
written, by their sizes: an upper bound for broadcast inputs), and the issuing site: the innermost
frame inside ``zmrl/`` (outside the dispatch machinery ``_dispatch.py`` / ``triton/_autograd.py``),
or, for an op autograd runs in C++ (no Python frame), ``autograd:<node name>``. Each op is also
tagged with the invariant op (``linear``, ``rms_norm``, ...) whose backend issued it, in the forward
by the call stack and in the backward by the autograd nodes that op's forward created; untagged ops
are the glue between kernels (LoRA adds, casts, MoE routing and dispatch, residuals, hand-written
backwards' helpers).

Which backend runs depends on the device: on CPU the torch backends (their forward compositions and
autograd through them appear, tagged with the op name); on CUDA the Triton kernels (invisible here:
they are not aten ops) with their hand-written backwards. The glue is the same torch code on both,
which is what this census is for. On CUDA it also counts the host syncs per call site
(``torch.cuda.set_sync_debug_mode``: ``.item()``, ``.tolist()``, blocking host-to-device copies,
``unique``): each drains the launch queue and leaves the GPU idle while the host catches up. Prints per
phase a table by (op, dtype), the top call sites by bytes (and the syncs), and writes everything to JSON (``--out``; default benchmarks/results/<date>_trainer_op_census_<dev>.json).

``--smoke``: the tiny preset and two 24-token sequences on CPU (checks the script end to end).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import build_bench_model, require_interpreter, default_out, env, setup_logging, table, write_json
from zmrl.kernels_batch_invariant import _dispatch, current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.numerics import BACKWARD_MATMUL_PRECISIONS
from zmrl.kernels_batch_invariant.triton import triton_everywhere
from zmrl.lora import lora_parameters
from zmrl.trainer import compute_logprobs

log = logging.getLogger("benchmarks.op_census")

ZMRL_DIR = str(Path(__file__).resolve().parents[1] / "zmrl") + "/"
# Frames of the dispatch machinery name no call site of their own.
_MACHINERY = (ZMRL_DIR + "kernels_batch_invariant/_dispatch.py", ZMRL_DIR + "kernels_batch_invariant/triton/_autograd.py")
PHASES = ("forward", "backward")


@dataclass
class OpStats:
    count: int = 0
    elements: int = 0
    bytes: int = 0
    sites: collections.Counter = field(default_factory=collections.Counter)  # site -> bytes
    site_counts: collections.Counter = field(default_factory=collections.Counter)


def _tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        t = stack.pop()
        if isinstance(t, torch.Tensor):
            out.append(t)
        elif isinstance(t, (list, tuple)):
            stack.extend(t)
        elif isinstance(t, dict):
            stack.extend(t.values())
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _site() -> str | None:
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(ZMRL_DIR) and fn not in _MACHINERY:
            return f"{fn[len(ZMRL_DIR) - 5:]}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return None


_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _in_interpreter() -> bool:
    """Whether Triton's interpreter (running a kernel on CPU tensors) issued the op being dispatched."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.endswith(_INTERPRETER_FILE):
            return True
        f = f.f_back
    return False


_INTERPRETER_FILE = "triton/runtime/interpreter.py"


class OpCensus(TorchDispatchMode):
    """Counts every aten op by (phase, op, dtype, scope) with its call sites."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.op_stack: list[str] = []  # invariant ops being called (forward)
        self.node_op: dict[Any, str] = {}  # autograd node -> invariant op whose forward created it
        self.stats: dict[tuple[str, str, str, str], OpStats] = collections.defaultdict(OpStats)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if _INTERPRETING and _in_interpreter():
            return out  # the interpreter's own copies of a kernel's arguments: on a GPU, the kernel
        name = func.overloadpacket.__name__
        outs = _tensors(out)
        view = bool(func.is_view) or name in ("view", "_unsafe_view", "alias", "detach", "as_strided", "t",
                                              "transpose", "permute", "expand", "slice", "select", "unsqueeze",
                                              "squeeze", "split", "split_with_sizes", "unbind", "chunk")
        # Factory ops allocate (empty*) or fill (zeros/full: counted, they write) without reading.
        view = view or name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
        elems = 0 if view else sum(o.numel() for o in outs)
        moved = 0 if view else sum(_nbytes(t) for t in _tensors((args, kwargs))) + sum(_nbytes(o) for o in outs)
        site = _site()
        scope = self.op_stack[-1] if self.op_stack else ""
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            scope = self.node_op.get(node, "") if node is not None else ""
            if site is None:
                site = f"autograd:{node.name() if node is not None else '?'}"
            elif scope:
                scope += " (hand-written bwd)"  # Python backward code: glue around its GEMMs
        dtype = str(outs[0].dtype).replace("torch.", "") if outs else "-"
        s = self.stats[(self.phase, name, dtype, scope)]
        s.count += 1
        s.elements += elems
        s.bytes += moved
        s.sites[site or "?"] += moved
        s.site_counts[site or "?"] += 1
        return out

    # ---------------------------------------------------------------- invariant-op scope
    def wrap_invariant_ops(self) -> None:
        census = self
        original = _dispatch.InvariantOp.__call__

        def call(op: _dispatch.InvariantOp, *args: Any, **kwargs: Any) -> Any:
            census.op_stack.append(op.name)
            try:
                out = original(op, *args, **kwargs)
            finally:
                census.op_stack.pop()
            if census.phase == "forward" and torch.is_grad_enabled() and len(census.op_stack) == 0:
                census._tag_nodes(op.name, _tensors((args, kwargs)), _tensors(out))
            return out

        self._original_call = original
        _dispatch.InvariantOp.__call__ = call  # type: ignore[method-assign]

    def unwrap_invariant_ops(self) -> None:
        _dispatch.InvariantOp.__call__ = self._original_call  # type: ignore[method-assign]

    def _tag_nodes(self, op: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """Mark the autograd nodes the op's forward created (outputs' graph back to the inputs' nodes)."""
        stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
        todo = [o.grad_fn for o in outputs if o.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in stop or node in self.node_op or node.name() == "torch::autograd::AccumulateGrad":
                continue
            self.node_op[node] = op
            todo.extend(nxt for nxt, _ in node.next_functions)


@contextlib.contextmanager
def _host_syncs(census: OpCensus, dev: torch.device):
    """On CUDA: every operation that makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode``:
    ``.item()``, ``.tolist()``, blocking copies, ``unique``, ...), counted per phase and zmrl call site.
    Each one drains the launch queue: the GPU then idles while the host catches up."""
    counts: dict[str, collections.Counter] = {p: collections.Counter() for p in PHASES}
    if dev.type != "cuda":
        yield counts
        return
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
            if "synchronizing" in str(message):
                counts[census.phase][_site() or f"{filename}:{lineno}"] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)


def summarize(census: OpCensus, top: int) -> dict[str, Any]:
    """Per phase: totals, rows by (op, dtype, scope), and the call sites by bytes."""
    out: dict[str, Any] = {}
    for phase in PHASES:
        rows = []
        sites: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0])
        tot = {"ops": 0, "bytes": 0, "glue_ops": 0, "glue_bytes": 0}
        for (ph, name, dtype, scope), s in census.stats.items():
            if ph != phase:
                continue
            rows.append({"op": name, "dtype": dtype, "scope": scope or "glue", "count": s.count,
                         "elements": s.elements, "bytes": s.bytes, "mib": s.bytes / 2**20,
                         "top_sites": [{"site": k, "mib": v / 2**20, "count": s.site_counts[k]}
                                       for k, v in s.sites.most_common(5)]})
            tot["ops"] += s.count
            tot["bytes"] += s.bytes
            if not scope or scope.endswith("bwd)"):
                tot["glue_ops"] += s.count
                tot["glue_bytes"] += s.bytes
            for k, v in s.sites.items():
                key = f"{k}  [{scope}]" if scope else k
                sites[key][0] += s.site_counts[k]
                sites[key][1] += v
        rows.sort(key=lambda r: (-r["bytes"], -r["count"]))
        site_rows = sorted(({"site": k, "count": int(c), "mib": b / 2**20} for k, (c, b) in sites.items()),
                           key=lambda r: (-r["mib"], -r["count"]))
        out[phase] = {"totals": tot, "ops": rows, "sites": site_rows[:max(top, 50)]}
    return out


def print_summary(summary: dict[str, Any], top: int) -> None:
    for phase in PHASES:
        s = summary[phase]
        t = s["totals"]
        print(f"\n== {phase}: {t['ops']} ops, {t['bytes'] / 2**20:.1f} MiB moved; glue (outside invariant-op "
              f"backends, or in hand-written backwards): {t['glue_ops']} ops, {t['glue_bytes'] / 2**20:.1f} MiB")
        rows = [dict(r, site=r["top_sites"][0]["site"] if r["top_sites"] else "") for r in s["ops"][:top]]
        print(table(rows, [("op", "op", "s"), ("dtype", "dtype", "s"), ("scope", "scope", "s"),
                           ("count", "calls", "d"), ("mib", "MiB", ".1f"), ("site", "top site", "s")]))
        print(f"\n-- {phase}: top call sites by bytes")
        print(table(s["sites"][:top], [("site", "site", "s"), ("count", "calls", "d"), ("mib", "MiB", ".1f")]))
        if s.get("host_syncs"):
            print(f"\n-- {phase}: host syncs (the host waits for the GPU), {sum(r['count'] for r in s['host_syncs'])} in all")
            print(table(s["host_syncs"][:top], [("site", "site", "s"), ("count", "syncs", "d")]))


def run_census(a: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(a.device)
    cfg, model = build_bench_model(a.layers, a.smoke, dev, a.lora_r, a.seed)
    params = lora_parameters(model)
    g = torch.Generator().manual_seed(a.seed)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in a.seq_lens]
    plens = [max(1, n // 2) for n in a.seq_lens]

    def step(census: OpCensus | None) -> None:
        with torch.enable_grad():
            lps = compute_logprobs(model, seqs, plens, 1.0, micro_batch_tokens=None)
            loss = sum(lp.sum() for lp in lps)
            if census is not None:
                census.phase = "backward"
            loss.backward()

    if a.warmup:  # compiles/caches (Triton, weight tables) outside the census
        step(None)
        for p in params:
            p.grad = None
    census = OpCensus()
    census.wrap_invariant_ops()
    try:
        with census, _host_syncs(census, dev) as syncs:
            step(census)
    finally:
        census.unwrap_invariant_ops()
    summary = summarize(census, a.top)
    for phase in PHASES:
        summary[phase]["host_syncs"] = [{"site": k, "count": v} for k, v in syncs[phase].most_common()]
    print(f"\nTrainer op census: {'tiny' if a.smoke else 'bench'} preset, {cfg.num_hidden_layers} layers, bf16, "
          f"LoRA r={a.lora_r}, packed {'+'.join(map(str, a.seq_lens))} tokens, device {dev.type}")
    print_summary(summary, a.top)
    return {"config": {"layers": cfg.num_hidden_layers, "seq_lens": a.seq_lens, "lora_r": a.lora_r,
                       "device": dev.type, "smoke": a.smoke}, **summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",") if x], default=None)
    p.add_argument("--lora-r", type=int, default=32)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before the census (default: 1 on cuda)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--backward-precision", default=None, choices=BACKWARD_MATMUL_PRECISIONS,
                   help="the contract's backward_matmul_precision for the run (default: the process's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--triton", action="store_true",
                   help="on CPU: every op on its Triton backend under TRITON_INTERPRET=1 (the GPU's glue; kernels whose "
                        "backward is GPU-only still take their CPU fallbacks)")
    a = p.parse_args(argv)
    if a.triton:
        require_interpreter("trainer_op_census.py --triton")
    if a.smoke:
        a.device = "cpu"
        a.seq_lens = a.seq_lens or [24, 24]
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    a.seq_lens = a.seq_lens or [256, 256]
    if a.layers < 1 or not a.seq_lens or min(a.seq_lens) < 2:
        raise SystemExit(f"--layers must be >= 1 and every --seq-lens entry >= 2, got {a.layers}, {a.seq_lens}")
    a.warmup = (1 if a.device == "cuda" else 0) if a.warmup is None else a.warmup
    if a.device == "cpu":
        torch.set_num_threads(1)
    setup_logging()
    precision = a.backward_precision or current_numerics().backward_matmul_precision
    with numerics_scope(current_numerics().replace(backward_matmul_precision=precision)), \
            (triton_everywhere() if a.triton else contextlib.nullcontext()):
        result = run_census(a)
    result["config"]["backward_matmul_precision"] = precision
    out = a.out or default_out("trainer_op_census")
    write_json(out, {"env": env(), **result})
    return result


if __name__ == "__main__":
    main()
