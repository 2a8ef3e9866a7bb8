"""Registers, spills and reduction layouts of the KDA (and sparse MLA) Triton kernels, built for sm_90 on a machine
without a GPU.

Why: a kernel's bits depend on the layouts Triton gives its reductions (``tl.sum``, ``tl.cumsum``: the
combine tree follows the layout), and its speed at decode sizes on how many programs fit an SM (registers
per thread x threads). Both are decided by the compiler, not the source, and both can be read from a CPU
build: the TTGIR names the layout of every ``tt.scan`` / ``tt.reduce``, the cubin's resource usage the
registers and the spill stack. Before spending device time on a kernel change, compare this report with the
one of the tree before it: the same reduction layouts (and the same MMA instruction shapes) mean the same
bits; fewer registers mean more resident programs.

Build with the Triton the GPU runs (the layouts differ between Triton versions): put its wheel's package
directory first on ``PYTHONPATH``, e.g. ``pip install --no-deps --target /tmp/t36 triton==3.6.0`` and
``PYTHONPATH=/tmp/t36 python benchmarks/kernel_resources.py``.

    python benchmarks/kernel_resources.py [--dk 128] [--dv 128] [--kernels intra,intra_decode,...] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_ARCH = 90


@dataclass
class Reduction:
    op: str  # "scan" or "reduce"
    axis: int
    shape: str  # e.g. "64x128xf32"
    layout: str  # the layout attribute with every alias spelled out, e.g. "#ttg.blocked<{sizePerThread = ...}>"


@dataclass
class KernelReport:
    name: str
    num_warps: int
    maxnreg: int | None
    registers: int
    stack_bytes: int  # the per-thread stack frame: register spills and local arrays
    shared_bytes: int  # static shared memory (cuobjdump)
    dynamic_shared_bytes: int  # the launch's shared memory: pipeline buffers, layout conversions (Triton's metadata)
    mma: str  # the matrix-multiply instructions of the build: "wgmma" (Hopper's warpgroup MMA), "mma.sync", or "none"
    reductions: list[Reduction]


def _balanced(text: str, start: int) -> int:
    """Index just past the ``<...>`` group that opens at ``text[start] == "<"`` (nested groups included)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "<":
            depth += 1
        elif text[i] == ">":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced '<' at {start}: {text[start:start + 80]!r}")


def _resolve(layout: str, aliases: dict[str, str]) -> str:
    """Replace every alias (#blocked1, #mma, ...) inside a layout by its definition, recursively: alias
    names are numbered per module, so two builds compare only with the names spelled out."""
    return re.sub(r"#[A-Za-z_][\w.]*(?![\w.<])", lambda m: _resolve(aliases[m.group(0)], aliases)
                  if m.group(0) in aliases else m.group(0), layout)


def reductions(ttgir: str) -> list[Reduction]:
    """Every tt.scan / tt.reduce of a TTGIR module, in order, with its axis and its input's shape and layout."""
    aliases = {m.group(1): m.group(2) for m in re.finditer(r"^(#[\w.]+) = (#ttg\.[^\n]+)$", ttgir, re.M)}
    ops = list(re.finditer(r'"tt\.(scan|reduce)"\(', ttgir))
    found = []
    for i, op in enumerate(ops):
        # the op's text runs to the next scan / reduction: its attributes, its region, then its signature
        # "}) : (tensor<SHAPE, LAYOUT>"
        end = ops[i + 1].start() if i + 1 < len(ops) else len(ttgir)
        text = ttgir[op.start():end]
        axis = re.search(r"^\"tt\.\w+\"\([^)]*\) <\{axis = (\d+) : i32", text)
        sig = re.search(r"\}\) : \(tensor<", text)
        if axis is None or sig is None:
            raise ValueError(f"cannot read the tt.{op.group(1)} at offset {op.start()}: {text[:120]!r}")
        start = sig.end() - 1  # the "<" of tensor<
        body = text[start + 1:_balanced(text, start) - 1]
        if ", " not in body:
            raise ValueError(f"the tt.{op.group(1)} at offset {op.start()} has no layout: tensor<{body}>")
        shape, layout = body.split(", ", 1)
        found.append(Reduction(op.group(1), int(axis.group(1)), shape, _resolve(layout, aliases)))
    return found


TOOLS = ("ptxas", "cuobjdump")  # what a build and its report need from Triton's NVIDIA backend


def _tool_path(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def missing_tools() -> list[str]:
    """The tools of TOOLS this Triton lacks (a CPU-only wheel without the NVIDIA backend lacks both)."""
    return [name for name in TOOLS if not _tool_path(name).exists()]


def _tool(name: str) -> Path:
    path = _tool_path(name)
    if not path.exists():
        raise SystemExit(f"kernel_resources.py: this Triton has no {name} ({path}); it needs Triton's NVIDIA backend")
    return path


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        done = subprocess.run([str(_tool("cuobjdump")), "-res-usage", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", done.stdout))
    if done.returncode != 0 or not {"REG", "STACK", "SHARED"} <= set(fields):
        raise RuntimeError(f"cuobjdump -res-usage gave no REG/STACK/SHARED: {done.stderr[-500:] or done.stdout[-500:]}")
    return int(fields["REG"]), int(fields["STACK"]), int(fields["SHARED"])


def build(name: str, fn, pointer_types: dict[str, str], scalar_types: dict[str, str], constexprs: dict[str, object],
          num_warps: int, maxnreg: int | None = None, num_stages: int = 1) -> KernelReport:
    """Compile ``fn`` for sm_90 (no device needed) and report its resources and reductions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**pointer_types, **scalar_types, **{k: "constexpr" for k in constexprs}}
    missing = [a for a in fn.arg_names if a not in signature]
    if missing:
        raise ValueError(f"{name}: no type for {missing}")
    # The JIT marks every 16-byte aligned pointer argument (torch's allocations are) as such; without the mark
    # Triton cannot vectorise a load and the build differs from the one the GPU runs (scalar loads, more
    # registers, spills that the real kernel does not have).
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if signature[a].startswith("*")}
    src = ASTSource(fn=fn, signature={a: signature[a] for a in fn.arg_names}, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", TARGET_ARCH, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       **({} if maxnreg is None else {"maxnreg": maxnreg})})
    regs, stack, shared = _resource_usage(compiled.asm["cubin"])
    return KernelReport(name, num_warps, maxnreg, regs, stack, shared, int(compiled.metadata.shared),
                        mma_kind(compiled.asm["ptx"]),
                        reductions(compiled.asm["ttgir"]))


def mma_kind(ptx: str) -> str:
    """Which MMA instructions a kernel's PTX issues (the warpgroup form wins when both appear)."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma.sync" if re.search(r"\bmma\.sync\b", ptx) else "none"


def kda_reports(dk: int, dv: int, kernels: list[str], decode_maxnreg: int | None = None,
                intra_kernel=None) -> list[KernelReport]:
    """The KDA chunk / decode kernels as ``_launch_config`` launches them for (dk, dv) (the decode kernels with
    its register caps); ``decode_maxnreg`` replaces those caps, to see what a cap would cost in spills (a
    program count per SM needs 65,536 / (32 x warps x programs) registers per thread or fewer). ``intra_kernel``
    replaces ``_kda_intra_kernel`` (a variant with the same signature, e.g. from benchmarks/kda_decode_phases.py)."""
    from zmrl.kernels_batch_invariant.numerics import kda_dot_precision
    from zmrl.kernels_batch_invariant.triton import kda_chunk as K

    cfg = K._launch_config(dk, dv)
    prec = kda_dot_precision()
    intra = K._kda_intra_kernel if intra_kernel is None else intra_kernel
    f32 = "*fp32"
    intra_ptrs = {"q_ptr": f32, "k_ptr": f32, "v_ptr": "*bf16", "g_ptr": f32, "beta_ptr": f32, "info_ptr": "*i32",
                  "qg_ptr": f32, "kd_ptr": f32, "aqk_ptr": f32, "w_ptr": f32, "u_ptr": f32, "dec_ptr": f32, "tt_ptr": f32}
    intra_const = dict(DK=dk, DV=dv, DKP=cfg["DKP"], DVP=cfg["DVP"], BK=cfg["BK"], BVI=cfg["BVI"], C=K.CHUNK_SIZE,
                       BC=K._SUB, DOT_PREC=prec)
    scratch = {n: f32 for n in ("qg_ptr", "kd_ptr", "aqk_ptr", "w_ptr", "u_ptr", "dec_ptr", "ve_ptr")}
    out = []
    if "intra" in kernels:
        out.append(build("kda_intra (chunk)", intra, intra_ptrs, {"scale": "fp32", "H": "i32"},
                         {**intra_const, "DECODE": False}, cfg["intra_warps"]))
    if "intra_decode" in kernels:
        out.append(build("kda_intra (decode)", intra, intra_ptrs, {"scale": "fp32", "H": "i32"},
                         {**intra_const, "DECODE": True}, cfg["intra_warps"],
                         cfg["decode_intra_maxnreg"] if decode_maxnreg is None else decode_maxnreg))
    if "inter" in kernels:
        ptrs = {**scratch, "h0_ptr": f32, "o_ptr": "*bf16", "ht_ptr": f32, "cs_ptr": f32, "cinfo_ptr": "*i32",
                "sinfo_ptr": "*i32"}
        out.append(build("kda_inter (chunk)", K._kda_inter_kernel, ptrs, {"H": "i32"},
                         dict(DK=dk, DV=dv, BK=cfg["BK_STATE"], TWO=cfg["TWO"], BV=cfg["BV"], C=K.CHUNK_SIZE,
                              HAS_H0=True, STORE_CS=False, DOT_PREC=prec), cfg["inter_warps"]))
    if "inter_decode" in kernels:
        ptrs = {**scratch, "st_ptr": f32, "o_ptr": "*bf16", "cinfo_ptr": "*i32"}
        out.append(build("kda_inter (decode)", K._kda_decode_inter_kernel, ptrs, {"H": "i32"},
                         dict(DK=dk, DV=dv, BK=cfg["BK_STATE"], TWO=cfg["TWO"], BV=cfg["decode_BV"], C=K.CHUNK_SIZE,
                              BC=K._SUB, DOT_PREC=prec), cfg["decode_inter_warps"],
                         cfg["decode_inter_maxnreg"] if decode_maxnreg is None else decode_maxnreg))
    return out


def mla_report(num_heads: int = 64, dc: int = 512, dr: int = 64, block_h: int | None = None,
               num_warps: int | None = None, mma_rows: str = "heads", slot_list: bool = False,
               lo: bool = True, num_stages: int | None = None) -> KernelReport:
    """The sparse MLA split kernel (bf16 latent cache, split keys) at ``kernel_config``'s launch for the head
    count and latent dims (bench preset by default), or with ``block_h`` / ``num_warps`` / ``num_stages`` replaced; ``mma_rows``
    picks its form (Numerics.mla_mma_rows); ``slot_list``: the key lists hold cache slots (``SLOT_LIST``); ``lo``:
    the lo halves of q and p are multiplied too (Numerics.mla_operands "hi_lo"; False: "bf16")."""
    from zmrl.kernels_batch_invariant.mla_attention import KEY_BLOCK
    from zmrl.kernels_batch_invariant.triton import mla_attention as M

    cfg = M.kernel_config(num_heads, dc, dr, mma_rows)
    bh = cfg.block_h if block_h is None else block_h
    ptrs = {"q_ptr": "*fp32", "qh_ptr": "*bf16", "ql_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i64",
            "seq_ptr": "*i64", "kp_ptr": "*i32" if slot_list else "*i64", "qpos_ptr": "*i64", "out_ptr": "*fp32", "m_ptr": "*fp32",
            "l_ptr": "*fp32", "acc_ptr": "*fp32", "cnt_ptr": "*i32"}
    scalars = {"scale": "fp32", "H": "i32", "page_size": "i32", "bt_stride": "i32", "kp_stride": "i32", "L": "i32",
               "num_splits": "i32"}
    consts = dict(DC=dc, DR=dr, KC=cfg.chunk, NCH=cfg.n_chunks, DR_P=max(16, 1 << (dr - 1).bit_length()),
                  BLOCK_H=bh, BLOCK_N=KEY_BLOCK, SPLIT=M.SPLIT_KEYS, DENSE=False, DIRECT=False, SPLIT_BF16=True,
                  N_HG=-(-num_heads // bh), FUSED_COMBINE=M.FUSED_COMBINE, SLOT_LIST=slot_list, LO=lo)
    kernel = M.split_kernel_for(mma_rows)
    name = f"mla_split (H={num_heads}, BLOCK_H={bh}, {mma_rows} on the MMA rows{', slot list' if slot_list else ''}{'' if lo else ', bf16 operands'})"
    return build(name, kernel, ptrs, scalars, consts,
                 cfg.num_warps if num_warps is None else num_warps,
                 num_stages=cfg.num_stages if num_stages is None else num_stages)


def recurrent_report(dk: int = 128, dv: int = 128, v_dtype: str = "bf16") -> KernelReport:
    """The recurrent-form KDA kernel (``triton/kda_recurrent.py``) at its launch for (dk, dv), with the pointer
    dtypes every caller passes (fp32 q, k, g, beta and states; v and o in the model dtype): the one binary
    that prefill, decode and the trainer share."""
    from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE
    from zmrl.kernels_batch_invariant.triton import kda_recurrent as R

    cfg = R.launch_config(dk, dv)
    f32, vt = "*fp32", f"*{v_dtype}"
    ptrs = {"q_ptr": f32, "k_ptr": f32, "v_ptr": vt, "g_ptr": f32, "beta_ptr": f32, "o_ptr": vt, "h0_ptr": f32,
            "run_ptr": f32, "fin_ptr": f32, "cs_ptr": f32, "info_ptr": "*i32"}
    return build("kda_recurrent", R._kda_recurrent_kernel, ptrs, {"scale": "fp32", "H": "i32"},
                 dict(DK=dk, DV=dv, DKP=cfg["DKP"], BV=cfg["BV"], C=CHUNK_SIZE), cfg["num_warps"])


KERNELS = ("intra", "intra_decode", "inter", "inter_decode", "mla", "mla_keys", "mla_slots", "mla_bf16", "recurrent")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, from {', '.join(KERNELS)}")
    ap.add_argument("--decode-maxnreg", type=int, default=None,
                    help="register cap per thread of the two decode kernels (default: _launch_config's)")
    ap.add_argument("--mla-block-h", type=int, default=None, help="heads per program of the MLA kernel (default: its config's)")
    ap.add_argument("--mla-warps", type=int, default=None, help="warps of the MLA kernel (default: its config's)")
    ap.add_argument("--mla-stages", type=int, default=None, help="pipeline stages of the MLA kernel (default: its config's)")
    ap.add_argument("--out", default=None, help="JSON report (default: print only)")
    a = ap.parse_args()
    kernels = [k for k in a.kernels.split(",") if k]
    bad = [k for k in kernels if k not in KERNELS]
    if bad:
        raise SystemExit(f"--kernels: unknown {bad} (allowed: {', '.join(KERNELS)})")
    try:
        import triton
    except ImportError:
        raise SystemExit("kernel_resources.py needs triton (the GPU's version: see the module docstring)") from None
    not_chunk_kda = ("mla", "mla_keys", "mla_slots", "mla_bf16", "recurrent")
    reports = kda_reports(a.dk, a.dv, [k for k in kernels if k not in not_chunk_kda], a.decode_maxnreg)
    if "recurrent" in kernels:
        reports.append(recurrent_report(a.dk, a.dv))
    if "mla" in kernels:
        reports.append(mla_report(block_h=a.mla_block_h, num_warps=a.mla_warps, num_stages=a.mla_stages))
    if "mla_keys" in kernels:
        reports.append(mla_report(block_h=a.mla_block_h, num_warps=a.mla_warps, num_stages=a.mla_stages, mma_rows="keys"))
    if "mla_slots" in kernels:
        reports.append(mla_report(block_h=a.mla_block_h, num_warps=a.mla_warps, num_stages=a.mla_stages, slot_list=True))
    if "mla_bf16" in kernels:
        reports.append(mla_report(block_h=a.mla_block_h, num_warps=a.mla_warps, num_stages=a.mla_stages, slot_list=True, lo=False))
    print(f"triton {triton.__version__}, sm_{TARGET_ARCH}, dk={a.dk}, dv={a.dv}")
    for r in reports:
        cap = "" if r.maxnreg is None else f" (cap {r.maxnreg})"
        print(f"{r.name}: {r.num_warps} warps, {r.registers} registers/thread{cap}, {r.stack_bytes} B stack "
              f"(spills), {r.shared_bytes} B static / {r.dynamic_shared_bytes} B launch shared, MMA {r.mma}")
        for red in r.reductions:
            print(f"    {red.op:6s} axis {red.axis} {red.shape:12s} {red.layout}")
    if a.out:
        import json

        Path(a.out).write_text(json.dumps({"triton": triton.__version__, "arch": TARGET_ARCH, "dk": a.dk, "dv": a.dv,
                                           "kernels": [asdict(r) for r in reports]}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
