#!/usr/bin/env bash
# The invariant GEMM's tile config (issue #17's price): engine decode tok/s and trainer forward, invariant vs
# plain, for each HPCRL_INVARIANT_MATMUL="bm,bn,bk,warps,stages" given (Qwen3-0.6B shape, bf16, one H200):
#   bash tools/gpu/invariant_gemm_sweep.sh "64,64,64,4,3" "16,64,64,4,3" ...
# Any fixed config keeps the forward batch-invariant (it never depends on M); this picks the fastest.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
for cfg in "$@"; do
  echo "=== HPCRL_INVARIANT_MATMUL=$cfg"
  HPCRL_INVARIANT_MATMUL=$cfg timeout 120 python3 tools/bench/invariant_price.py --device cuda --dtype bfloat16 \
    --shapes qwen3-0.6b --num-seqs 64 --max-new-tokens 24 --prompt-len 32 --micro-batch 16 --repeats 2 \
    --threads 4 2>&1 | grep -E "^price |tok/s|trainer forward"
done
