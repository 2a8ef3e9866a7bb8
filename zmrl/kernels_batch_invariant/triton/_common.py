"""Shared pieces of the row-wise Triton kernels (norms, GLUs, gates, log-probs, short conv, FP8, MoE).

Elementwise nonlinearities are composed from ``tl.exp``/``tl.log`` and IEEE ``+ - * /``, so an
element's bits depend on its value alone (never on where it sits in a tile). They are written for
accuracy against float64 where a naive formula cancels (tanh and log1p near 0, softplus far below 0).

Launch configurations are derived from model widths only (``row_block``), never from the number of
rows, so every row of every call runs the same instruction sequence (docs/numerics.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.language.target_info import cuda_capability_geq

# Elementwise kernels: a fixed tile of the flattened tensor per program.
ELEMENTWISE_BLOCK = 1024
ELEMENTWISE_WARPS = 4
# Row kernels read a row in column blocks of at most this many elements (fixed order, ascending).
MAX_ROW_BLOCK = 4096


# Read once: the interpreter is chosen per process, and os.environ lookups cost microseconds per call.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"


# Programmatic dependent launch (Hopper and later): every kernel here is launched with ``launch_pdl`` (``pdl()``),
# which lets the GPU start launching it while the kernel before it in the stream is still running, and every
# kernel begins with ``await_previous_kernel()``, which waits for that kernel to finish (its writes visible)
# before it reads or writes anything. Between two short kernels, e.g. in a decode step's CUDA graph, this hides
# the launch latency; what any kernel computes is unchanged (the wait comes before its first instruction of
# work). ZMRL_PDL=0 launches without it (benchmarks compare).
PDL: bool = os.environ.get("ZMRL_PDL", "1") != "0" and not INTERPRET
_pdl_launch: dict[str, bool] | None = None


@triton.jit
def await_previous_kernel():
    """The first statement of every kernel: wait until the previous kernel in the stream has finished and its
    writes are visible, then let the next kernel launch (its programs wait here in turn). Only after this
    program's own wait, so at most one kernel is launched ahead of the running one, and only once all of this
    kernel's programs are resident, so its waiting programs never take an SM from this kernel. A no-op before
    Hopper, on a launch without ``launch_pdl``, and under the interpreter."""
    if cuda_capability_geq(9, 0):
        gdc_wait()
        gdc_launch_dependents()


def pdl() -> dict[str, bool]:
    """Launch options of every kernel here: ``launch_pdl`` on Hopper and later (see ``PDL``). Read once per
    process (every GPU of a machine is the same kind)."""
    global _pdl_launch
    if _pdl_launch is None:
        _pdl_launch = ({"launch_pdl": True} if PDL and torch.cuda.is_available()
                       and torch.cuda.get_device_capability() >= (9, 0) else {})
    return _pdl_launch


# Arrival counters of the kernels whose last program to finish does a final step in the same launch (the GEMM's
# split-K sum, the MLA splits' combine): one int32 per group of programs, zero between launches (a group's last
# program resets its own). One buffer per device, handed out in rotating regions so that launches on different
# streams do not share counters; allocated outside CUDA-graph capture (a launch captured before the first eager
# one takes its two-launch form instead).
_COUNTER_CAPACITY = 1 << 20
_COUNTERS: dict[torch.device, list] = {}


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream of ``device`` is being captured into a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """n zeroed arrival counters for one launch, or None (the caller then takes its two-launch form)."""
    if n > _COUNTER_CAPACITY:
        return None
    entry = _COUNTERS.get(device)
    if entry is None:
        if capturing(device):
            return None
        entry = _COUNTERS[device] = [torch.zeros(_COUNTER_CAPACITY, dtype=torch.int32, device=device), 0]
    buf, cur = entry
    if cur + n > _COUNTER_CAPACITY:
        cur = 0
    entry[1] = cur + cdiv(n, 256) * 256
    return buf[cur: cur + n]


@triton.jit
def last_to_arrive(cnt_ptr, group, n):
    """Count this program into its group's arrival counter; True for the group's n-th (last) program. The barrier
    and the release half of the atomic publish this program's writes before it counts itself; the acquire half
    makes every other program's writes visible to the last one (which should read them with ``.cg`` loads, never
    a stale L1 line). The last program resets the counter (``reset_arrivals``) when it is done."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu") == n - 1


@triton.jit
def reset_arrivals(cnt_ptr, group):
    """Zero a group's arrival counter for the next launch (by the group's last program, see ``last_to_arrive``)."""
    tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")


def cdiv(a: int, b: int) -> int:
    """Ceiling division in plain Python (``triton.cdiv`` costs ~5 us per host call in Triton 3.9)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1), in plain Python, for host-side launch configs."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def interpreting() -> bool:
    """True under Triton's CPU interpreter."""
    return INTERPRET


def row_block(width: int, cap: int = MAX_ROW_BLOCK) -> int:
    """Column block of a row kernel: the row width rounded up to a power of two, capped. A function
    of the (model) width only."""
    return min(next_pow2(width), cap)


def row_warps(block: int) -> int:
    """Warps for a row kernel with column block ``block`` (a function of the model width only)."""
    return 8 if block >= 2048 else 4


def compute_in_fp64(*tensors: torch.Tensor | None) -> bool:
    """fp64 inputs only come from gradchecks; the Triton wrappers then run the torch backend,
    which computes in fp64 (the kernels here are fp32)."""
    return any(t is not None and t.dtype == torch.float64 for t in tensors)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> contiguous [R, D] (a view when already contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


@dataclass(frozen=True)
class RowView:
    """The rows of x [..., D] where they lie, for a row kernel: row r starts
    ``(r // group) * group_stride + (r % group) * row_stride`` elements after ``base``'s first element, and its
    D columns are adjacent. Covers a column slice of a 2-D tensor (group 1) and a per-head view
    [T, H, D] of one (group H), e.g. q and k inside a fused projection's output, with no copy."""

    base: torch.Tensor
    rows: int
    group: int
    group_stride: int
    row_stride: int


def row_view(x: torch.Tensor) -> RowView:
    """x [..., D] as a ``RowView``: in place when its last dim is unit-stride and its leading dims form at
    most two strided levels, else a contiguous copy (``as_rows``)."""
    d = x.shape[-1]
    if x.dim() >= 2 and (x.stride(-1) == 1 or d == 1):
        lead = x.shape[:-1]
        if x.dim() == 2:
            return RowView(x, lead[0], 1, x.stride(0), x.stride(0))
        if x.dim() == 3:
            return RowView(x, lead[0] * lead[1], lead[1], x.stride(0), x.stride(1))
    x2 = as_rows(x)
    return RowView(x2, x2.shape[0], 1, d, d)


@triton.jit
def row_offset(row, group, group_stride, row_stride):
    """Element offset of row ``row`` of a ``RowView`` (int64)."""
    return (row // group) * group_stride + (row % group) * row_stride


@triton.jit
def sigmoid(x):
    # 1 / (1 + exp(-x)): exp overflows to inf for x << 0 and the quotient is then exactly 0.
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def log1p_unit(u):
    """log(1 + u) for 0 <= u <= 1 without a log: 2 atanh(s) with s = u / (2 + u) in [0, 1/3], summed as
    the odd series 2 (s + s^3/3 + ... + s^17/17) (truncation < 3e-10 relative). Accurate to a few ulp
    near u = 0, where log(1 + u) would lose the low bits of u (and would depend on how precise the
    GPU's log is near 1)."""
    s = u / (2.0 + u)
    s2 = s * s
    p = 1.0 / 17.0
    p = p * s2 + 1.0 / 15.0
    p = p * s2 + 1.0 / 13.0
    p = p * s2 + 1.0 / 11.0
    p = p * s2 + 1.0 / 9.0
    p = p * s2 + 1.0 / 7.0
    p = p * s2 + 1.0 / 5.0
    p = p * s2 + 1.0 / 3.0
    return 2.0 * (s + s * (s2 * p))


@triton.jit
def softplus(x, threshold):
    """``torch.nn.functional.softplus`` semantics (identity above ``threshold``), computed as
    max(x, 0) + log1p(exp(-|x|)) so it keeps its relative accuracy far below 0."""
    sp = tl.maximum(x, 0.0) + log1p_unit(tl.exp(-tl.abs(x)))
    return tl.where(x > threshold, x, sp)


@triton.jit
def tanh(x):
    """tanh from exp: (1 - e) / (1 + e) with e = exp(-2|x|), and an odd Taylor polynomial for
    |x| < 1/4 where 1 - e would cancel (terms to x^9: truncation < 1e-8 relative there)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = a * a
    p = 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    p = p * x2
    small = a + a * p
    r = tl.where(a < 0.25, small, big)
    return tl.where(x < 0.0, -r, r)
