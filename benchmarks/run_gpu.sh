#!/usr/bin/env bash
# One-shot GPU check: the GPU pytest suite, the bitwise parity suite on CUDA, then the benchmarks.
#
#   benchmarks/run_gpu.sh [STEP|GROUP ...]
#
# Steps (in this order): gpu-tests  gpu-bench-parity  bitwise-cuda  parity-cli  gemm  kda  kda-decode  mla-dsa  decode
#   prefill  trainer  rl-step  rollout
#   and the launch-configuration sweeps (not in `all`): gemm-sweep  mla-sweep  kda-decode-sweep
# Groups: tests = gpu-tests gpu-bench-parity bitwise-cuda parity-cli;
#   bench = gemm kda kda-decode mla-dsa decode prefill trainer rl-step rollout (more than one 10-minute call: run
#   it a few steps at a time, e.g. `run_gpu.sh gemm kda kda-decode mla-dsa`, `run_gpu.sh decode prefill`, ...);
#   sweeps = gemm-sweep mla-sweep kda-decode-sweep;  all (default: tests + bench).
#
# Every step runs under `timeout` (its own limit, cut to what is left of the overall budget
# ZMRL_GPU_BUDGET_S, default 570 s, so one invocation fits a 10-minute command window) and a failing
# or timed-out step does not stop the others. Output goes to "$OUT" (default
# benchmarks/results/gpu_run_<date>): run_gpu.log (every step's output, with headers),
# summary.txt (step, exit status, seconds) and one JSON per benchmark.
#
# Environment: PYTHON (default python), OUT, ZMRL_GPU_BUDGET_S, T_<STEP> per-step limits in
# seconds (T_GPU_TESTS, T_GPU_BENCH_PARITY, T_BITWISE_CUDA, T_PARITY_CLI, T_GEMM, T_KDA, T_KDA_DECODE, T_MLA_DSA,
# T_DECODE, T_PREFILL, T_TRAINER, T_RL_STEP, T_ROLLOUT), plus the ZMRL_GPU_BENCH_* sizes of
# tests/bitwise/test_parity_gpu_bench.py, and DECODE_ARGS / PREFILL_ARGS / TRAINER_ARGS / RL_STEP_ARGS /
# ROLLOUT_ARGS (extra flags, e.g. DECODE_ARGS="--layers 8 --batches 1,64").
set -u

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/gpu_run_$(date -u +%Y-%m-%d)}
mkdir -p "$OUT"
LOG="$OUT/run_gpu.log"
SUMMARY="$OUT/summary.txt"
BUDGET=${ZMRL_GPU_BUDGET_S:-570}
START=$(date +%s)

steps=()
for a in "${@:-all}"; do
  case "$a" in
    all) steps+=(gpu-tests gpu-bench-parity bitwise-cuda parity-cli gemm kda kda-decode mla-dsa decode prefill trainer
                 rl-step rollout) ;;
    tests) steps+=(gpu-tests gpu-bench-parity bitwise-cuda parity-cli) ;;
    bench) steps+=(gemm kda kda-decode mla-dsa decode prefill trainer rl-step rollout) ;;
    sweeps) steps+=(gemm-sweep mla-sweep kda-decode-sweep) ;;
    gpu-tests|gpu-bench-parity|bitwise-cuda|parity-cli|gemm|kda|kda-decode|mla-dsa|decode|prefill|trainer) steps+=("$a") ;;
    rl-step|rollout) steps+=("$a") ;;
    gemm-sweep|mla-sweep|kda-decode-sweep) steps+=("$a") ;;
    *) echo "run_gpu.sh: unknown step '$a' (steps: gpu-tests gpu-bench-parity bitwise-cuda parity-cli gemm kda kda-decode mla-dsa decode prefill trainer rl-step rollout gemm-sweep mla-sweep kda-decode-sweep; groups: tests bench sweeps all)" >&2; exit 2 ;;
  esac
done

{
  echo "# run_gpu.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "# steps: ${steps[*]}; budget ${BUDGET}s; python: $($PY -c 'import sys; print(sys.version.split()[0])' 2>&1)"
  $PY - <<'EOF' 2>&1
import torch
print("# torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
try:
    import triton
    print("# triton", triton.__version__)
except ImportError:
    print("# triton: not installed")
import zmrl.kernels_batch_invariant as k
from zmrl.kernels_batch_invariant.triton import _MODULES
print("# triton kernel modules:", ", ".join(_MODULES) or "(none)")
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
} >"$LOG" 2>&1
printf "%-26s %6s %8s  %s\n" step status seconds note >"$SUMMARY"

# run_step NAME LIMIT CMD...: run CMD under `timeout`, limit cut to the remaining budget.
run_step() {
  local name=$1 limit=$2
  shift 2
  local now left
  now=$(date +%s)
  left=$((BUDGET - (now - START)))
  if [ "$left" -lt 20 ]; then
    printf "%-26s %6s %8s  %s\n" "$name" skip 0 "overall budget used up" >>"$SUMMARY"
    echo -e "\n===== $name: skipped (budget used up)" >>"$LOG"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo -e "\n===== $name (limit ${limit}s): $*" >>"$LOG"
  local t0=$(date +%s)
  STEP_LIMIT=$limit timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local note=""
  [ "$rc" -eq 124 ] && note="timed out"
  [ "$rc" -eq 5 ] && note="no tests collected"
  printf "%-26s %6s %8s  %s\n" "$name" "$rc" "$dt" "$note" >>"$SUMMARY"
  echo "===== $name: exit $rc after ${dt}s $note" >>"$LOG"
}

# Benchmarks written by others: pass --out if the script takes it.
external_bench() {
  local name=$1 script=$2 limit=$3
  if [ ! -f "$script" ]; then
    printf "%-26s %6s %8s  %s\n" "$name" skip 0 "$script not present" >>"$SUMMARY"
    echo -e "\n===== $name: $script not present, skipped" >>"$LOG"
    return
  fi
  if timeout 60 $PY "$script" --help 2>/dev/null | grep -q -- "--out"; then
    run_step "$name" "$limit" $PY "$script" --out "$OUT/$name.json"
  else
    run_step "$name" "$limit" $PY "$script"
  fi
}

budget_flag() {  # internal time budget of a benchmark: its limit minus a margin for writing the JSON
  local limit=$1
  echo $((limit > 60 ? limit - 40 : limit / 2))
}

for s in "${steps[@]}"; do
  case "$s" in
    gpu-tests)
      run_step gpu-tests "${T_GPU_TESTS:-150}" $PY -m pytest -q -m gpu tests -rfEs -p no:cacheprovider \
        --ignore tests/bitwise/test_parity_gpu_bench.py ;;
    gpu-bench-parity)  # sizes: ZMRL_GPU_BENCH_* (see the test's docstring)
      run_step gpu-bench-parity "${T_GPU_BENCH_PARITY:-180}" $PY -m pytest -q -m gpu \
        tests/bitwise/test_parity_gpu_bench.py -rfEs -p no:cacheprovider -o log_cli=true --log-cli-level=INFO ;;
    bitwise-cuda)
      run_step bitwise-cuda "${T_BITWISE_CUDA:-190}" env ZMRL_TEST_DEVICE=cuda $PY -m pytest -q tests/bitwise \
        -m "not slow and not gpu" -rfEs -p no:cacheprovider ;;
    parity-cli)
      # zmrl parity on CUDA in both kernel modes: bitwise must PASS (its exit status is the step's);
      # fast is expected to FAIL, the report shows by how much
      run_step parity-cli "${T_PARITY_CLI:-50}" bash -c "$PY -m zmrl parity --device cuda --scenario all --steps 1 \
        --num-requests 8; rc=\$?; echo '--- fast mode (parity not expected):'; $PY -m zmrl parity --device cuda \
        --scenario all --steps 0 --num-requests 8 --kernel-mode fast; exit \$rc" ;;
    gemm)
      external_bench gemm_invariant_vs_cublas benchmarks/gemm_invariant_vs_cublas.py "${T_GEMM:-90}" ;;
    kda)
      external_bench kda_vs_fla benchmarks/kda_vs_fla.py "${T_KDA:-90}" ;;
    kda-decode)  # the KDA decode step vs fla-core's fused_recurrent_kda at batch 1, 64, 256
      run_step kda-decode "${T_KDA_DECODE:-60}" $PY benchmarks/kda_decode_vs_fla.py --batches 1 64 256 \
        --out "$OUT/kda_decode_vs_fla.json" ;;
    mla-dsa)  # sparse MLA decode/prefill kernels; DSA top-k vs torch.topk at 8K-32K
      run_step mla-dsa "${T_MLA_DSA:-80}" $PY benchmarks/mla_dsa_kernels.py --quick --out "$OUT/mla_dsa.json" ;;
    decode)
      t=${T_DECODE:-180}
      run_step decode "$t" $PY benchmarks/decode_throughput.py --out "$OUT/decode_throughput.json" \
        --time-budget-s "$(budget_flag "$t")" ${DECODE_ARGS:-} ;;
    prefill)
      t=${T_PREFILL:-100}
      run_step prefill "$t" $PY benchmarks/prefill_throughput.py --out "$OUT/prefill_throughput.json" \
        --time-budget-s "$(budget_flag "$t")" ${PREFILL_ARGS:-} ;;
    gemm-sweep)  # candidate tiles per shape at M = 128, 256 (batched decode) and 4096
      run_step gemm-sweep "${T_GEMM_SWEEP:-200}" $PY benchmarks/gemm_invariant_vs_cublas.py --ms 1,64,128,256 --sweep \
        --out "$OUT/gemm_sweep.json" ;;
    mla-sweep)  # sparse-MLA heads per program / warps / stages at batch 256, 8K; DSA top-k vs torch.topk
      run_step mla-sweep "${T_MLA_SWEEP:-100}" $PY benchmarks/mla_dsa_kernels.py --quick --sweep --out "$OUT/mla_dsa.json" ;;
    kda-decode-sweep)  # KDA decode step vs fla at batch 1, 64, 256; launch configs at 256 with a same-bits check
      run_step kda-decode-sweep "${T_KDA_DECODE_SWEEP:-80}" $PY benchmarks/kda_decode_vs_fla.py --batches 1 64 256 --sweep --kda-form chunk \
        --out "$OUT/kda_decode_vs_fla.json" ;;
    trainer)
      run_step trainer "${T_TRAINER:-100}" $PY benchmarks/trainer_throughput.py --out "$OUT/trainer_throughput.json" \
        ${TRAINER_ARGS:-} ;;
    rl-step)  # one RL step on one GPU at the RL-shaped batch (64 prompts x n=8, <= 1024 new tokens), phase by phase,
      # one training forward per update, bf16 backward operands; ~320 s with its warm-up step. RL_STEP_ARGS to change,
      # e.g. "--prompts 8 --n 8 --max-new 512 --parity-pass separate,fused" for the separate parity pass's cost.
      run_step rl-step "${T_RL_STEP:-420}" $PY benchmarks/rl_step.py --out "$OUT/rl_step.json" \
        ${RL_STEP_ARGS:---parity-pass fused --backward-precision bf16} ;;
    rollout)  # the RL-shaped rollout alone: 64 prompts x n=8, prompt 512, up to 1024 new tokens
      run_step rollout "${T_ROLLOUT:-300}" $PY benchmarks/rl_step.py --rollout-only --out "$OUT/rollout.json" \
        ${ROLLOUT_ARGS:-} ;;
  esac
done

echo -e "\n===== summary" >>"$LOG"
cat "$SUMMARY" >>"$LOG"
cat "$SUMMARY"
echo "logs and results in $OUT"
