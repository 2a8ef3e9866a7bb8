#!/usr/bin/env bash
# TP parity + throughput on 2 GPUs (NCCL): TP=1 and TP=2 at V=2 (must be bitwise equal), TP=2 with a
# plain all-reduce (the Megatron baseline: cost reference, not expected equal) and TP=1 at V=1 (the
# unsharded model: what virtual shards cost at TP=1). Then the comparison table.
#
#   benchmarks/tp_parity.sh [OUT_DIR] [extra `run` flags, e.g. --layers 8 --num-prompts 16]
#
# Every run is capped by `timeout` (T_RUN seconds, default 100, so the whole script fits 10 minutes). PYTHON defaults to python.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-benchmarks/results/tp_parity_$(date -u +%Y-%m-%d)}
shift || true
T_RUN=${T_RUN:-100}
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
mkdir -p "$OUT"
status=0
run() {  # nproc, flags...
  local n=$1; shift
  echo "=== torchrun --nproc-per-node $n tp_parity.py run $*"
  timeout "$T_RUN" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
    benchmarks/tp_parity.py run --out-dir "$OUT" "$@" || { echo "run failed or timed out: $*"; status=1; }
}
run 1 --tp 1 --virtual-shards 2 "$@"
run 2 --tp 2 --virtual-shards 2 "$@"
run 2 --tp 2 --ep 2 --virtual-shards 2 "$@"
run 2 --tp 2 --virtual-shards 2 --reduce allreduce "$@"
run 1 --tp 1 --virtual-shards 1 "$@"
"$PY" benchmarks/tp_parity.py compare --out-dir "$OUT" || status=1
exit $status
