#!/usr/bin/env bash
# True on-policy on the GPU, the trainer's MFU levers and the orchestration overhead in one run on one
# H200, Qwen3-0.6B shape (random weights), bf16. From the repo root; results go to $OUT:
#   bash tools/gpu/run_gpuprep.sh
# Parts, in order of importance, each under its own `timeout`: 575 s at most in all, the three on-policy parts
# 240 s of it, the MFU part 260 s (one call may run 600 s; `PARTS="price mfu overhead"` takes 400 s at most):
#   bits     (70 s)  engine-sampled vs trainer log-probs bitwise at batch 1, 7, 64; alone vs full batch;
#                    prefill vs decode; bf16 then fp32; the plain engine's gap for contrast (onpolicy_gpu.py)
#   run     (105 s)  10 colocated `hpcrl run` steps, engine.batch_invariant=true train.logprobs=invariant: gap per step
#   price    (65 s)  engine decode tok/s and trainer step time, invariant vs plain (invariant_price.py)
#   mfu     (260 s)  trainer MFU at 8 x 2048 tokens: torch vs +head (fused log-prob head), +mb8, +compile
#   overhead (75 s)  colocated GRPO step minus the sum of its phases (step_time.py)
# A part that fails or times out does not stop the next. Summary lines start with "onpolicy:", "mfu:",
# "price " and "overhead:"; they are collected at the end of gpuprep.log. Files in $OUT (at most 8, flat):
# gpuprep.log, onpolicy_gpu.json, onpolicy_run.log, mfu.json, step_time.json.
# PARTS="bits run" runs a subset. GPUPREP_CPU_CHECK=1 runs every part on the CPU with tiny sizes, to check
# the scripts themselves before spending GPU time (the figures mean nothing there).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/hpcrl-gpu-out}
WORK=${WORK:-/tmp/hpcrl-gpuprep}
PY=${PY:-python3}
PARTS=${PARTS:-"bits run price mfu overhead"}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/gpuprep.log"
if [[ ${GPUPREP_CPU_CHECK:-0} == 1 ]]; then
  export OMP_NUM_THREADS=1
  ON=(--device cpu --shape tiny --max-new-tokens 6 --workdir "$WORK/onpolicy" --out "$OUT")
  RUN_ARGS=(--steps 2 --run-timeout-s 85)
  PRICE_ARGS=(--price-seqs 8 --repeats 1)
  MFU=(--shape tiny --device cpu --dtype float32 --batch 2 --seq-len 96 --micro-batch 1 --steps 3
       --backends torch torch+head torch+head+mb2)
  STEP=(--steps 5 --threads 1 --device cpu --dtype float32)
else
  ON=(--device cuda --dtype bfloat16 --shape qwen3-0.6b --workdir "$WORK/onpolicy" --out "$OUT")
  RUN_ARGS=(--steps 10 --max-new-tokens 16 --run-timeout-s 85)
  PRICE_ARGS=(--price-seqs 64 --repeats 2)
  MFU=(--shape qwen3-0.6b --device cuda --dtype bfloat16 --batch 8 --seq-len 2048 --micro-batch 4 --steps 5
       --backends torch torch+head torch+head+mb8 torch+head+compile+mb8)
  STEP=(--steps 10 --threads 4 --device cuda --dtype bfloat16 --shape qwen3-0.6b --colocate)
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,temperature.gpu --format=csv 2>&1 || true
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$LOG"
part() {  # part NAME TIMEOUT_S CMD...: one bounded part, its output into the log
  local name=$1 limit=$2
  shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  echo "=== $name (timeout ${limit} s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v "Loading weights\|Writing model" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([[ $rc == 124 ]] && echo ' (TIMED OUT)')" | tee -a "$LOG"
}
part bits 70 $PY tools/gpu/onpolicy_gpu.py --section bits "${ON[@]}"
part run 105 $PY tools/gpu/onpolicy_gpu.py --section run "${ON[@]}" "${RUN_ARGS[@]}"
part price 65 $PY tools/gpu/onpolicy_gpu.py --section price "${ON[@]}" "${PRICE_ARGS[@]}"
part mfu 260 $PY tools/bench/megatron_train.py "${MFU[@]}" --timeout-s 110 --json "$OUT/mfu.json"
part overhead 75 $PY tools/bench/step_time.py "${STEP[@]}" --no-baseline --quiet --json "$OUT/step_time.json"
echo "=== summary" | tee -a "$LOG"
grep -E "^(onpolicy:|mfu:|price |overhead:|=== [a-z]+: exit)" "$LOG" | grep -v "^=== summary" | tee -a "$LOG.summary"
cat "$LOG.summary" >> "$LOG" && rm -f "$LOG.summary"
ls -la "$OUT"
