#!/usr/bin/env bash
# Trainer-speed GPU run (issue 13), one H200, about 8 minutes:
#   1. GPU tests of the new backwards: KDA via fla-core (vs float64, fla's own error side by side,
#      determinism, fla path taken), the closed-form backwards of the row-wise ops and the MLA
#      backward (Triton forwards + new backwards vs float64), the KDA fallback path;
#   2. benchmarks/trainer_throughput.py at bench size (16 layers, 4 x 4096 tokens): fwd+bwd per
#      recompute policy with MFU and peak memory, then the KDA layer vs fla chunk_kda at T = 8K, 32K;
#   3. benchmarks/rl_step.py, reduced RL batch (8 prompts x n=8, prompt 512, 128..512 new tokens):
#      phase breakdown with and without the separate parity forward, log-prob parity checked.
#
#   OUT=/some/dir bash benchmarks/gpu_i13.sh
#
# Needs torch + triton with CUDA, and fla-core (+ einops) importable: wheels in .whl/ are installed
# (no index, no deps) when fla is missing. Each step has its own time limit; a failing step does not
# stop the next ones. Logs and JSON go to $OUT (default benchmarks/results/gpu_i13_<date>).
set -u
set -o pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/gpu_i13_$(date -u +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

if ! $PY -c "import fla.ops.kda, einops" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tee "$OUT/pip.log"
fi
{
  echo "# gpu_i13.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  $PY -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  $PY -c "import fla; print('# fla-core', getattr(fla, '__version__', '?'))" || echo "# fla-core NOT importable: KDA backward falls back to the torch composition"
} 2>&1 | tee "$OUT/env.log"

step() {  # step NAME LIMIT_S CMD... : run with a time limit, log to $OUT/NAME.log, record status
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - t0 ))" | tee -a "$SUMMARY"
}

step gpu_tests_new 100 $PY -m pytest -q -p no:cacheprovider -m gpu -s \
  tests/kernels/triton/test_kda_chunk_bwd_gpu.py tests/kernels/triton/test_mla_attention_grads_gpu.py \
  tests/trainer/test_gradients_gpu.py

step gpu_tests_grads 60 $PY -m pytest -q -p no:cacheprovider -m gpu -k grad \
  "tests/kernels/triton/test_kda_chunk.py::test_gradients_match_float64" tests/kernels/triton/test_mla_attention.py \
  tests/kernels/triton/test_norms.py tests/kernels/triton/test_l2norm.py tests/kernels/triton/test_kda_gate.py \
  tests/kernels/triton/test_glu.py tests/kernels/triton/test_short_conv.py

step trainer_throughput 190 $PY benchmarks/trainer_throughput.py --layers 16 --seq-lens 4096,4096,4096,4096 \
  --modes bitwise --recompute none,layer,selective,attention --warmup 1 --iters 1 --profile 30 --kda-tokens 8192,32768 \
  --out "$OUT/trainer_throughput.json"

step rl_step 140 $PY benchmarks/rl_step.py --layers 16 --prompts 8 --n 8 --prompt-len 512 --max-new 512 \
  --micro-batch-tokens 16384 --parity-pass separate,fused --out "$OUT/rl_step.json"

cp -f "$OUT"/*.json benchmarks/results/ 2>/dev/null || true
cat "$SUMMARY"
