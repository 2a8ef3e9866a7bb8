"""Shared pieces of the GPU benchmarks: environment record, result files, the bench model built
directly on the GPU, CUDA-event timing and plain-text tables.

Every benchmark writes one JSON file (``--out``; default
``benchmarks/results/<date>_<name>_h200.json``) holding ``env()`` (date, git commit, GPU, torch /
triton / CUDA versions) plus its own results, and prints a table.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/x.py` from anywhere without installing
    sys.path.insert(0, str(REPO))

from zmrl.kernels_batch_invariant import fingerprint  # noqa: E402
from zmrl.model import HybridForCausalLM, ModelConfig  # noqa: E402
from zmrl.model.model import FP32_PARAMS  # noqa: E402

log = logging.getLogger("benchmarks")


def parse_mla_launches(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"32x8x2,16x4x2"`` -> ((32, 8, 2), (16, 4, 2)): sparse-MLA launches as heads x warps x stages."""
    found = [re.fullmatch(r"(\d+)x(\d+)x(\d+)", item) for item in text.split(",") if item]
    if not found or not all(found):
        raise SystemExit(f"MLA launch: {text!r} is not a list of HxWxS (e.g. 32x8x2,16x4x2)")
    return tuple((int(m[1]), int(m[2]), int(m[3])) for m in found)


def require_interpreter(what: str) -> None:
    """Exit with one line unless Triton's interpreter is on (``what`` runs Triton kernels on CPU tensors)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(f"{what}: set TRITON_INTERPRET=1 (the Triton kernels run interpreted on the CPU)")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def require_cuda(script: str) -> torch.device:
    """Exit with a clear message (status 2) when there is no GPU: these numbers mean nothing on CPU."""
    if not torch.cuda.is_available():
        sys.stderr.write(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False; torch {torch.__version__}). "
                         "Run it on the GPU machine, e.g. via benchmarks/run_gpu.sh.\n")
        raise SystemExit(2)
    return torch.device("cuda")


def pick_device(script: str, smoke: bool) -> torch.device:
    """``--smoke``: the CPU (with the tiny preset and tiny shapes: checks the script end to end, the
    numbers mean nothing); otherwise CUDA or a clear exit."""
    if smoke:
        torch.set_num_threads(1)
        return torch.device("cpu")
    return require_cuda(script)


def model_config(layers: int | None, smoke: bool) -> ModelConfig:
    return ModelConfig.preset("tiny") if smoke else bench_config(layers)


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                           timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO, timeout=10).stdout.strip()
        return (r.stdout.strip() + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("ZMRL_COMMIT")


def env() -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(), "source_sha": source_sha(), "torch": torch.__version__, "triton": triton_version,
        "cuda": torch.version.cuda, "argv": sys.argv,
        # the applied numerics contract (kernel mode, KDA form and dot precision, ...): what the bits and speed follow
        "numerics": {k: v for k, v in fingerprint().fields.items() if k not in ("torch", "triton")},
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   sm_count=p.multi_processor_count)
    return out


def source_sha() -> str:
    """sha256 (12 hex digits) of the Python sources of zmrl/ and benchmarks/ as they are on disk: names the
    code a result came from where the git commit cannot (a copied working tree whose .git is stale or absent,
    uncommitted edits). Compare with ``python -c "from benchmarks._common import source_sha; print(source_sha())"``."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted([*(REPO / "zmrl").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def device_slug() -> str:
    """'h200' for an NVIDIA H200, 'cpu' without CUDA: results files name the machine they ran on."""
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "-") or "gpu"


def default_out(name: str) -> Path:
    return REPO / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}_{name}_{device_slug()}.json"


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    log.info("wrote %s", path)
    return path


# ----------------------------------------------------------------------------- the bench model


def bench_config(num_layers: int | None = None) -> ModelConfig:
    """``ModelConfig.preset("bench")``, optionally with fewer layers: every 4th (1-based) layer is
    MLA+DSA and the rest KDA, the preset's own pattern (fewer than 4 layers: the last is MLA+DSA)."""
    cfg = ModelConfig.preset("bench")
    if num_layers is None or num_layers == cfg.num_hidden_layers:
        return cfg
    if num_layers < 1:
        raise ValueError(f"--layers must be >= 1, got {num_layers}")
    full = [i for i in range(1, num_layers + 1) if i % 4 == 0] or [num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    la = dataclasses.replace(cfg.linear_attn_config, kda_layers=kda, full_attn_layers=full)
    return dataclasses.replace(cfg, num_hidden_layers=num_layers, linear_attn_config=la).validate()


@torch.no_grad()
def build_on_device(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> HybridForCausalLM:
    """The model allocated and initialised on the GPU (``build_model`` draws every weight on the CPU
    in fp32, which takes a while for 2.6 B parameters). Same distributions as ``reset_parameters``
    (values differ: they come from a CUDA generator), so activations and routing look alike."""
    with torch.device(device):
        model = HybridForCausalLM(cfg, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = cfg.initializer_range
    out_std = std / (2 * cfg.num_hidden_layers) ** 0.5
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias") or name.endswith("_res_proj.weight"):
            p.zero_()
        elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            p.normal_(0.0, out_std, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)
    cpu_gen = torch.Generator().manual_seed(seed)
    from zmrl.model.kda import KimiDeltaAttention
    from zmrl.model.moe import MoE

    for layer in model.model.layers:
        if isinstance(layer.self_attn, KimiDeltaAttention):
            layer.self_attn.reset_parameters(cpu_gen)  # conv, decay and dt (small, drawn on CPU)
        if isinstance(layer.mlp, MoE):
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=cpu_gen) * 0.01)
    for name, p in model.named_parameters():
        want = torch.float32 if name.endswith(FP32_PARAMS) else dtype
        assert p.dtype == want, f"{name}: {p.dtype} != {want}"
    return model.eval()


def apply_bench_lora(model: torch.nn.Module, r: int, seed: int) -> torch.nn.Module:
    """The benchmarks' adapter: rank ``r`` on every attention projection and expert, alpha = r (scale 1), B drawn
    N(0, 0.02) so the deltas are not zero (a fresh adapter's B is), from ``seed``; the base is frozen."""
    from zmrl.lora import LoraConfig, apply_lora

    return apply_lora(model, LoraConfig(r=r, alpha=float(r), init_b_std=0.02, init_seed=seed))


def build_bench_model(layers: int | None, smoke: bool, device: torch.device, lora_r: int = 0,
                seed: int = 0) -> tuple[ModelConfig, HybridForCausalLM]:
    """The benchmarks' model: ``model_config(layers, smoke)`` built in bf16 on ``device`` (``build_on_device``), with
    ``apply_bench_lora`` at rank ``lora_r`` (0: none)."""
    cfg = model_config(layers, smoke)
    model = build_on_device(cfg, torch.bfloat16, device, seed=seed)
    if lora_r:
        apply_bench_lora(model, lora_r, seed)
    return cfg, model


def experts_hit(cfg: ModelConfig, batch: int) -> float:
    """Expected distinct routed experts of one MoE layer that ``batch`` tokens pick (top-k each, uniform):
    k at batch 1, ``E * (1 - (1 - k/E)^B)`` beyond."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return k if batch == 1 or not e else e * (1.0 - (1.0 - k / e) ** batch)


def weight_bytes_per_decode_token(cfg: ModelConfig, dtype_bytes: int = 2, batch: int = 1) -> int:
    """Bytes of weights one decode step of ``batch`` tokens must read: every weight except the routed
    experts no token picks and the embedding rows no token looks up. At batch 1 each MoE layer reads its
    top-k experts; at batch B the expected number of distinct experts hit by B independent uniform
    top-k choices, ``E * (1 - (1 - k/E)^B)`` (all of them at the batches RL decodes at)."""
    from zmrl.capacity.sizing import _EXPERT_RE, weight_shapes

    hit = experts_hit(cfg, batch)
    total = 0.0
    for name, shape in weight_shapes(cfg).items():
        n = math.prod(shape)
        m = _EXPERT_RE.search(name)
        if m is not None:
            if int(m.group(1)) != 0:
                continue
            n *= hit  # expert 0 stands for every expert of its layer (equal shapes)
        if name == "model.embed_tokens.weight":
            n = shape[1] * min(batch, shape[0])
        total += n * (4 if name.endswith(FP32_PARAMS) else dtype_bytes)
    return int(total)


def decode_weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Weights one decode step of ``batch`` tokens reads: ``weight_bytes_per_decode_token`` plus the
    model's LoRA adapters (fp32: every dense adapter, the routed-expert adapters of the experts hit)."""
    cfg = model.config
    lora_dense = lora_experts = 0
    for name, p in model.named_parameters():
        if ".experts_lora." in name:
            lora_experts += p.numel() * p.element_size()
        elif ".adapter.lora_" in name:
            lora_dense += p.numel() * p.element_size()
    frac = experts_hit(cfg, batch) / cfg.n_routed_experts if cfg.n_routed_experts else 0.0
    return int(weight_bytes_per_decode_token(cfg, batch=batch) + lora_dense + lora_experts * frac)


def kv_state_bytes_per_seq(cfg: ModelConfig, ctx: int, pending: int = 32) -> int:
    """Cache/state bytes one sequence's decode step at context ``ctx`` reads: per MLA layer storing index
    keys the FP8 keys (+ fp32 scale) of every position, per MLA layer the bf16 latents of the selected
    top-k; per KDA layer the fp32 state, the conv tail and the ``pending`` rows of the current chunk
    (k, g fp32; v bf16; beta fp32; 32 = the average over a 64-row chunk)."""
    la = cfg.linear_attn_config
    n_kda = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i))
    n_mla = cfg.num_hidden_layers - n_kda
    sel = min(ctx, cfg.index_topk or ctx)
    index = len(cfg.index_key_layers()) * ctx * (cfg.index_head_dim + 4)
    mla = n_mla * sel * 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    h, dk = la.num_heads, la.head_dim
    kda = h * dk * dk * 4 + 3 * 3 * h * dk * 2 + pending * h * (dk * (4 + 2 + 4) + 4)
    return index + mla + n_kda * kda


# ----------------------------------------------------------------------------- timing


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 2, iters: int = 5,
                 setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median / min / mean milliseconds of ``fn`` (CUDA events around each call; ``setup`` runs
    untimed before every call, warm-up included). Without CUDA (``--smoke``): wall-clock time."""
    cuda = torch.cuda.is_available()
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "mean_ms": statistics.fmean(times),
            "iters": iters}


def copy_bandwidth_tb_s(device: torch.device, gib: float = 2.0, iters: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second), in TB/s."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=iters)["median_ms"]
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n / (t * 1e-3) / 1e12


def free_gib() -> float:
    if not torch.cuda.is_available():
        return float("inf")
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


OOM_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)


# ----------------------------------------------------------------------------- output


def table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table; ``cols`` = (key, header, format spec) triples (missing values print '-')."""
    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        v = row.get(key)
        if v is None:
            return "-"
        try:
            return format(v, fmt)
        except (TypeError, ValueError):
            return str(v)

    cells = [[cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(cols)]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def profile_step(step: Callable[[], Any], cuda: bool, steps: int = 3, top: int = 15) -> list[dict[str, Any]]:
    """Per-kernel device time of ``steps`` calls (self time, summed by kernel name); top ``top`` + total.
    Only device-side events count (kernels, copies, fills): a CPU op's ``self_device_time`` repeats the
    time of the kernels it launched, so summing both would count the GPU's work twice. Without CUDA
    (``--smoke``) the CPU self time of each op instead."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            dev_us = getattr(e, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(e, "self_cuda_time_total", 0.0)
        else:
            dev_us = e.self_cpu_time_total
        if dev_us > 0:
            rows.append({"name": e.key[:80], "calls": e.count // steps, "ms_per_step": dev_us / 1e3 / steps})
    total = sum(r["ms_per_step"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["ms_per_step"])
    for r in rows:
        r["share"] = r["ms_per_step"] / total
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        family = kernel_group(r["name"])
        g = groups.setdefault(family, {"name": f"[{family}]", "calls": 0, "ms_per_step": 0.0})
        g["calls"] += r["calls"]
        g["ms_per_step"] += r["ms_per_step"]
    by_group = sorted(groups.values(), key=lambda g: -g["ms_per_step"])
    for g in by_group:
        g["share"] = g["ms_per_step"] / total
    return rows[:top] + by_group + [{"name": "(all kernels)", "calls": sum(r["calls"] for r in rows),
                                     "ms_per_step": total, "share": 1.0}]


# (group, pattern) in order: the first pattern that matches a kernel's name names its group.
_KERNEL_GROUPS = (
    ("zmrl GEMM", r"^_gemm_kernel|^_split_k_sum|_linear_concat|_blockdiag"),
    ("zmrl MoE backward", r"^_expert_"),
    ("zmrl MLA", r"^_mla_|^_softmax_bf16|^_ds_bf16"),
    ("zmrl KDA", r"^_kda_"),
    ("fla KDA", r"chunk_|kda|gated_delta|fused_recurrent|solve_tril|wy_fast|cumsum"),
    ("zmrl DSA", r"^_index_|^_topk|^_hadamard|^_fp8"),
    ("zmrl other Triton", r"^_"),
    ("cuBLAS / CUTLASS", r"gemm|cutlass|xmma|sm90_|sm80_|cublas|splitKreduce"),
    ("sort / top-k", r"[Ss]ort|topk|radix"),
    ("copy / cast", r"copy|Memcpy|CatArray|cat_"),
    ("gather / scatter / index", r"index|gather|scatter"),
    ("reduce", r"reduce|Reduce|sum|softmax"),
    ("elementwise / fill", r"elementwise|Memset|fill"),
)


def kernel_group(name: str) -> str:
    """A coarse family for a kernel name (``profile_step``'s group rows)."""
    for group, pattern in _KERNEL_GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def print_profile(title: str, rows: list[dict[str, Any]]) -> None:
    """``profile_step``'s rows as a table under ``title``."""
    print(f"\n{title}")
    print(table(rows, [("name", "kernel", "s"), ("calls", "calls", "d"), ("ms_per_step", "ms", ".3f"), ("share", "share", ".1%")]))


def _describe(a: Any) -> str | None:
    if isinstance(a, torch.Tensor):
        dt = str(a.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "f32")
        return "x".join(map(str, a.shape)) + ":" + dt
    if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
        first = _describe(a[0])
        return f"{len(a)}*{first}" if all(t.shape == a[0].shape for t in a) else f"[{len(a)} tensors]"
    return None


_SITE_SKIP = ("/kernels_batch_invariant/", "/model/layers.py", "/lora/layers.py")  # wrappers, not callers


def _call_site() -> str:
    """The innermost frame in zmrl/ outside the kernel floor and the Linear / LoRA wrappers: which layer
    issued the op."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/zmrl/" in name and not any(s in name for s in _SITE_SKIP):
            return f"{name.split('/zmrl/')[-1]}:{f.f_lineno}"
        f = f.f_back
    return "?"


def op_profile(step: Callable[[], Any], cuda: bool, steps: int = 2) -> list[dict[str, Any]]:
    """Device time per invariant-op call, by (op, argument shapes, issuing site), over ``steps`` eager calls
    of ``step``: every ``InvariantOp`` call runs inside a ``record_function`` named after it, and each kernel
    counts for the outermost op whose GPU-side range (the profiler's GPU user annotation: first to last
    kernel of the op) holds its start; nested ops count for their caller. Only kernel time counts, not the
    gaps inside a range (an eager step leaves the GPU waiting for the host). The last row is the kernels
    outside every op (the glue: casts, adds, routing, cache writes). Without CUDA (``--smoke``) the CPU time
    of the outermost ops instead, and no glue row."""
    import bisect

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    from zmrl.kernels_batch_invariant._dispatch import InvariantOp

    original = InvariantOp.__call__

    def labelled(self: InvariantOp, *args: Any, **kwargs: Any) -> Any:
        shapes = [d for d in map(_describe, (*args, *kwargs.values())) if d]
        with record_function(f"op:{self.name} {' '.join(shapes)} @{_call_site()}"):
            return original(self, *args, **kwargs)

    InvariantOp.__call__ = labelled  # special methods are looked up on the type
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        InvariantOp.__call__ = original
    rows: dict[str, dict[str, Any]] = {}

    def row(label: str) -> dict[str, Any]:
        return rows.setdefault(label, {"op": label, "calls": 0, "ms_per_step": 0.0, "kernels": 0})

    events = prof.events()
    if not cuda:
        for e in events:
            if e.name.startswith("op:") and not _has_op_parent(e):
                r = row(e.name[3:])
                r["calls"] += 1
                r["ms_per_step"] += e.cpu_time_total / 1e3
        return _per_step(rows, steps)
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    ranges = sorted(((e.time_range.start, e.time_range.end, e.name[3:]) for e in device if e.name.startswith("op:")))
    top: list[tuple[float, float, str]] = []
    for start, end, label in ranges:
        if top and start < top[-1][1]:
            continue  # inside the previous outermost range: a nested op
        top.append((start, end, label))
        row(label)["calls"] += 1
    starts = [t[0] for t in top]
    glue = row("(kernels outside every op)")
    for e in device:
        if e.name.startswith("op:"):
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        r = row(top[i][2]) if i >= 0 and e.time_range.start < top[i][1] else glue
        r["ms_per_step"] += e.time_range.elapsed_us() / 1e3
        r["kernels"] += 1
    rows.pop(glue["op"])
    out = _per_step(rows, steps)
    glue["ms_per_step"] /= steps
    glue["kernels"] /= steps
    return out + [glue]


def _has_op_parent(e: Any) -> bool:
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith("op:"):
            return True
        parent = parent.cpu_parent
    return False


def _per_step(rows: dict[str, dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Per-step means (a label whose shapes change with the step's context, e.g. a growing key width, can
    appear in fewer than every step: fractional calls)."""
    out = sorted(rows.values(), key=lambda r: -r["ms_per_step"])
    for r in out:
        r["calls"] /= steps
        r["kernels"] /= steps
        r["ms_per_step"] /= steps
    return out


def print_op_profile(title: str, rows: list[dict[str, Any]], top: int = 40) -> None:
    total = sum(r["ms_per_step"] for r in rows) or 1.0
    print(f"\n{title} (all kernels {total:.3f} ms per step)")
    shown = rows[:top] + ([rows[-1]] if len(rows) > top else [])
    print(table([{**r, "share": r["ms_per_step"] / total} for r in shown],
                [("op", "op, arguments @ site", "s"), ("calls", "calls", ".1f"), ("kernels", "kernels", ".1f"),
                 ("ms_per_step", "ms", ".3f"), ("share", "share", ".1%")]))
