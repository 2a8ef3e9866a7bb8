"""The numerics contract: one record applied by one function, a fingerprint that names what differs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zmrl.kernels_batch_invariant as kbi
from zmrl.kernels_batch_invariant import numerics as nm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_numerics():
    before, threads = kbi.current_numerics(), torch.get_num_threads()
    yield
    kbi.apply_numerics(before)
    torch.set_num_threads(threads)


def test_defaults_and_mkl_mode_set_at_import():
    n = kbi.Numerics()
    assert (n.kernel_mode, n.cpu_gemm_cnr, n.cpu_threads) == ("bitwise", "AVX2,STRICT", None)
    assert n.kda_dot_precision == os.environ.get("ZMRL_KDA_DOT_PRECISION", "tf32x3")
    assert n.kda_form == os.environ.get("ZMRL_KDA_FORM", "recurrent")
    # zmrl/__init__.py sets MKL's mode before any GEMM can run; it must be the contract's default
    assert os.environ["MKL_CBWR"] == nm.DEFAULT_CPU_GEMM_CNR
    assert 'setdefault("MKL_CBWR", "AVX2,STRICT")' in (ROOT / "zmrl" / "__init__.py").read_text()


@pytest.mark.parametrize("field,value", [("kernel_mode", "turbo"), ("kda_dot_precision", "fp16"),
                                         ("kda_form", "parallel"), ("kda_recurrent_launch", "64x3"),
                                         ("cpu_gemm_cnr", "AVX2"), ("cpu_threads", 0),
                                         ("backward_matmul_precision", "fp16")])
def test_bad_values_name_the_field(field: str, value: object):
    before = kbi.current_numerics()
    with pytest.raises(ValueError, match=rf"Numerics\.{field} must be"):
        kbi.apply_numerics(kbi.Numerics().replace(**{field: value}))
    assert kbi.current_numerics() == before, "a rejected contract changes nothing"


def test_apply_sets_every_field_and_scope_restores():
    kbi.apply_numerics(kbi.Numerics())
    n = kbi.Numerics(kernel_mode="fast", kda_dot_precision="ieee", cpu_threads=2)
    with kbi.numerics_scope(n):
        assert kbi.current_numerics() == n
        assert kbi.get_mode() == "fast" and nm.kda_dot_precision() == "ieee" and torch.get_num_threads() == 2
    assert kbi.current_numerics() == kbi.Numerics()
    assert kbi.get_mode() == "bitwise" and nm.kda_dot_precision() == kbi.Numerics().kda_dot_precision


def test_kernel_mode_shorthands_go_through_the_contract():
    kbi.apply_numerics(kbi.Numerics(kda_dot_precision="tf32"))
    kbi.set_mode("fast")
    assert kbi.current_numerics() == kbi.Numerics(kernel_mode="fast", kda_dot_precision="tf32")
    with kbi.kernel_mode("bitwise"):
        assert kbi.current_numerics().kernel_mode == "bitwise" and kbi.get_mode() == "bitwise"
        assert kbi.current_numerics().kda_dot_precision == "tf32"
    assert kbi.get_mode() == "fast"
    with pytest.raises(ValueError, match="kernel mode must be one of"):
        kbi.set_mode("turbo")  # type: ignore[arg-type]


def test_restoring_a_contract_does_not_reset_threads():
    kbi.apply_numerics(kbi.Numerics(cpu_threads=1))
    torch.set_num_threads(2)  # someone changes the count afterwards (no op's bits depend on it)
    with kbi.kernel_mode("fast"):
        pass
    assert torch.get_num_threads() == 2


def test_fingerprint_fields_and_digest():
    fp = kbi.fingerprint(kbi.Numerics())
    assert set(fp.fields) == {"kernel_mode", "kda_dot_precision", "kda_form", "kda_recurrent_launch", "mla_mma_rows",
                              "mla_operands", "cpu_gemm_cnr", "torch", "triton", "cpu_vector_path", "cpu_vendor"}
    assert fp.fields["torch"] == torch.__version__ and len(fp.digest) == 12
    assert kbi.fingerprint(kbi.Numerics(cpu_threads=3)) == fp, "the thread count does not change bits"
    other = kbi.fingerprint(kbi.Numerics(kda_dot_precision="ieee"))
    assert other.digest != fp.digest and fp.differences(other) == ["kda_dot_precision"]
    other_form = "chunk" if kbi.Numerics().kda_form == "recurrent" else "recurrent"
    assert fp.differences(kbi.fingerprint(kbi.Numerics(kda_form=other_form))) == ["kda_form"]
    other_launch = "8x1" if kbi.Numerics().kda_recurrent_launch != "8x1" else "32x4"
    assert fp.differences(kbi.fingerprint(kbi.Numerics(kda_recurrent_launch=other_launch))) == ["kda_recurrent_launch"]
    other_rows = "keys" if kbi.Numerics().mla_mma_rows == "heads" else "heads"
    assert fp.differences(kbi.fingerprint(kbi.Numerics(mla_mma_rows=other_rows))) == ["mla_mma_rows"]
    with pytest.raises(ValueError, match="mla_mma_rows"):
        kbi.Numerics(mla_mma_rows="queries").validate()
    other_operands = "bf16" if kbi.Numerics().mla_operands == "hi_lo" else "hi_lo"
    assert fp.differences(kbi.fingerprint(kbi.Numerics(mla_operands=other_operands))) == ["mla_operands"]
    with pytest.raises(ValueError, match="mla_operands"):
        kbi.Numerics(mla_operands="fp8").validate()
    with kbi.numerics_scope(kbi.Numerics(kernel_mode="fast")):
        assert kbi.fingerprint().fields["kernel_mode"] == "fast"


def test_backward_matmul_precision_scopes_torch_fp32_gemms_on_cuda_only():
    assert kbi.Numerics().backward_matmul_precision == "tf32"
    assert kbi.fingerprint(kbi.Numerics(backward_matmul_precision="ieee")) == kbi.fingerprint(kbi.Numerics()), \
        "the backward's precision never reaches a forward bit"
    before = torch.get_float32_matmul_precision()
    seen = []

    @nm.with_backward_matmuls
    def backward(ctx, grad):
        seen.append(torch.get_float32_matmul_precision())
        return grad

    with kbi.numerics_scope(kbi.Numerics()):
        with nm.backward_matmuls(torch.device("cpu")):
            assert torch.get_float32_matmul_precision() == before  # CPU: left alone
        backward(None, torch.zeros(1))
        if torch.cuda.is_available():
            backward(None, torch.zeros(1, device="cuda"))
            with kbi.numerics_scope(kbi.Numerics(backward_matmul_precision="ieee")):
                backward(None, torch.zeros(1, device="cuda"))
    expected = [before] + (["high", before] if torch.cuda.is_available() else [])
    assert seen == expected and torch.get_float32_matmul_precision() == before


def test_mismatch_stops_naming_the_field():
    a = kbi.fingerprint(kbi.Numerics())
    kbi.check_same_numerics({"trainer": a, "rollout worker 0": a, "rollout worker 1": a})
    b = kbi.fingerprint(kbi.Numerics(kernel_mode="fast"))
    with pytest.raises(kbi.NumericsError, match=r"between trainer and rollout worker 1: kernel_mode is 'bitwise' in "
                                                r"trainer and 'fast' in rollout worker 1"):
        kbi.check_same_numerics({"trainer": a, "rollout worker 0": a, "rollout worker 1": b})


def test_cnr_probe_passes_here():
    assert nm._probe_gemm_thread_invariance()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's CNR mode needs an MKL build of torch")
def test_cnr_that_did_not_take_effect_is_reported():
    """MKL started without CNR (a GEMM ran before the mode was set): apply_numerics refuses to run."""
    code = """
import os, torch
torch.randn(8, 8) @ torch.randn(8, 8)          # MKL reads MKL_CBWR here: AUTO = no CNR
from zmrl.kernels_batch_invariant import numerics as nm, Numerics, NumericsError, apply_numerics
if nm._probe_gemm_thread_invariance():
    print("SKIP: this CPU's MKL path is thread-invariant even without CNR")
else:
    try:
        apply_numerics(Numerics(cpu_gemm_cnr="AVX2,STRICT"))
        print("NOT RAISED")
    except NumericsError as e:
        print("RAISED", e)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MKL_CBWR": "AUTO"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    if out.startswith("SKIP"):
        pytest.skip(out.strip())
    assert out.startswith("RAISED") and "cpu_gemm_cnr='AVX2,STRICT' is not in effect" in out, out


def test_cnr_set_after_torch_import_takes_effect_and_fingerprints_are_stable_across_processes():
    """A contract applied after torch was imported (but before any GEMM) still sets MKL's mode; the
    fingerprint of a contract is the same in another process."""
    code = """
import json, os, torch
os.environ["MKL_CBWR"] = "AUTO"   # a user's value: the starting contract says "off"...
from zmrl.kernels_batch_invariant import numerics as nm, Numerics, apply_numerics, current_numerics, fingerprint
assert current_numerics().cpu_gemm_cnr == "off"
apply_numerics(Numerics(cpu_gemm_cnr="AVX2,STRICT"))  # ...and applying CNR before MKL's first GEMM works
fp = fingerprint(Numerics(kernel_mode="fast", kda_dot_precision="tf32x3", cpu_gemm_cnr="AVX2,STRICT"))
print(json.dumps([os.environ["MKL_CBWR"], nm._probe_gemm_thread_invariance(), fp.digest, fp.fields]))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ZMRL_KDA_DOT_PRECISION", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    mkl, invariant, digest, fields = json.loads(out.strip().splitlines()[-1])
    assert (mkl, invariant) == ("AVX2,STRICT", True)
    here = kbi.fingerprint(kbi.Numerics(kernel_mode="fast", kda_dot_precision="tf32x3", cpu_gemm_cnr="AVX2,STRICT"))
    assert (digest, fields) == (here.digest, here.fields)
