#!/usr/bin/env bash
# Trainer-speed GPU run (issue 13) on one H200 in ONE device call of at most TOTAL_S seconds (default 530,
# under the 10-minute limit of a call). Steps, in order of what matters most; each has its own time limit
# (never more than what is left of TOTAL_S), a failing or hanging step does not stop the next ones, and
# every step writes its log (and JSON where it has one) under $OUT as it goes:
#   1. gpu_tests_new      the chunked lm_head + log-prob (bitwise vs unchunked and decode rows at
#                         V = 163840, gradient vs float64, determinism, memory) and the grouped MoE expert
#                         backward (bench shapes: vs float64, vs the per-expert loop, determinism, timing);
#   2. gpu_tests_kda_bwd  KDA backward via fla-core at the bench head shape (H 16, d 128, bf16 v): vs
#                         float64 with fla's own error side by side, determinism, fla path taken. fla
#                         autotunes on first use (cached on disk for the later steps: FLA_CACHE_RESULTS);
#   3. trainer_throughput bench preset, 16 layers, 4 x 4096 tokens: fwd+bwd per recompute policy (tok/s,
#                         MFU, measured and expected peak memory), per-kernel profile, KDA layer vs fla;
#   4. rl_step            reduced RL batch (8 prompts x n=8, prompt 512, 128..512 new tokens): phase
#                         breakdown with and without the separate parity forward, log-prob parity;
#   5. with whatever time is left: the MLA backward and whole-trainer-backward GPU tests, the closed-form
#      backwards of the row-wise Triton ops, the small-head KDA backward cases (other fla autotune shapes).
#
#   OUT=/some/dir bash benchmarks/gpu_i13.sh          (TOTAL_S=... to change the overall budget)
#
# STEPS picks steps (default "kda_bwd kimi trainer rl_step more"). Also: new, rowwise, kda_bwd_small;
#   engine        the CUDA-graph engine tests on the GPU;      census   trainer_op_census.py;
#   rollout       rollout_profile.py at 8 prompts x 8;         kimi     the Kimi-Linear KDA layer vs fla's chunk_kda;
#   matmul        the GEMM tests (row invariance of the split and split-K products, sm_90 IR of every variant);
#   expert_grads  the Triton MoE backward (vs float64, vs the torch path, timing);
#   lora          lora_gemms.py;   lora_sweep  its tile-config sweep at decode sizes (bits checked);
#   decode_lora   the graph decode step with LoRA r = 32;   decode_ab  the same on BASE_TREE first, then on this tree;
#   launch_cuts   the GPU tests of the kernels changed to cut decode launches (rows read in place, one-launch pointwise
#                 ops, the pooled conv, the split-K sum in the GEMM's launch) and the model-level static decode test;
#   parity        the bench-shape parity test;   bitwise  the ZMRL_TEST_DEVICE=cuda parity suite;
#   rollout_rl    the RL-shaped rollout (64 prompts x 8 samples, 512-token prompts, <= 1024 new tokens);
#   bwd_bf16      the backward's bf16-operand paths (MLA attention stages, MLA backward, MoE expert backward);
#   rl_full       the whole RL step at 64 prompts x 8 (rollout, fused parity forward, backward, optimizer, weight push);
#   kda_sweep     kda_decode_vs_fla.py --sweep (launch and column-block configs) + the GPU KDA decode tests;
#   rollout_rl_fine  the RL-shaped rollout with finer decode-graph batch buckets (GRAPH_SIZES);
#   kda_rec       kda_recurrent_configs.py: the recurrent KDA kernel's launch configurations vs fla (KDA_REC_ARGS;
#                 KDA_PICK=1 runs the later steps under the configuration it picks);
#   kda_tests     the Triton KDA GPU tests (decode step, chunk step, packed forward; both forms);
#   kda_phases    kda_decode_phases.py: the KDA decode step with one intra-kernel phase cut out at a time;
#   kda_forms     benchmarks/probes/kda_recurrent_probe.py: zmrl's two KDA forms vs fla on training, prefill and
#                 decode shapes, then the Triton KDA and MLA tests (the KDA ones under both forms);
#   prefill / prefill_chunk  prefill_throughput.py in the default (recurrent) / the chunked KDA form;
#   newk          the Triton closed-form backwards of the row-wise ops, the MLA query split, their forwards' tests.
#   final3        the LoRA epilogue (linear, expert_linear, linear_concat), rows read in place, radix top-k and
#                 MoE sort GPU tests;
#   mla_keys      the keys MLA form (query resident) vs the heads form: sweep, MLA tests, decode and prefill per form;
#   mla_forms     mla_dsa_kernels.py --sweep-only per MLA kernel form (launch configurations at decode 256 x 8K and a
#                 4096-token prefill) + the MLA tests;
#   decode_gemms  decode_gemms.py: the decode step's GEMM launches alone vs bound and cuBLAS, the top groups swept;
#   train_gemms   train_gemms.py: the trainer forward's GEMM launches (16K tokens) timed in place vs peak and cuBLAS;
#   train_sweep   the same with --sweep: the groups of the most time under the training tile configs (bits checked);
#   grads_f64     the whole model's CUDA LoRA gradients vs float64, determinism and recompute (test_gradients_gpu);
#   next          grads16 train_gemms mla_stages parity (what the 2026-12-06 session left unmeasured);
#   next2         train_sweep trainer decode_lora prefill parity (what the third 2026-12-06 session left unmeasured);
#   gate_up       the GPU tests of expert_gate_up (one gradient for the MoE rows), with its bench-shape timing;
#   next3 / next4 gate_up trainer parity / decode_lora prefill train_sweep (the fourth 2026-12-06 session's calls);
#   next5         train_gemms trainer (with --sync-census) matmul prefill parity: what the fifth 12-06 session left unrun;
#   pdl           decode (graph, LoRA, batch 1/64/256 at 8K) and prefill (PREFILL_PDL_ARGS) with ZMRL_PDL=0 then 1, the
#                 graph tests with it;   first7  trainer matmul pdl parity tma_probe (the 12-07 session's first call);
#   final7        the GPU tests of PDL, the MLA fused combine and the GEMM, bench parity, (FINAL7_MLA_SLOTS: launches of the
#                 MLA sweep with and without slot lists, FINAL7_OPERANDS: and with bf16 operands), decode / prefill with PDL,
#                 the fused combine and slot lists
#                 off and on (FINAL7_DECODE, FINAL7_PREFILL), the trainer (FINAL7_TRAINER_SLOTS);
#   tma_probe     probes/gemm_tma_probe.py: the training-row GEMM with TMA tile loads / persistent programs, same bits?;
#   bands         the GEMM's banded launch order against the plain one (train_gemms and train_gemms_plain, ZMRL_GEMM_GROUP_M=1),
#                 then trainer, prefill, matmul and parity with bands (the fifth 12-06 session's call);
#   dsa           mla_dsa_kernels.py --dsa-only: the indexer's scores and the radix top-k against torch;
#   final         the GPU tests of the last kernels (combine over sorted rows, epilogue delta, logit gradient, MLA bwd);
#   mla_bwd       mla_bwd_gemms.py: the MLA backward's fp32-output GEMMs, aligned and not;  gemm_sweep  the GEMM config sweep.
# T_<STEP> their limits; DECODE_ARGS extra flags of decode_lora (e.g. --op-census 64,256); RECOMPUTE / KDA_TOKENS / TRAINER_ARGS the trainer benchmark's policies, KDA-layer sizes
# and extra flags; CENSUS_ARGS / ROLLOUT_ARGS extra flags of those steps.
#
# The KDA backward through fla-core is opt-in (ZMRL_KDA_FLA_BACKWARD=1, see
# zmrl/kernels_batch_invariant/triton/kda_chunk_bwd.py); this run turns it on for every step, so the
# benchmarks measure the trainer as it is meant to run, and step 2 checks that backward. Needs torch +
# triton with CUDA, and fla-core (+ einops): wheels in .whl/ are installed (no index, no deps) when fla
# is missing.
set -u
set -o pipefail

cd "$(dirname "$0")/.."
START=$(date +%s)
TOTAL_S=${TOTAL_S:-530}
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/gpu_i13_$(date -u +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export ZMRL_KDA_FLA_BACKWARD=1 FLA_CACHE_RESULTS=1 OUT
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
# fla-core autotunes its KDA kernels for ~100 s on a fresh machine. Triton's on-disk autotune cache
# (TRITON_CACHE_AUTOTUNING) keeps the choices; AUTOTUNE_TGZ (a tarball of *.autotune.json files saved by an
# earlier run, see the end of this script) restores them, so that time is spent once, not per machine.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/zmrl_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -n "${AUTOTUNE_TGZ:-}" ] && [ -f "$AUTOTUNE_TGZ" ]; then
  tar xzf "$AUTOTUNE_TGZ" -C "$TRITON_CACHE_DIR" && echo "# restored $(tar tzf "$AUTOTUNE_TGZ" | wc -l) autotune results"
fi

if ! $PY -c "import fla.ops.kda, einops, xdist" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tee "$OUT/pip.log"
fi
{
  echo "# gpu_i13.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') budget ${TOTAL_S}s"
  $PY -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  $PY -c "import fla; print('# fla-core', getattr(fla, '__version__', '?'))" || echo "# fla-core NOT importable: KDA backward falls back to the torch composition"
  echo "# ZMRL_KDA_FLA_BACKWARD=$ZMRL_KDA_FLA_BACKWARD"
} 2>&1 | tee "$OUT/env.log"

step() {  # step NAME LIMIT_S CMD... : run under min(LIMIT_S, time left), log to $OUT/NAME.log, record status
  local name=$1 limit=$2
  shift 2
  local left=$(( TOTAL_S - ($(date +%s) - START) - 5 ))
  if (( left < 15 )); then
    echo "$name skipped (only ${left}s of the ${TOTAL_S}s budget left)" | tee -a "$SUMMARY"
    return
  fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - t0 )) limit=${limit}s$( ((rc == 124)) && echo ' TIMED OUT')" | tee -a "$SUMMARY"
}

PYTEST="$PY -m pytest -p no:cacheprovider -m gpu -rA -v -s"
# pytest-xdist (a wheel in .whl/ travels with the run) spreads the Triton compiles of the GEMM and
# bitwise suites over the machine's cores; one GPU serves every worker (the tests are small).
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n ${XDIST_WORKERS:-8}"

STEPS=${STEPS:-"kda_bwd kimi trainer rl_step more"}
# "next": what the 2026-12-06 session left unmeasured, in one call: the GPU gradient tests of its backward paths (one
# process, no xdist: an xdist worker lost the `device` fixture there), the trainer forward's GEMM breakdown, the heads
# MLA form's 3-stage launch, then the bench-shape parity test
[[ " $STEPS " == *" next "* ]] && STEPS="$STEPS grads16 train_gemms mla_stages parity"
# "next2": what the third 2026-12-06 session left for the next one: the training tile sweep with MLA's batched products,
# the trainer step, decode with the heads MLA form's three stages, prefill, then the parity tests
[[ " $STEPS " == *" next2 "* ]] && STEPS="$STEPS train_sweep trainer decode_lora prefill parity"
# "next3" / "next4": the first 12-06 evening session's two calls: the GPU tests of expert_gate_up (the MoE's one rows
# gradient), the trainer step with it and with the MLA epilogue LoRA, the bench-shape parity; then decode, prefill and
# the training tile sweep
[[ " $STEPS " == *" next3 "* ]] && STEPS="$STEPS gate_up trainer parity"
[[ " $STEPS " == *" next4 "* ]] && STEPS="$STEPS decode_lora prefill train_sweep"
# "bands": the GEMM's banded launch order (grouped_tile) against the plain order on one machine: the forward's GEMM launches
# both ways, the trainer step and prefill with bands, the GEMM GPU tests (row invariance) and the bench-shape parity
[[ " $STEPS " == *" bands "* ]] && STEPS="$STEPS train_gemms train_gemms_plain trainer prefill matmul parity"
# "next5": the first call after the fifth 12-06 session (its last changes never ran on a GPU: the delta as the GEMM
# accumulator's start, the 128 x 256 LoRA tiles, the MLA backward's one sync per group of chunks): the forward's GEMM
# launches, the trainer step with its host-sync census, the GEMM GPU tests, prefill, the bench-shape parity
[[ " $STEPS " == *" next5 "* ]] && STEPS="$STEPS train_gemms trainer matmul prefill parity" && \
  TRAINER_ARGS="${TRAINER_ARGS:-} --sync-census"
# "first7": the first call of the 12-07 session (the cut-off try's programmatic dependent launch and TMA probe, and the
# fifth 12-06 session's delta-first GEMM numerics, never ran on a GPU): the GEMM GPU tests, PDL off / on for decode and
# prefill with the graph tests under it, the trainer step with its host-sync census, the bench-shape parity, the probe
[[ " $STEPS " == *" first7 "* ]] && STEPS="$STEPS trainer matmul pdl parity tma_probe" && \
  TRAINER_ARGS="${TRAINER_ARGS:-} --sync-census" && PREFILL_PDL_ARGS="${PREFILL_PDL_ARGS:---shapes 4x8192 --modes bitwise --iters 2}"
has() { [[ " $STEPS " == *" $1 "* ]]; }

# The recurrent KDA kernel's launch configurations (shared numerics: decode == packed checked per configuration),
# timed on training, prefill and decode shapes, with fla-core's kernels on the same shapes; then the KDA GPU tests.
has kda_rec && step kda_recurrent_configs "${T_KDA_REC:-240}" $PY benchmarks/kda_recurrent_configs.py ${KDA_REC_ARGS:-} \
  --best "$OUT/kda_best.txt" --out "$OUT/kda_recurrent_configs.json"
# KDA_PICK=1: the steps after this one run under the configuration the sweep picked (a numerics field: the
# engine and trainer sides of every test change together)
if has kda_rec && [ "${KDA_PICK:-0}" = 1 ] && [ -s "$OUT/kda_best.txt" ]; then
  export ZMRL_KDA_RECURRENT_LAUNCH=$(cat "$OUT/kda_best.txt")
  echo "# ZMRL_KDA_RECURRENT_LAUNCH=$ZMRL_KDA_RECURRENT_LAUNCH for the steps after kda_rec" | tee -a "$SUMMARY"
fi
has kda_tests && step gpu_tests_kda "${T_KDA_TESTS:-200}" $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs $XDIST \
  tests/kernels/triton/test_kda_decode_step.py tests/kernels/triton/test_kda_chunk_step.py tests/kernels/triton/test_kda_chunk.py

# The third session's kernels (MoE combine over sorted rows, GEMM epilogue delta, fused logit gradient) with
# the MLA backward's aligned key counts and the whole-trainer gradients.
has final && step gpu_tests_final "${T_FINAL:-240}" $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs $XDIST \
  tests/kernels/triton/test_moe_router.py tests/kernels/triton/test_logprob_grads.py tests/kernels/triton/test_lm_head_logprobs_gpu.py \
  tests/kernels/triton/test_matmul.py tests/kernels/triton/test_mla_attention_bwd.py tests/kernels/triton/test_mla_attention_grads_gpu.py \
  tests/trainer/test_gradients_gpu.py

# The fourth session's kernels: the LoRA epilogue (fused == unfused bits, gradients, row invariance), the radix
# top-k, the MoE counting sort, with the layers that call them (project / Linear on the GPU) and the MoE dispatch.
has final3 && step gpu_tests_final3 "${T_FINAL3:-220}" $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs $XDIST \
  tests/kernels/triton/test_matmul.py::test_lora_in_the_epilogue_equals_the_unfused_delta \
  tests/kernels/triton/test_matmul.py::test_lora_epilogue_at_training_rows \
  tests/kernels/triton/test_matmul.py::test_delta_in_the_epilogue_equals_the_sum \
  tests/kernels/triton/test_matmul.py::test_linear_concat_lora_in_the_epilogue \
  tests/kernels/triton/test_matmul.py::test_linear_concat_lora_gradients \
  tests/kernels/triton/test_matmul.py::test_column_block_rows_are_read_in_place \
  tests/kernels/triton/test_dsa_indexer.py tests/kernels/triton/test_moe_router.py tests/kernels/triton/test_static_kv_len.py \
  tests/model/test_moe_dispatch.py tests/model/test_layers.py
# mla_forms: both forms of the sparse MLA kernel (Numerics.mla_mma_rows) under each launch configuration at decode
# 256 x 8K and a 4096-token prefill, then the MLA GPU tests (each under both forms).
# One process per form: the keys form's 16-head, 8-warp, 1-stage launch faulted the device on an H100 (2026-12-05), and a
# fault ends the process, so that form sweeps the other launches.
has mla_forms && step mla_sweep_heads "${T_MLA_FORMS:-100}" $PY benchmarks/mla_dsa_kernels.py --sweep-only --mma-rows heads \
  --out "$OUT/mla_sweep_heads.json"
has mla_forms && step mla_sweep_keys "${T_MLA_FORMS:-100}" $PY benchmarks/mla_dsa_kernels.py --sweep-only --mma-rows keys \
  --sweep-launches "${MLA_KEYS_LAUNCHES:-32x8x2,32x8x3,32x8x1,32x4x2,64x8x1,64x4x1}" --out "$OUT/mla_sweep_keys.json"
has mla_forms && step gpu_tests_mla "${T_MLA_TESTS:-120}" $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs $XDIST \
  tests/kernels/triton/test_mla_attention.py
# mla_keys: the keys form with the query resident in shared memory against the heads form, one machine: the launch
# sweep (bits per form, error vs float64), the MLA GPU tests under both forms, then the decode step (LoRA r = 32, 8K)
# and the 4 x 8192 prefill under each form at its kernel_config launch.
# (heads 32 x 8 x 3: 224 KB of shared memory, no spill in its sm_90 build; 10 % faster than x 2 in the 12-05 sweep)
has mla_keys && step mla_sweep_heads "${T_MLA_FORMS:-100}" $PY benchmarks/mla_dsa_kernels.py --sweep-only --mma-rows heads \
  --sweep-launches "${MLA_HEADS_LAUNCHES:-32x8x2,32x8x3}" --out "$OUT/mla_sweep_heads.json"
has mla_keys && step mla_sweep_keys "${T_MLA_FORMS:-150}" $PY benchmarks/mla_dsa_kernels.py --sweep-only --mma-rows keys \
  --sweep-launches "${MLA_KEYS_LAUNCHES:-32x8x2,32x4x2,64x8x1,16x8x2,16x4x2}" --out "$OUT/mla_sweep_keys.json"
has mla_keys && step mla_keys_stacked "${T_MLA_FORMS:-150}" $PY benchmarks/probes/mla_keys_stacked_probe.py \
  --out "$OUT/mla_keys_stacked.json"
has mla_keys && step gpu_tests_mla "${T_MLA_TESTS:-120}" $PY -m pytest -p no:cacheprovider -q -rfEs $XDIST \
  tests/kernels/triton/test_mla_attention.py tests/kernels/triton/test_static_kv_len.py tests/kernels/test_backward_gemms.py \
  tests/kernels/triton/test_matmul.py::test_lora_gradients_of_a_16bit_output tests/kernels/triton/test_expert_grads.py \
  tests/model/test_moe_dispatch.py
for form in heads keys; do
  has mla_keys && step "decode_lora_$form" "${T_DECODE_LORA:-150}" env ZMRL_MLA_MMA_ROWS=$form $PY benchmarks/decode_throughput.py \
    --batches 64,256 --contexts 8192 --modes graph --lora 32 --profile-ctx 8192 --profile-batches 256 \
    --out "$OUT/decode_lora_$form.json"
done
for form in keys heads; do
  has mla_keys && step "prefill_$form" "${T_PREFILL:-100}" env ZMRL_MLA_MMA_ROWS=$form $PY benchmarks/prefill_throughput.py \
    --shapes 4x8192 --modes bitwise --iters 2 --out "$OUT/prefill_$form.json"
done
# decode_gemms: every GEMM launch of a bitwise decode step at batch 256 and 64 alone (cold L2) against its bytes
# bound and cuBLAS, the groups of the most step time under the SWEEP configs (bits checked)
has decode_gemms && step decode_gemms "${T_DECODE_GEMMS:-300}" $PY benchmarks/decode_gemms.py --sweep "${GEMM_SWEEP_TOP:-14}" \
  --out "$OUT/decode_gemms.json"
# grads16: the backward paths that take 16-bit gradients as they are (LoRA factors, expert LoRA, MoE dispatch) and the
# whole-trainer gradients against float64
has grads16 && step gpu_tests_grads16 "${T_GRADS16:-180}" $PY -m pytest -p no:cacheprovider -p no:xdist -q -rfEs \
  tests/kernels/test_backward_gemms.py tests/kernels/triton/test_matmul.py::test_lora_gradients_of_a_16bit_output \
  tests/model/test_moe_dispatch.py tests/kernels/triton/test_expert_grads.py tests/trainer/test_gradients_gpu.py
has grads_f64 && step gpu_tests_grads_f64 "${T_GRADS_F64:-320}" $PY -m pytest -p no:cacheprovider -p no:xdist -v -rfEs -s \
  --durations=5 tests/trainer/test_gradients_gpu.py
has mla_stages && step mla_sweep_heads_stages "${T_MLA_FORMS:-100}" $PY benchmarks/mla_dsa_kernels.py --sweep-only \
  --mma-rows heads --sweep-launches 32x8x2,32x8x3 --out "$OUT/mla_sweep_heads_stages.json"
# train_gemms: every GEMM launch of one trainer forward at 4 x 4096 tokens, timed in place, against the matmul peak and cuBLAS
has train_gemms && step train_gemms "${T_TRAIN_GEMMS:-200}" $PY benchmarks/train_gemms.py --out "$OUT/train_gemms.json"
# train_gemms_plain: the same launches in the plain launch order (no row-tile bands, ZMRL_GEMM_GROUP_M=1): the baseline of
# the banded order on the same machine
has train_gemms_plain && step train_gemms_plain "${T_TRAIN_GEMMS:-200}" env ZMRL_GEMM_GROUP_M=1 $PY benchmarks/train_gemms.py \
  --out "$OUT/train_gemms_plain.json"
# train_sweep: the same, with the groups of the most time replayed under the training tile configs (bits checked)
has train_sweep && step train_gemms_sweep "${T_TRAIN_SWEEP:-300}" $PY benchmarks/train_gemms.py --sweep "${TRAIN_SWEEP_TOP:-12}" \
  --sweep-budget-s "${TRAIN_SWEEP_BUDGET:-220}" --out "$OUT/train_gemms_sweep.json"
has dsa && step dsa_kernels "${T_DSA:-90}" $PY benchmarks/mla_dsa_kernels.py --dsa-only --out "$OUT/dsa_kernels.json"

has gate_up && step gpu_tests_gate_up "${T_GATE_UP:-150}" $PYTEST tests/kernels/triton/test_expert_gate_up.py \
  tests/kernels/triton/test_moe_gemm_grads_gpu.py::test_gate_up_one_gradient_bench_shapes
has new && step gpu_tests_new 60 $PYTEST tests/kernels/triton/test_lm_head_logprobs_gpu.py tests/kernels/triton/test_moe_gemm_grads_gpu.py

has kda_bwd && step gpu_tests_kda_bwd "${T_KDA_BWD:-220}" $PYTEST -k "H16 or deterministic or path_is_taken" tests/kernels/triton/test_kda_chunk_bwd_gpu.py

has kimi && step kimi_linear_gpu "${T_KIMI:-300}" $PYTEST tests/model/test_kimi_linear_checkpoint.py

has trainer && step trainer_throughput "${T_TRAINER:-200}" $PY benchmarks/trainer_throughput.py --layers 16 --seq-lens 4096,4096,4096,4096 \
  --modes bitwise --recompute "${RECOMPUTE:-none,layer,selective,attention}" --warmup 1 --iters 1 --profile 30 \
  --kda-tokens "${KDA_TOKENS:-8192,32768}" ${TRAINER_ARGS:-} --out "$OUT/trainer_throughput.json"

has rl_step && step rl_step 150 $PY benchmarks/rl_step.py --layers 16 --prompts 8 --n 8 --prompt-len 512 --max-new 512 \
  --micro-batch-tokens 16384 --parity-pass separate,fused --out "$OUT/rl_step.json"

has engine && step gpu_tests_engine "${T_ENGINE:-150}" env ZMRL_TEST_DEVICE=cuda $PY -m pytest -p no:cacheprovider -rA -q \
  tests/rollout/test_graph_runner.py tests/rollout/test_engine.py

has more && step gpu_tests_more "${T_MORE:-150}" $PYTEST tests/kernels/triton/test_mla_attention_grads_gpu.py tests/trainer/test_gradients_gpu.py

# The Triton closed-form backwards of the row-wise ops (rowwise_grads.py), the MLA query split and the MLA
# backward's bf16 stages, with the forwards' own tests, the one-binary KDA test and the whole-trainer gradients
# (> 150 s with 12 xdist workers on a fresh machine, 2026-12-02: the whole-trainer gradient test is the long one).
has newk && step gpu_tests_newk "${T_NEWK:-300}" $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs $XDIST \
  tests/kernels/triton/test_rowwise_grads.py tests/kernels/triton/test_mla_attention.py tests/kernels/triton/test_short_conv.py \
  tests/kernels/triton/test_norms.py tests/kernels/triton/test_glu.py tests/kernels/triton/test_l2norm.py \
  tests/kernels/triton/test_kda_gate.py "tests/kernels/triton/test_kda_decode_step.py::test_one_recurrent_binary_for_every_caller" \
  tests/kernels/triton/test_mla_attention_bwd.py tests/kernels/triton/test_mla_attention_grads_gpu.py tests/trainer/test_gradients_gpu.py

has rowwise && step gpu_tests_rowwise_grads 60 $PYTEST -k grad "tests/kernels/triton/test_kda_chunk.py::test_gradients_match_float64" \
  tests/kernels/triton/test_mla_attention.py tests/kernels/triton/test_norms.py tests/kernels/triton/test_l2norm.py \
  tests/kernels/triton/test_kda_gate.py tests/kernels/triton/test_glu.py tests/kernels/triton/test_short_conv.py

has census && step trainer_op_census "${T_CENSUS:-120}" $PY benchmarks/trainer_op_census.py --device cuda --layers 4 ${CENSUS_ARGS:-} \
  --out "$OUT/trainer_op_census.json"

has rollout && step rollout_profile "${T_ROLLOUT:-150}" $PY benchmarks/rollout_profile.py --layers 16 --prompts 8 --n 8 \
  --prompt-len 512 --max-new 512 --profile-steps 5 ${ROLLOUT_ARGS:-} --out "$OUT/rollout_profile.json"

has matmul && step gpu_tests_matmul "${T_MATMUL:-240}" $PYTEST $XDIST tests/kernels/triton/test_matmul.py \
  tests/kernels/triton/test_gemm_compiles_for_hopper.py tests/kernels/triton/test_moe_gemm_device_offsets.py

has expert_grads && step gpu_tests_expert_grads "${T_EXPERT_GRADS:-200}" $PYTEST tests/kernels/triton/test_expert_grads.py \
  tests/kernels/triton/test_moe_gemm_grads_gpu.py

has lora && step lora_gemms "${T_LORA:-150}" $PY benchmarks/lora_gemms.py --compare-ieee --compare-whole-k \
  --out "$OUT/lora_gemms.json"

has lora_sweep && step lora_sweep "${T_LORA_SWEEP:-240}" $PY benchmarks/lora_gemms.py --ms 1,64,256 --sweep \
  --out "$OUT/lora_sweep.json"

# decode_ab: the same decode benchmark on a baseline tree first (BASE_TREE: a `git archive` of the last measured
# commit, carried with the call), so the two figures come from one machine.
has decode_ab && [ -n "${BASE_TREE:-}" ] && step decode_base "${T_DECODE_LORA:-200}" env PYTHONPATH="$BASE_TREE" \
  $PY "$BASE_TREE/benchmarks/decode_throughput.py" --batches 1,64,256 --contexts 8192 --modes graph --lora 32 \
  --profile-ctx 8192 --profile-batches 1,256 --out "$OUT/decode_base.json"
has decode_ab && step decode_lora "${T_DECODE_LORA:-200}" $PY benchmarks/decode_throughput.py --batches 1,64,256 \
  --contexts 8192 --modes graph --lora 32 --profile-ctx 8192 --profile-batches 1,256 ${DECODE_ARGS:-} --out "$OUT/decode_lora.json"
# launch_cuts: the GPU tests of the kernels that read rows in place and of the one-launch pointwise ops.
has launch_cuts && step gpu_tests_launch_cuts "${T_LAUNCH_CUTS:-200}" $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs $XDIST \
  tests/kernels/triton/test_l2norm.py tests/kernels/triton/test_norms.py tests/kernels/triton/test_short_conv.py \
  tests/kernels/triton/test_pointwise.py tests/kernels/triton/test_moe_router.py tests/kernels/triton/test_kda_decode_step.py \
  tests/kernels/triton/test_mla_attention.py tests/kernels/triton/test_static_kv_len.py tests/kernels/triton/test_rowwise_grads.py \
  tests/kernels/triton/test_glu.py tests/kernels/triton/test_matmul.py tests/kernels/triton/test_model_static_decode.py \
  tests/kernels/triton/test_cache_write.py tests/kernels/triton/test_dsa_indexer.py

has decode_lora && step decode_lora "${T_DECODE_LORA:-200}" $PY benchmarks/decode_throughput.py --batches 1,64,256 \
  --contexts 8192 --modes graph --lora 32 --profile-ctx 8192 --profile-batches 64,256 ${DECODE_ARGS:-} --out "$OUT/decode_lora.json"

# pdl: programmatic dependent launch off (ZMRL_PDL=0) then on, same machine: the graph decode step with LoRA at batch
# 1 / 64 / 256 and 8K (no profile), the prefill, then the GPU tests that replay graphs with it (bits equal to without)
if has pdl; then
  for v in 0 1; do
    step "decode_pdl$v" "${T_DECODE_PDL:-100}" env ZMRL_PDL=$v $PY benchmarks/decode_throughput.py --batches 1,64,256 \
      --contexts 8192 --modes graph --lora 32 --out "$OUT/decode_pdl$v.json"
  done
  for v in 0 1; do
    step "prefill_pdl$v" "${T_PREFILL_PDL:-80}" env ZMRL_PDL=$v $PY benchmarks/prefill_throughput.py ${PREFILL_PDL_ARGS:-} \
      --out "$OUT/prefill_pdl$v.json"
  done
  step gpu_tests_pdl "${T_PDL_TESTS:-150}" env ZMRL_TEST_DEVICE=cuda $PY -m pytest -p no:cacheprovider $XDIST -q -rfEs \
    tests/kernels/triton/test_pdl.py tests/rollout/test_graph_runner.py tests/kernels/triton/test_model_static_decode.py
fi

# final7: the 12-07 session's one call (device time for one): the GPU tests of what changed since the last GPU run
# (programmatic dependent launch, the MLA splits' fused combine under both MLA forms, the delta-first GEMM, graph
# replays), the bench-shape parity, then decode and prefill with both off (the last measured tree's launches) and on,
# and the trainer step
if has final7; then
  step gpu_tests_final7 "${T_FINAL7_TESTS:-200}" env ZMRL_TEST_DEVICE=cuda $PY -m pytest -p no:cacheprovider $XDIST -q -rfEs \
    tests/kernels/triton/test_pdl.py tests/kernels/triton/test_mla_attention.py tests/kernels/triton/test_matmul.py \
    tests/rollout/test_graph_runner.py tests/kernels/triton/test_model_static_decode.py \
    tests/kernels/triton/test_gemm_compiles_for_hopper.py tests/kernels/triton/test_mla_attention_bwd.py \
    tests/kernels/triton/test_mla_attention_grads_gpu.py tests/kernels/test_backward_gemms.py
  step bench_parity "${T_PARITY:-90}" $PY -m pytest -p no:cacheprovider -q -rfEs -m gpu tests/bitwise/test_parity_gpu_bench.py
  # the MLA kernel alone with the key lists walked through the block table in the kernel and as cache slots (same bits)
  # (FINAL7_OPERANDS, e.g. "hi_lo,bf16": also with q and p as bf16 halves and rounded to bf16 once, Numerics.mla_operands)
  [ -n "${FINAL7_MLA_SLOTS:-}" ] && step mla_sweep_slots "${T_MLA_FORMS:-100}" $PY benchmarks/mla_dsa_kernels.py --sweep-only \
    --mma-rows heads --sweep-launches "$FINAL7_MLA_SLOTS" --slot-lists 0,1 --operands "${FINAL7_OPERANDS:-hi_lo}" \
    --out "$OUT/mla_sweep_slots.json"
  for v in ${FINAL7_DECODE:-00 10 11}; do  # ZMRL_PDL, ZMRL_MLA_FUSED_COMBINE, then (optional) ZMRL_MLA_SLOT_LIST
    p=${v:0:1} f=${v:1:1} k=${v:2:1}
    step "decode_pdl${p}_fused$f${k:+_slots$k}" "${T_DECODE_PDL:-60}" env ZMRL_PDL=$p ZMRL_MLA_FUSED_COMBINE=$f \
      ZMRL_MLA_SLOT_LIST=${k:-0} $PY benchmarks/decode_throughput.py --batches 1,64,256 --contexts 8192 --modes graph \
      --lora 32 --profile-ctx 0 --out "$OUT/decode_pdl${p}_fused$f${k:+_slots$k}.json"
  done
  for v in ${FINAL7_PREFILL-0 1}; do  # ZMRL_MLA_FUSED_COMBINE, then (optional) ZMRL_MLA_SLOT_LIST
    f=${v:0:1} k=${v:1:1}
    step "prefill_fused$f${k:+_slots$k}" "${T_PREFILL_PDL:-45}" env ZMRL_MLA_FUSED_COMBINE=$f ZMRL_MLA_SLOT_LIST=${k:-0} \
      $PY benchmarks/prefill_throughput.py --shapes 4x8192 --modes bitwise --iters 2 --out "$OUT/prefill_fused$f${k:+_slots$k}.json"
  done
  step trainer_throughput "${T_TRAINER:-100}" env ZMRL_MLA_SLOT_LIST=${FINAL7_TRAINER_SLOTS:-0} $PY benchmarks/trainer_throughput.py \
    --layers 16 --seq-lens 4096,4096,4096,4096 \
    --modes bitwise --recompute none --warmup 1 --iters 1 --profile 30 --kda-tokens 8192 --backward-precision bf16 \
    --no-kda-old-backward --sync-census --out "$OUT/trainer_throughput.json"
fi

# The KDA decode step vs fla's recurrent step, and its launch / column-block sweep (decode == chunk checked
# per configuration, the chunk forward timed), with the GPU decode tests (every row vs kda_chunk).
has kda_sweep && step kda_decode_sweep "${T_KDA_SWEEP:-200}" $PY benchmarks/kda_decode_vs_fla.py --batches 1 64 256 --sweep --kda-form chunk \
  --out "$OUT/kda_decode_vs_fla.json"
has kda_phases && step kda_decode_phases "${T_KDA_PHASES:-150}" $PY benchmarks/kda_decode_phases.py --batch 256 \
  --out "$OUT/kda_decode_phases.json"
has kda_sweep && step gpu_tests_kda_decode "${T_KDA_DECODE_TESTS:-150}" $PYTEST tests/kernels/triton/test_kda_decode_step.py \
  tests/kernels/triton/test_kda_chunk_step.py

has kda_forms && step kda_forms "${T_KDA_FORMS:-150}" env OUT="$OUT" $PY benchmarks/probes/kda_recurrent_probe.py
has kda_forms && step gpu_tests_kda_mla "${T_KDA_MLA_TESTS:-200}" $PY -m pytest -p no:cacheprovider -m gpu -q -rfEs $XDIST \
  tests/kernels/triton/test_kda_decode_step.py tests/kernels/triton/test_kda_chunk_step.py \
  tests/kernels/triton/test_kda_chunk.py tests/kernels/triton/test_mla_attention.py
has prefill && step prefill "${T_PREFILL:-150}" $PY benchmarks/prefill_throughput.py ${PREFILL_ARGS:-} --out "$OUT/prefill.json"
has prefill_chunk && step prefill_chunk "${T_PREFILL:-150}" env ZMRL_KDA_FORM=chunk $PY benchmarks/prefill_throughput.py \
  --out "$OUT/prefill_chunk.json"

has parity && step bench_parity "${T_PARITY:-240}" $PY -m pytest -p no:cacheprovider -q -rfEs -m gpu \
  tests/bitwise/test_parity_gpu_bench.py

# Would TMA tile loads and persistent programs speed up the training-row GEMMs at the same bits? (probe)
has tma_probe && step gemm_tma_probe "${T_TMA_PROBE:-150}" $PY benchmarks/probes/gemm_tma_probe.py --out "$OUT/gemm_tma_probe.json"

# -v: with xdist a test is named when it finishes, so a run cut by the limit shows which ones were still running
has bitwise && step bitwise_cuda "${T_BITWISE:-420}" env ZMRL_TEST_DEVICE=cuda $PY -m pytest -p no:cacheprovider $XDIST -v -rfEs --durations=25 \
  tests/bitwise -m "not slow and not gpu"

# The RL-shaped batch of the rollout and RL-step benchmarks: 64 prompts x 8 samples, 512-token prompts, <= 1024 new.
RL_SHAPE="--layers 16 --prompts 64 --n 8 --prompt-len 512 --max-new 1024"
has rollout_rl && step rollout_rl "${T_ROLLOUT_RL:-240}" $PY benchmarks/rl_step.py --rollout-only $RL_SHAPE \
  --out "$OUT/rollout_rl.json"

# The same rollout with finer decode-graph batch buckets (a draining rollout pads less; more graphs captured).
has rollout_rl_fine && step rollout_rl_fine "${T_ROLLOUT_RL_FINE:-260}" $PY benchmarks/rl_step.py --rollout-only $RL_SHAPE \
  --graph-batch-sizes "${GRAPH_SIZES:-1,2,4,8,16,32,48,64,96,128,160,192,224}" --out "$OUT/rollout_rl_fine.json"

# The whole RL step at the RL-shaped batch: rollout, one training forward per update (parity log-probs taken
# from it), backward with bf16 operands, optimizer step, weight push.
has rl_full && step rl_full "${T_RL_FULL:-420}" $PY benchmarks/rl_step.py $RL_SHAPE --micro-batch-tokens 16384 --parity-pass fused --backward-precision "${RL_BWD:-bf16}" --out "$OUT/rl_full.json"

# The MLA backward's fp32-output GEMMs (cuBLAS) on the chunk shapes, key counts as they come and padded.
has mla_bwd && step mla_bwd_gemms "${T_MLA_BWD:-150}" $PY benchmarks/mla_bwd_gemms.py --out "$OUT/mla_bwd_gemms.json"

# The invariant GEMM's launch configs at batched-decode sizes (GEMM_SWEEP_ARGS: e.g. --shapes lm_head --ms 128,256).
has gemm_sweep && step gemm_sweep "${T_GEMM_SWEEP:-150}" $PY benchmarks/gemm_invariant_vs_cublas.py --sweep ${GEMM_SWEEP_ARGS:-} \
  --out "$OUT/gemm_sweep.json"

has bwd_bf16 && step gpu_tests_bwd_bf16 "${T_BWD_BF16:-120}" $PYTEST tests/kernels/triton/test_mla_attention_bwd.py \
  tests/kernels/triton/test_mla_attention_grads_gpu.py tests/kernels/triton/test_expert_grads.py

has kda_bwd_small && step gpu_tests_kda_bwd_small 60 $PYTEST -k H4 tests/kernels/triton/test_kda_chunk_bwd_gpu.py

# Keep the autotune choices for the next machine (small JSON files; the compiled kernels are rebuilt).
( cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T - ) \
  && echo "# saved $(tar tzf "$OUT/autotune.tgz" | wc -l) autotune results to $OUT/autotune.tgz"

echo "total seconds=$(( $(date +%s) - START ))" | tee -a "$SUMMARY"
cat "$SUMMARY"
