"""Programmatic dependent launch (``_common.pdl`` / ``await_previous_kernel``): every kernel launched with
``launch_pdl`` must wait for the kernel before it before it touches memory, or it races with it. Checked on the
source (every launch and every launched kernel of the Triton backend), on the sm_90 / sm_80 builds, and on the GPU
(a chain of kernels captured in a CUDA graph gives the same bits with and without it)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from zmrl.kernels_batch_invariant.triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

TRITON_DIR = Path(__file__).resolve().parents[3] / "zmrl" / "kernels_batch_invariant" / "triton"
# launches through a variable: the kernels it can hold
INDIRECT = {"split_kernel": ("_mla_split_kernel", "_mla_split_kernel_keys_rows")}


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit" and getattr(target.value, "id", None) == "triton":
            return True
    return False


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    return body[1] if has_doc else body[0]


def _launches() -> list[tuple[str, str, ast.Call, dict[str, ast.FunctionDef]]]:
    found = []
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        kernels = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name) \
                    and (node.func.value.id in kernels or node.func.value.id in INDIRECT):
                found.append((path.name, node.func.value.id, node, kernels))
    return found


def test_every_launch_waits_for_the_kernel_before_it():
    launches = _launches()
    assert len(launches) >= 40  # the scan sees the backend's launches (a broken scan would pass vacuously)
    for file, name, call, kernels in launches:
        where = f"{file}:{call.lineno} {name}"
        assert any(kw.arg is None and isinstance(kw.value, ast.Call) and getattr(kw.value.func, "id", None) == "pdl"
                   for kw in call.keywords), f"{where}: launched without **pdl()"
        for kernel in INDIRECT.get(name, (name,)):
            first = _first_statement(kernels[kernel])
            assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) \
                and getattr(first.value.func, "id", None) == "await_previous_kernel", \
                f"{where}: kernel {kernel} must begin with await_previous_kernel()"


def _build_ptx(arch: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """A launched kernel (the row-wise sigmoid) built for sm_``arch`` as if that GPU were the active target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.language import target_info

    from zmrl.kernels_batch_invariant.triton import pointwise

    target = GPUTarget("cuda", arch, 32)

    def current_target():
        return target

    current_target.__triton_builtin__ = True  # as the function it replaces: not traced by the JIT
    monkeypatch.setattr(target_info, "current_target", current_target)
    fn = pointwise._sigmoid_kernel
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    src = ASTSource(fn=fn, signature={a: sig[a] for a in fn.arg_names}, constexprs={"BLOCK": 1024})
    return triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]


def test_hopper_build_waits_before_any_memory_access(monkeypatch, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        ptx = _build_ptx(90, monkeypatch)
    except Exception as exc:  # a Triton without ptxas / the NVIDIA backend cannot build here
        pytest.skip(f"no sm_90 build on this machine: {type(exc).__name__}")
    body = ptx[ptx.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    assert wait < body.index("ld.global") and wait < body.index("st.global")
    assert wait < body.index("griddepcontrol.launch_dependents")
    # before Hopper the instructions do not exist: the kernel must build without them
    ptx80 = _build_ptx(80, monkeypatch)
    assert "griddepcontrol" not in ptx80 and re.search(r"\.target sm_80", ptx80)


def test_no_programmatic_launch_without_a_hopper_gpu():
    from zmrl.kernels_batch_invariant.triton import _common

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0) or not _common.PDL:
        assert _common.pdl() == {}
    else:
        assert _common.pdl() == {"launch_pdl": True}


@pytest.mark.gpu
def test_programmatic_launch_keeps_every_bit_in_a_graph():
    """A norm -> GEMM -> gated GLU -> norm chain, replayed from a CUDA graph, with and without programmatic launch:
    each kernel reads what the one before it wrote, so a missing wait shows up as a difference (or garbage)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    from zmrl.kernels_batch_invariant import linear
    from zmrl.kernels_batch_invariant.glu import swiglu
    from zmrl.kernels_batch_invariant.norms import rms_norm
    from zmrl.kernels_batch_invariant.triton import _common, triton_impl

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(256, 2048, device=dev, generator=g).bfloat16()
    w_norm = torch.randn(2048, device=dev, generator=g).bfloat16()
    w_up = (torch.randn(2 * 1024, 2048, device=dev, generator=g) / 45).bfloat16()
    w_down = (torch.randn(2048, 1024, device=dev, generator=g) / 32).bfloat16()
    norm, lin, glu = triton_impl(rms_norm), triton_impl(linear), triton_impl(swiglu)

    def chain() -> torch.Tensor:
        h = lin(norm(x, w_norm, 1e-6), w_up)
        return norm(lin(glu(h[:, :1024], h[:, 1024:]), w_down), w_norm, 1e-6)

    outs = {}
    saved = _common._pdl_launch
    try:
        for on in (False, True):
            _common._pdl_launch = {"launch_pdl": True} if on else {}
            chain()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = chain()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            outs[on] = y.clone()
    finally:
        _common._pdl_launch = saved
    assert torch.equal(outs[True], outs[False])
    assert torch.equal(outs[False], chain())
