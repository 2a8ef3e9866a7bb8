"""The GEMM kernels' (and the decode step's other kernels') Triton front end for a Hopper target (sm_90), on a
machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) runs the kernels' Python, not Triton's compiler, so it cannot see
compile errors such as a loop-carried variable changing type in one constexpr variant (a GPU call found
one: the split pieces of an fp32 operand shared names with the expert-mode row offsets). This builds the
IR of every constexpr variant the launcher can pick, for sm_90, without a device: a front-end error fails
here, on CPU, instead of in a GPU call.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

try:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
except ImportError as exc:  # pragma: no cover - Triton internals moved
    pytest.skip(f"this Triton has no ASTSource / make_backend ({exc})", allow_module_level=True)

from zmrl.kernels_batch_invariant.triton.matmul import _gemm_kernel, _split_k_sum  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Under the interpreter the kernels are interpreted functions, which Triton's front end cannot build:
# this module then runs itself once more in a subprocess without the interpreter.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
compiled_only = pytest.mark.skipif(INTERPRETING, reason="runs in a subprocess without TRITON_INTERPRET")


@pytest.mark.skipif(not INTERPRETING, reason="the tests below run directly")
def test_module_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _build_ir(fn, signature: dict[str, str], constexprs: dict[str, object]) -> None:
    backend = make_backend(TARGET)
    options = backend.parse_options({})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    src.make_ir(TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)


# (x dtype, w dtype) -> SPLIT_X, SPLIT_W, F32_DOT as _launch picks them
_DTYPE_CASES = {("bf16", "bf16"): (False, False, False), ("fp32", "bf16"): (True, False, False),
                ("bf16", "fp32"): (False, True, False), ("fp32", "fp32"): (True, True, False),
                ("fp16", "fp32"): (False, False, True)}


@compiled_only
@pytest.mark.parametrize("mode", ["plain", "experts", "segments", "blockdiag"])
@pytest.mark.parametrize("dtypes", list(_DTYPE_CASES), ids="x".join)
def test_gemm_kernel_builds_for_sm90(mode, dtypes):
    split_x, split_w, f32 = _DTYPE_CASES[dtypes]
    x_dt, w_dt = dtypes
    # a block-diagonal product never splits K (_launch refuses it)
    k_chunks = (0, 512) if split_w and mode != "blockdiag" else (0,)
    # the LoRA epilogue: one plain, expert or concatenated product without a delta or a split K (_launch)
    loras = (False, True) if mode in ("plain", "experts", "segments") else (False,)
    for k_chunk, bias, delta, lora, serial in itertools.product(k_chunks, (False, True), (False, True), loras,
                                                                (False, True)):
        if (lora and (delta or k_chunk)) or (serial and not k_chunk):
            continue
        # the split-K sum in the GEMM's launch (SERIAL_SUM) or in _split_k_sum's
        consts = dict(SERIAL_SUM=serial, SUM_BIAS=serial and bias, SUM_DELTA=serial and delta,
                      GATHER_DIV=8 if mode == "experts" and not bias else 0,  # the MoE's dispatch read in place
                      HAS_BIAS=bias and not k_chunk, HAS_DELTA=delta and not k_chunk, HAS_LORA=lora, LORA_R=32,
                      BLOCK_R=32, EXPERTS=mode == "experts",
                      SEGMENTS=mode in ("segments", "blockdiag"), X_SEGMENTS=mode == "blockdiag",
                      W_TABLE=mode != "plain", W_ALIGN=4, F32_DOT=f32, SPLIT_X=split_x, SPLIT_W=split_w,
                      K_CHUNK=k_chunk, INTERPRET=False, BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, BLOCK_E=64)
        ptrs = {"x_ptr": f"*{x_dt}", "w_ptr": f"*{w_dt}", "b_ptr": "*fp32", "d_ptr": "*fp32",
                "y_ptr": "*fp32" if k_chunk else "*bf16", "offs_ptr": "*i32", "woff_ptr": "*i64", "t_ptr": "*fp32",
                "lb_ptr": "*fp32", "lboff_ptr": "*i64", "lora_scale": "fp32", "o_ptr": "*bf16", "cnt_ptr": "*i32", "gidx_ptr": "*i64"}
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in _gemm_kernel.arg_names}
        _build_ir(_gemm_kernel, sig, consts)


@compiled_only
def test_topk_and_moe_sort_build_for_sm90():
    """The DSA top-k's radix select (its 256-bin histograms) and the MoE counting sort's two kernels."""
    from zmrl.kernels_batch_invariant.triton.dsa_indexer import TOPK_BLOCK, _topk_kernel
    from zmrl.kernels_batch_invariant.triton.moe_router import (SORT_CHUNK, _moe_sort_count_kernel,
                                                                _moe_sort_place_kernel)

    _build_ir(_topk_kernel, {"scores_ptr": "*fp32", "qpos_ptr": "*i64", "out_ptr": "*i64", "width": "i32",
                             "score_stride": "i32", "K": "i32", "BLOCK": "constexpr"}, {"BLOCK": TOPK_BLOCK})
    for e_p in (64, 256):
        ptrs = {"ids_ptr": "*i64", "counts_ptr": "*i32", "order_ptr": "*i64", "offsets_ptr": "*i32", "slot_ptr": "*i64"}
        consts = dict(E_P=e_p, CHUNK=SORT_CHUNK)
        _build_ir(_moe_sort_count_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32")
                                           for n in _moe_sort_count_kernel.arg_names}, consts)
        consts = dict(E=e_p - 3, E_P=e_p, C_P=32, CHUNK=SORT_CHUNK)
        _build_ir(_moe_sort_place_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32")
                                           for n in _moe_sort_place_kernel.arg_names}, consts)


@compiled_only
def test_split_k_sum_builds_for_sm90():
    for bias, delta in itertools.product((False, True), (False, True)):
        consts = dict(HAS_BIAS=bias, HAS_DELTA=delta, BLOCK_M=32, BLOCK_N=64)
        ptrs = {"p_ptr": "*fp32", "b_ptr": "*fp32", "d_ptr": "*fp32", "y_ptr": "*bf16"}
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in _split_k_sum.arg_names}
        _build_ir(_split_k_sum, sig, consts)


@compiled_only
@pytest.mark.parametrize("precision", ["tf32", "bf16", "ieee"])
def test_expert_backward_builds_for_sm90(precision):
    """The MoE expert backward's fp32 variants at every backward_matmul_precision (bf16 casts its tiles)."""
    from zmrl.kernels_batch_invariant.triton.expert_grads import _expert_dw_kernel, _expert_dx_kernel
    import triton.language as tl

    common = dict(CDT=tl.float32, HALF=False, PRECISION=precision, INTERPRET=False)
    ptrs = {"gy_ptr": "*fp32", "w_ptr": "*fp32", "dx_ptr": "*fp32", "offs_ptr": "*i32", "woff_ptr": "*i64",
            "g2_ptr": "*fp32", "w2_ptr": "*fp32"}
    term2 = dict(CDT=tl.bfloat16, HALF=True, TERM2=True, CDT2=tl.float32, HALF2=False, BLOCK_N2=32)
    # fp32 alone, and the MoE's gate/up form (a bf16 first term, an fp32 second one: expert_input_grad)
    for extra in (dict(TERM2=False, CDT2=tl.float32, HALF2=False, BLOCK_N2=16), term2):
        dx_consts = dict(common, W_TABLE=True, W_ALIGN=4, BLOCK_M=32, BLOCK_K=64, BLOCK_N=32, BLOCK_E=64, STAGES=3,
                         **extra)
        ptrs["gy_ptr"] = "*bf16" if extra["TERM2"] else "*fp32"
        ptrs["w_ptr"] = ptrs["gy_ptr"]
        _build_ir(_expert_dx_kernel, {n: "constexpr" if n in dx_consts else ptrs.get(n, "i32")
                                      for n in _expert_dx_kernel.arg_names}, dx_consts)
    ptrs = {"gy_ptr": "*fp32", "x_ptr": "*fp32", "dw_ptr": "*fp32", "offs_ptr": "*i32", "gidx_ptr": "*i64"}
    for div in (0, 8):  # rows in place, or gathered from the tokens (RowGather)
        dw_consts = dict(common, BLOCK_N=32, BLOCK_K=64, BLOCK_R=32, GATHER_DIV=div)
        _build_ir(_expert_dw_kernel, {n: "constexpr" if n in dw_consts else ptrs.get(n, "i32")
                                      for n in _expert_dw_kernel.arg_names}, dw_consts)


@compiled_only
def test_mla_backward_stages_build_for_sm90():
    from zmrl.kernels_batch_invariant.triton import mla_attention_bwd as B

    _build_ir(B._masked_softmax_kernel, {"s_ptr": "*fp32", "keep_ptr": "*u8", "p_ptr": "*bf16", "H": "i32", "U": "i32",
                                         "BLOCK": "constexpr"}, {"BLOCK": 1024})
    consts = dict(DC=512, BLOCK_R=B.DP_DS_BLOCK_R, BLOCK_U=B.DP_DS_BLOCK_U, BLOCK_K=B.DP_DS_BLOCK_K, F32_DOT=False)
    ptrs = {"go_ptr": "*bf16", "c_ptr": "*bf16", "p_ptr": "*bf16", "delta_ptr": "*fp32", "ds_ptr": "*bf16"}
    _build_ir(B._dp_ds_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in B._dp_ds_kernel.arg_names},
              consts)


@compiled_only
def test_rowwise_backwards_build_for_sm90():
    """The Triton closed-form backwards (short conv, RMSNorm plain / gated, L2 norm, SwiGLU, KDA gate) in
    every constexpr variant their launchers pick."""
    from zmrl.kernels_batch_invariant.triton import rowwise_grads as R

    for silu, state, dx, dw in itertools.product((False, True), repeat=4):
        consts = dict(W=4, HAS_STATE=state, SILU=silu, NEED_DX=dx, NEED_DW=dw, BT=R.CONV_TOKENS, BC=R.CONV_CHANNELS)
        ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp32", "st_ptr": "*bf16", "gy_ptr": "*bf16", "seq_ptr": "*i64",
                "cu_ptr": "*i64", "dx_ptr": "*bf16", "dw_ptr": "*fp32"}
        _build_ir(R._short_conv_bwd_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32")
                                             for n in R._short_conv_bwd_kernel.arg_names}, consts)
    for has_w, gated, dx, dw, dgate in itertools.product((False, True), repeat=5):
        consts = dict(HAS_W=has_w, GATED=gated, NEED_DX=dx, NEED_DW=dw, NEED_DGATE=dgate, ROWS=2, BLOCK_D=2048)
        ptrs = {n: "*bf16" for n in ("x_ptr", "gy_ptr", "gate_ptr", "dx_ptr", "dgate_ptr")}
        ptrs.update(w_ptr="*fp32", dw_ptr="*fp32", eps="fp32")
        _build_ir(R._rms_bwd_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32")
                                      for n in R._rms_bwd_kernel.arg_names}, consts)
    _build_ir(R._l2_bwd_kernel, {"x_ptr": "*fp32", "gy_ptr": "*bf16", "dx_ptr": "*fp32", "n_rows": "i32", "D": "i32",
                                 "eps": "fp32", "ROWS": "constexpr", "BLOCK_D": "constexpr"}, {"ROWS": 32, "BLOCK_D": 128})
    for dg, du in itertools.product((False, True), repeat=2):
        consts = dict(NEED_DG=dg, NEED_DU=du, BLOCK=1024)
        _build_ir(R._swiglu_bwd_kernel, {n: "constexpr" if n in consts else ("i32" if n == "n" else "*bf16")
                                         for n in R._swiglu_bwd_kernel.arg_names}, consts)
    for lb in (False, True):
        consts = dict(HAS_LB=lb, BLOCK=1024)
        ptrs = {"z_ptr": "*bf16", "a_ptr": "*fp32", "b_ptr": "*fp32", "gy_ptr": "*fp32", "dz_ptr": "*bf16",
                "lower_bound": "fp32"}
        _build_ir(R._kda_gate_bwd_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32")
                                           for n in R._kda_gate_bwd_kernel.arg_names}, consts)


@compiled_only
def test_mla_query_split_builds_for_sm90():
    from zmrl.kernels_batch_invariant.triton.mla_attention import _split_query_kernel

    for dr, lo in itertools.product((0, 64), (False, True)):
        consts = dict(DC=512, DR=dr, BC=512, BR=64, ROWS=8, LO=lo)
        ptrs = {"ql_ptr": "*fp32", "qr_ptr": "*fp32", "hi_ptr": "*bf16", "lo_ptr": "*bf16", "scale": "fp32"}
        _build_ir(_split_query_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32")
                                        for n in _split_query_kernel.arg_names}, consts)


@compiled_only
def test_lm_head_softmax_grad_builds_for_sm90():
    """The lm_head backward's logit gradient, with and without temperatures, for each output dtype."""
    from zmrl.kernels_batch_invariant.triton._common import MAX_ROW_BLOCK
    from zmrl.kernels_batch_invariant.triton.logprob_grads import _softmax_grad_kernel

    for scale, out in itertools.product((False, True), ("bf16", "fp16", "fp32")):
        consts = dict(SCALE=scale, BLOCK=MAX_ROW_BLOCK)
        ptrs = {"z_ptr": "*fp32", "tok_ptr": "*i64", "g_ptr": "*fp32", "inv_t_ptr": "*fp32", "dz_ptr": f"*{out}"}
        _build_ir(_softmax_grad_kernel, {n: "constexpr" if n in consts else ptrs.get(n, "i32")
                                         for n in _softmax_grad_kernel.arg_names}, consts)


def _sig(fn, ptrs: dict[str, str], consts: dict[str, object], scalars: dict[str, str] | None = None) -> dict[str, str]:
    """A kernel's signature: the named pointers, the constexprs, the named scalars (others i32)."""
    return {n: "constexpr" if n in consts else ptrs.get(n, (scalars or {}).get(n, "i32")) for n in fn.arg_names}


@compiled_only
def test_decode_step_row_kernels_build_for_sm90():
    """The decode step's row kernels in every variant the launchers pick: the RMSNorm with the residual add, the
    norms and the conv reading rows in place, the pooled short conv, the GLU over fused halves, the one-launch
    pointwise ops, the cache write, the KDA decode row staging and the MLA split kernel's program coordinates."""
    from zmrl.kernels_batch_invariant.triton import cache_write, glu, kda_recurrent, l2norm, mla_attention, norms
    from zmrl.kernels_batch_invariant.triton import pointwise, short_conv

    for residual, gated in ((False, False), (False, True), (True, False)):
        consts = dict(HAS_W=True, GATED=gated, RESIDUAL=residual, BLOCK=2048)
        ptrs = {"x_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*bf16",
                "h_ptr": "*bf16"}
        _build_ir(norms._rms_norm_kernel, _sig(norms._rms_norm_kernel, ptrs, consts, {"eps": "fp32"}), consts)
    consts = dict(BLOCK=128)
    _build_ir(l2norm._l2_norm_kernel, _sig(l2norm._l2_norm_kernel, {"x_ptr": "*bf16", "y_ptr": "*fp32"}, consts,
                                           {"eps": "fp32"}), consts)
    for blocks, idx in ((1, False), (3, True)):
        consts = dict(W=4, HAS_STATE=True, HAS_IDX=idx, W_BLOCKS=blocks, SILU=True, BLOCK_C=512)
        ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "w1_ptr": "*bf16", "w2_ptr": "*bf16", "st_ptr": "*bf16",
                "idx_ptr": "*i64", "seq_ptr": "*i64", "cu_ptr": "*i64", "y_ptr": "*bf16"}
        _build_ir(short_conv._short_conv_kernel, _sig(short_conv._short_conv_kernel, ptrs, consts), consts)
        consts = dict(W=4, HAS_STATE=True, HAS_IDX=idx, BLOCK_C=512)
        ptrs = {"x_ptr": "*bf16", "st_ptr": "*bf16", "idx_ptr": "*i64", "cu_ptr": "*i64", "out_ptr": "*bf16"}
        _build_ir(short_conv._conv_state_kernel, _sig(short_conv._conv_state_kernel, ptrs, consts), consts)
    consts = dict(SITU=False, CAP_UP=False, BLOCK=1024)
    _build_ir(glu._glu_kernel, _sig(glu._glu_kernel, {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16"}, consts,
                                    {"beta": "fp32", "linear_beta": "fp32"}), consts)
    consts = dict(BLOCK=1024)
    _build_ir(pointwise._sigmoid_kernel, _sig(pointwise._sigmoid_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, consts),
              consts)
    _build_ir(pointwise._add_cast_kernel, _sig(pointwise._add_cast_kernel,
                                               {"a_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}, consts), consts)
    consts = dict(DA=512, DB=64, DK=128, BLOCK=512, HAS_B=True, HAS_INDEX=True)
    ptrs = {"slot_ptr": "*i64", "kv_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "k8_ptr": "*u8", "ik_ptr": "*u8",
            "ks_ptr": "*fp32", "is_ptr": "*fp32"}
    _build_ir(cache_write._write_rows_kernel, _sig(cache_write._write_rows_kernel, ptrs, consts), consts)
    consts = dict(HK=2048, HV=2048, H=16, BLOCK=2048, C=64)
    ptrs = {"pos_ptr": "*i64", "slot_ptr": "*i64", "solved_ptr": "*i32", "k_ptr": "*fp32", "v_ptr": "*bf16",
            "g_ptr": "*fp32", "beta_ptr": "*fp32", "ck_ptr": "*fp32", "cv_ptr": "*bf16", "cg_ptr": "*fp32",
            "cbeta_ptr": "*fp32", "info_ptr": "*i32"}
    _build_ir(kda_recurrent._decode_rows_kernel, _sig(kda_recurrent._decode_rows_kernel, ptrs, consts), consts)
    ptrs = {"q_ptr": "*fp32", "qh_ptr": "*bf16", "ql_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i64",
            "seq_ptr": "*i64", "kp_ptr": "*i64", "qpos_ptr": "*i64", "out_ptr": "*fp32", "m_ptr": "*fp32",
            "l_ptr": "*fp32", "acc_ptr": "*fp32", "cnt_ptr": "*i32"}
    for form in ("heads", "keys"):
        cfg = mla_attention.kernel_config(64, 512, 64, form)
        fn = mla_attention.split_kernel_for(form)
        for dense, lo in ((False, True), (True, True), (False, False)):  # lo: Numerics.mla_operands "hi_lo"
            consts = dict(DC=512, DR=64, KC=cfg.chunk, NCH=cfg.n_chunks, DR_P=64, BLOCK_H=cfg.block_h, BLOCK_N=64,
                          SPLIT=mla_attention.SPLIT_KEYS, DENSE=dense, DIRECT=False, SPLIT_BF16=True,
                          N_HG=64 // cfg.block_h, FUSED_COMBINE=True, LO=lo)
            _build_ir(fn, _sig(fn, ptrs, consts, {"scale": "fp32"}), consts)


@compiled_only
@pytest.mark.parametrize("mode", ["plain", "experts", "segments"])
def test_lora_training_tile_fits_hopper(mode):
    """The tile ``lora_config`` gives a wide LoRA product at training rows (128 x 256, 8 warps, 3 stages: the delta
    starts the accumulator, so the tile holds one) compiles for sm_90 through ptxas within the 227 KiB of shared
    memory per block and without spilling registers (cuobjdump's resource usage, where this Triton ships it)."""
    import re
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from zmrl.kernels_batch_invariant.triton.matmul import LARGE_M, LORA_WIDE_N, linear_config, lora_config

    cfg = lora_config(linear_config(2048, 2048, torch.bfloat16, LARGE_M), LORA_WIDE_N)
    assert (cfg.block_m, cfg.block_n) == (128, 256)
    consts = dict(SERIAL_SUM=False, SUM_BIAS=False, SUM_DELTA=False, GATHER_DIV=8 if mode == "experts" else 0,
                  HAS_BIAS=False, HAS_DELTA=False, HAS_LORA=True, LORA_R=32, BLOCK_R=32, EXPERTS=mode == "experts",
                  SEGMENTS=mode == "segments", X_SEGMENTS=False, W_TABLE=mode != "plain", W_ALIGN=8, F32_DOT=False,
                  SPLIT_X=False, SPLIT_W=False, K_CHUNK=0, INTERPRET=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, BLOCK_E=64, GROUP_M=8, stride_xk=1, stride_wk=1, stride_yn=1, stride_on=1)
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*fp32", "d_ptr": "*fp32", "y_ptr": "*bf16", "offs_ptr": "*i32",
            "woff_ptr": "*i64", "t_ptr": "*fp32", "lb_ptr": "*fp32", "lboff_ptr": "*i64", "lora_scale": "fp32",
            "o_ptr": "*bf16", "cnt_ptr": "*i32", "gidx_ptr": "*i64"}
    names = _gemm_kernel.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    # what the launcher's arguments give the compiler: 16-byte aligned pointers and row strides
    aligned = [n for n in names if n not in consts and (n.endswith("_ptr") or n in (
        "N", "K", "stride_xg", "stride_xm", "stride_wg", "stride_wn", "stride_yg", "stride_ym", "stride_tm", "stride_lbn"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    out = triton.compile(ASTSource(_gemm_kernel, sig, consts, attrs), target=TARGET,
                         options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False})
    assert out.metadata.shared <= 227 * 1024, out.metadata.shared
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists() and shutil.which("cuobjdump") is None:
        return
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(out.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump) if cuobjdump.exists() else "cuobjdump", "-res-usage", f.name],
                               capture_output=True, text=True).stdout
    stack = [int(v) for v in re.findall(r"STACK:(\d+)", usage)]
    assert stack and max(stack) == 0, usage  # spilled registers live on the stack
