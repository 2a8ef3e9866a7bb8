"""The numerics contract of a process: every setting that changes the bits an op produces.

A rollout engine and a trainer give bitwise equal log-probs only if they run the same ops with the
same settings. Those settings live in one frozen record, ``Numerics``, applied to the process by one
function, ``apply_numerics``; nothing else in zmrl changes them. ``fingerprint()`` summarises the
applied contract plus the parts of the environment that also change bits (torch and Triton versions,
the CPU vector path and vendor); the two sides of an RL run exchange fingerprints and
``check_same_numerics`` stops the run, naming the field, if they differ. See docs/numerics.md.

Fields:

* ``kernel_mode``: "bitwise" (the batch-invariant kernels) or "fast" (stock kernels where an op has
  them, no parity).
* ``kda_dot_precision``: input precision of the dots in the Triton KDA kernels ("tf32x3", "ieee",
  "tf32"); a compile-time constant of those kernels. Default: ``$ZMRL_KDA_DOT_PRECISION`` if set when
  this module is first imported, else "tf32x3".
* ``kda_form``: the arithmetic of the Triton KDA ops (``kda_chunk``, its decode step and chunk step):
  "chunk" (the chunked WY form, ``triton/kda_chunk.py``: prefill and training at tensor-core speed, a
  decode step re-solves its chunk's 64-row tiles) or "recurrent" (the token recurrence,
  ``triton/kda_recurrent.py``: a decode step is one token of vector work; prefill and training run each
  sequence sequentially). The torch (CPU) backend always runs the chunked form. Default:
  ``$ZMRL_KDA_FORM`` if set when this module is first imported, else "recurrent": RL decodes many
  sequences of moderate length, where it is the faster form on the H200 (a batch-256 decode step with
  LoRA 29.5 -> 19.6 ms); "chunk" suits prefill-heavy work on long prompts (fla-core's token-recurrent
  kernel took ~4x the chunked form's time on one 32K-token sequence). benchmarks/results/2026-12-02_h200_summary.md
  has the numbers. ``kda_dot_precision`` applies to the chunked form only (the recurrent one has no dots).
* ``kda_recurrent_launch``: the recurrent form's launch configuration, "BVxW": BV state columns per program
  and W warps per program. It sets the layout the compiler gives the kernel's sums over dk, so it is shared
  numerics like the fields above (prefill, decode and the trainer change together); a speed choice,
  measured by benchmarks/kda_recurrent_configs.py. Default: ``$ZMRL_KDA_RECURRENT_LAUNCH`` if set when this
  module is first imported, else "32x2": what kda_recurrent_configs.py picked on an H100 (the fastest packed forwards among the
  configurations whose batch-256 decode step is as fast as the others'; 16x1 and 8x1 run training shapes
  up to 10 % faster but decode 1.6-3x slower),
  benchmarks/results/2026-12-05_kda_recurrent_configs_c9cab58_h100.json.
* ``mla_mma_rows``: what the sparse MLA kernel puts on its matrix-multiply instructions' rows. "heads"
  (default): a program's BLOCK_H heads are the rows of ``q @ k^T`` and ``p @ c_kv`` (Hopper then runs
  ``mma.sync``: 32 heads are fewer rows than its warpgroup instruction needs, and each warp reads the
  whole query operand). "keys": the transposed products ``k @ q^T`` and ``c_kv^T @ p^T``, the key block and
  the latent columns on the rows and the heads on the columns, which Hopper runs as warpgroup MMAs
  (``wgmma``), the query's columns resident in shared memory. Same operands and hi/lo splits, other
  instructions, so possibly other bits: shared numerics. Default: ``$ZMRL_MLA_MMA_ROWS`` if set when this module
  is first imported, else "heads" (the "keys" kernel is only 4-7 % faster on an H100 and its build spills,
  benchmarks/results/2026-12-06_h100_mla_keys_summary.md).
* ``mla_operands``: how the Triton MLA kernel multiplies its fp32 operands (the absorbed query q and the
  probabilities p) by a bf16 cache. "hi_lo" (default): each as its bf16 halves hi + lo, two tensor-core MMAs per
  product, ~16 significant bits (scores and outputs ~1e-5 relative of float64). "bf16": rounded to bf16 once,
  one MMA per product (FlashMLA's practice): half the kernel's tensor work and half its resident query tile,
  operands rounded to 2^-8 relative. Shared numerics (the engine and the trainer change together); a
  speed-for-accuracy choice that the torch (CPU) backend does not have (it multiplies in fp32 either way).
  Default: ``$ZMRL_MLA_OPERANDS`` if set when this module is first imported, else "hi_lo".
* ``cpu_gemm_cnr``: MKL's conditional-numerical-reproducibility mode for CPU GEMMs (the value of
  ``MKL_CBWR``). The default "AVX2,STRICT" fixes MKL's code path to its AVX2 kernels and makes a GEMM's
  result independent of MKL's thread count; without it MKL splits the K reduction of small-M GEMMs
  across threads on AVX-512 CPUs, so a row's bits depend on ``torch.set_num_threads``. MKL reads the
  variable at its first GEMM: zmrl's package ``__init__`` sets it unless the user did (a user's value
  outside the modes here makes the default "off"), and ``apply_numerics`` verifies with a probe GEMM
  that the mode took effect. "off" leaves MKL alone (faster on AVX-512; bits then depend on the thread
  count and the CPU). MKL's CNR branches are defined for Intel CPUs; on other vendors MKL runs its
  AUTO branch, which is why the fingerprint records the CPU vendor.
* ``backward_matmul_precision``: what the trainer's backward GEMMs with an fp32 operand run at on CUDA:
  "tf32" (default: tensor cores, operands rounded to TF32's 10-bit mantissa, relative rounding 2^-11,
  fp32 accumulation), "bf16" (operands rounded to bf16, 2^-8 relative, fp32 accumulation, twice TF32's tensor-core
  rate: FlashAttention's practice for P and dS; the backwards with a bf16 path -- the MLA attention
  backward on any device, the Triton MoE expert backward -- take it, the other GEMMs run as for "tf32")
  or "ieee" (fp32 FMA on CUDA cores, ~8x slower on the H200). The forward never reads
  it (no forward op uses a torch fp32 GEMM on CUDA in bitwise mode), so it is not part of the parity
  fingerprint; docs/numerics.md gives the backward this freedom (correct within tolerance against
  float64, deterministic run to run: cuBLAS picks the same kernel for the same shapes and flags).
  ``backward_matmuls`` applies it around each hand-written backward.
* ``cpu_threads``: torch intra-op threads (None leaves torch's choice). Not part of the fingerprint:
  with the default ``cpu_gemm_cnr`` no op's bits depend on it (tests/kernels sweep 1, 2 and 4 threads).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch

from . import _dispatch
from ._dispatch import Mode

KERNEL_MODES: tuple[str, ...] = typing.get_args(Mode)
KDA_DOT_PRECISIONS: tuple[str, ...] = ("tf32x3", "ieee", "tf32")
KDA_FORMS: tuple[str, ...] = ("chunk", "recurrent")
# "BVxW": state columns per program x warps per program of the recurrent KDA kernel
KDA_RECURRENT_LAUNCHES: tuple[str, ...] = ("32x2", "32x4", "32x8", "16x1", "16x2", "16x4", "8x1", "8x2")
# the rows of the sparse MLA kernel's MMAs: the heads (q @ k^T) or the keys (k @ q^T)
MLA_MMA_ROWS: tuple[str, ...] = ("heads", "keys")
# the MLA kernel's fp32 operands (q, p) against a bf16 cache: bf16 hi + lo halves (two MMAs) or bf16 (one)
MLA_OPERANDS: tuple[str, ...] = ("hi_lo", "bf16")
CPU_GEMM_CNR_MODES: tuple[str, ...] = ("AVX2,STRICT", "AVX512,STRICT", "off")
BACKWARD_MATMUL_PRECISIONS: tuple[str, ...] = ("tf32", "bf16", "ieee")
DEFAULT_CPU_GEMM_CNR = "AVX2,STRICT"
# Numerics' fields that take one of a fixed set of values: field -> the values allowed (validate, recipe checks).
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "kernel_mode": KERNEL_MODES, "kda_dot_precision": KDA_DOT_PRECISIONS, "kda_form": KDA_FORMS,
    "kda_recurrent_launch": KDA_RECURRENT_LAUNCHES, "mla_mma_rows": MLA_MMA_ROWS, "mla_operands": MLA_OPERANDS,
    "cpu_gemm_cnr": CPU_GEMM_CNR_MODES,
    "backward_matmul_precision": BACKWARD_MATMUL_PRECISIONS}
# Read once: the documented way to pick the KDA precision without code (e.g. for a benchmark run).
_KDA_DOT_PRECISION_ENV = os.environ.get("ZMRL_KDA_DOT_PRECISION", "tf32x3")
_KDA_FORM_ENV = os.environ.get("ZMRL_KDA_FORM", "recurrent")
_KDA_RECURRENT_LAUNCH_ENV = os.environ.get("ZMRL_KDA_RECURRENT_LAUNCH", "32x2")
_MLA_MMA_ROWS_ENV = os.environ.get("ZMRL_MLA_MMA_ROWS", "heads")
_MLA_OPERANDS_ENV = os.environ.get("ZMRL_MLA_OPERANDS", "hi_lo")

# MKL reads MKL_CBWR when it runs its first GEMM; set it now (before any zmrl op can run one) unless
# the user chose a value. apply_numerics checks that MKL actually runs in the mode the contract asks for.
os.environ.setdefault("MKL_CBWR", DEFAULT_CPU_GEMM_CNR)
# The process's starting contract says what MKL was told: a user's own MKL_CBWR (e.g. AUTO) is "off".
_CPU_GEMM_CNR_ENV = os.environ["MKL_CBWR"] if os.environ["MKL_CBWR"] in CPU_GEMM_CNR_MODES else "off"


class NumericsError(RuntimeError):
    """The process cannot run the requested numerics, or two processes run different ones."""


@dataclass(frozen=True)
class Numerics:
    kernel_mode: str = "bitwise"
    kda_dot_precision: str = _KDA_DOT_PRECISION_ENV
    kda_form: str = _KDA_FORM_ENV
    kda_recurrent_launch: str = _KDA_RECURRENT_LAUNCH_ENV
    mla_mma_rows: str = _MLA_MMA_ROWS_ENV
    mla_operands: str = _MLA_OPERANDS_ENV
    cpu_gemm_cnr: str = _CPU_GEMM_CNR_ENV
    backward_matmul_precision: str = dataclasses.field(default="tf32", metadata={"bits": False})
    cpu_threads: int | None = dataclasses.field(default=None, metadata={"bits": False})

    def validate(self) -> "Numerics":
        for name, allowed in FIELD_CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Numerics.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"Numerics.cpu_threads must be None or an int >= 1, got {self.cpu_threads!r}")
        return self

    def replace(self, **changes: object) -> "Numerics":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def bit_fields(self) -> dict[str, str]:
        """The fields that change bits (name -> value as text): what the fingerprint and a captured CUDA
        graph depend on (the thread count and the backward's GEMM precision do not)."""
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self) if f.metadata.get("bits", True)}


@dataclass(frozen=True)
class NumericsFingerprint:
    """What two processes compare: ``fields`` (name -> value, every one that changes bits) and
    ``digest``, a short hash of them for logs."""

    digest: str
    fields: dict[str, str]

    def differences(self, other: "NumericsFingerprint") -> list[str]:
        names = sorted(set(self.fields) | set(other.fields))
        return [n for n in names if self.fields.get(n) != other.fields.get(n)]


_current = Numerics().validate()
_cnr_verified: set[str] = set()


def current_numerics() -> Numerics:
    """The contract this process runs under (the defaults until ``apply_numerics`` changes it)."""
    return _current


def _probe_gemm_thread_invariance() -> bool:
    """One GEMM whose K reduction MKL splits over threads on AVX-512 CPUs unless CNR is on (measured:
    1x4096 @ 4096x512 differs at 2 and 4 threads): same bits at 1 and 2 threads?"""
    from .matmul import linear

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 4096, generator=g), torch.randn(512, 4096, generator=g)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(linear.impls["torch"](x, w))
    finally:
        torch.set_num_threads(before)
    return torch.equal(results[0], results[1])


def _apply_cpu_gemm_cnr(mode: str) -> None:
    if mode == "off":
        return
    if mode in _cnr_verified:
        return
    if os.environ.get("MKL_CBWR") != mode:
        os.environ["MKL_CBWR"] = mode  # effective only if MKL has not run a GEMM yet: the probe tells
    if torch.backends.mkl.is_available() and not _probe_gemm_thread_invariance():
        raise NumericsError(
            f"cpu_gemm_cnr={mode!r} is not in effect: MKL gives different bits at 1 and 2 threads. MKL reads "
            f"MKL_CBWR at its first GEMM (now {os.environ.get('MKL_CBWR')!r}); import zmrl before running any "
            f"torch matmul, or export MKL_CBWR={mode} before starting Python. On a non-Intel CPU (this one: "
            f"{_cpu_vendor()}) MKL ignores the CNR branch: export MKL_CBWR=AUTO to run without it, and give "
            f"every process the same thread count")
    _cnr_verified.add(mode)


def apply_numerics(numerics: Numerics) -> Numerics:
    """Make ``numerics`` the contract of this process (kernel mode, KDA dot precision, MKL mode, thread
    count); returns the previous contract. The only function in zmrl that changes these settings."""
    global _current
    numerics.validate()
    _apply_cpu_gemm_cnr(numerics.cpu_gemm_cnr)
    # The thread count is set when the contract changes it (re-applying or restoring a contract does not
    # undo a later torch.set_num_threads: no op's bits depend on it).
    if numerics.cpu_threads is not None and numerics.cpu_threads != _current.cpu_threads:
        torch.set_num_threads(numerics.cpu_threads)
    _dispatch._set_dispatch_mode(numerics.kernel_mode)  # type: ignore[arg-type]
    previous, _current = _current, numerics
    return previous


def mla_mma_rows() -> str:
    """The rows of the sparse MLA kernel's MMAs under the applied contract, "heads" or "keys"."""
    return _current.mla_mma_rows


def mla_operands() -> str:
    """How the Triton MLA kernel multiplies q and p by a bf16 cache under the applied contract, "hi_lo" or "bf16"."""
    return _current.mla_operands


@contextlib.contextmanager
def numerics_scope(numerics: Numerics) -> Iterator[Numerics]:
    """Apply ``numerics`` for the body and restore the previous contract afterwards."""
    previous = apply_numerics(numerics)
    try:
        yield numerics
    finally:
        apply_numerics(previous)


def _cpu_vector_path() -> str:
    # ATen's vectorised CPU kernels: its AVX2 and AVX-512 builds give the same bits (measured on the
    # whole tiny model, see docs/numerics.md), the unvectorised DEFAULT build does not.
    cap = torch.backends.cpu.get_cpu_capability()
    return "avx2-or-avx512" if cap in ("AVX2", "AVX512") else cap.lower()


def _cpu_vendor() -> str:
    """The CPU vendor id (GenuineIntel, AuthenticAMD, ...): MKL's CNR branches apply to Intel CPUs only."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("vendor_id", "CPU implementer")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def fingerprint(numerics: Numerics | None = None) -> NumericsFingerprint:
    """The bit-relevant settings of ``numerics`` (default: the applied contract) plus this process's
    torch and Triton versions and CPU vector path."""
    n = numerics or _current
    fields = n.bit_fields()
    fields.update(torch=torch.__version__, triton=_triton_version(), cpu_vector_path=_cpu_vector_path(),
                  cpu_vendor=_cpu_vendor())
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return NumericsFingerprint(digest=digest, fields=fields)


def check_same_numerics(fingerprints: dict[str, NumericsFingerprint]) -> None:
    """Raise ``NumericsError`` naming the first field where any process differs from the first one.

    fingerprints: process name (e.g. "trainer", "rollout 0") -> its fingerprint."""
    items = list(fingerprints.items())
    if not items:
        return
    ref_name, ref = items[0]
    for name, fp in items[1:]:
        diff = ref.differences(fp)
        if diff:
            field = diff[0]
            raise NumericsError(
                f"numerics differ between {ref_name} and {name}: {field} is {ref.fields.get(field)!r} in {ref_name} "
                f"and {fp.fields.get(field)!r} in {name} (fingerprints {ref.digest} vs {fp.digest}); both sides "
                f"must run the same numerics for bitwise log-prob parity")


# ----------------------------------------------------------------------------- kernel-mode shorthands
def set_mode(mode: Mode) -> None:
    """``apply_numerics`` with only the kernel mode changed."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode must be one of {KERNEL_MODES}, got {mode!r}")
    apply_numerics(_current.replace(kernel_mode=mode))


@contextlib.contextmanager
def kernel_mode(mode: Mode) -> Iterator[None]:
    """Run the body under another kernel mode (the rest of the contract unchanged)."""
    with numerics_scope(_current.replace(kernel_mode=mode)):
        yield


def kda_dot_precision() -> str:
    """The KDA dot precision of the applied contract (read by the Triton KDA kernels at launch)."""
    return _current.kda_dot_precision


def kda_form() -> str:
    """The Triton KDA ops' form of the applied contract, "chunk" or "recurrent" (read at every call)."""
    return _current.kda_form


def kda_recurrent_launch() -> tuple[int, int]:
    """(state columns per program, warps per program) of the recurrent KDA kernel under the applied contract."""
    bv, warps = _current.kda_recurrent_launch.split("x")
    return int(bv), int(warps)


@contextlib.contextmanager
def backward_matmuls(device: torch.device) -> Iterator[None]:
    """Run the body's torch fp32 GEMMs on ``device`` at the contract's ``backward_matmul_precision``.

    For hand-written backwards only (their GEMMs need not be invariant). CUDA only: on CPU torch's
    fp32 GEMMs are left at full precision. "bf16" runs them at TF32 too: the backwards that have a bf16
    path round their operands themselves. The previous setting is restored on exit."""
    if device.type != "cuda" or _current.backward_matmul_precision == "ieee":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # "high": TF32 tensor cores for fp32 GEMMs
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


_F = TypeVar("_F", bound=Callable[..., Any])


def with_backward_matmuls(backward: _F) -> _F:
    """Decorate an autograd Function's ``backward(ctx, *grads)``: it runs under ``backward_matmuls`` on
    the device of its first tensor gradient."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        dev = next((g.device for g in grads if isinstance(g, torch.Tensor)), None)
        if dev is None:
            return backward(ctx, *grads)
        with backward_matmuls(dev):
            return backward(ctx, *grads)

    return wrapper  # type: ignore[return-value]
