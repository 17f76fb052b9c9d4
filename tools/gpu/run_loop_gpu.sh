#!/usr/bin/env bash
# The GRPO loop's GPU measurements in one run (figures in benchmarks/grpo-step_h200_2026-12.md):
#   bash tools/gpu/run_loop_gpu.sh        # from the repo root; results go to $OUT
# 1. one GRPO step of the Qwen3-0.6B shape in bf16, colocated on one GPU (engine + trainer, CUDA IPC
#    weight push), median over steps, against the transformers in-process baseline
# 2. true on-policy on CUDA, tiny model (a few steps, train_rollout_logprob_abs_diff must be 0; the 0.6B shape
#    and the bitwise checks are in tools/gpu/run_gpuprep.sh)
# 3. the thermal guard on the real GPU (tools/gpu/guard_nvml.py)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/hpcrl-gpu-out}
mkdir -p "$OUT"
STEPS=${STEPS:-"step onpolicy guard"}
nvidia-smi --query-gpu=name,memory.used,memory.total,temperature.gpu --format=csv 2>&1 | tee "$OUT/loop.log"
if [[ $STEPS == *step* ]]; then
  echo "=== GRPO step, Qwen3-0.6B shape, bf16, colocated" | tee -a "$OUT/loop.log"
  timeout 300 python3 tools/bench/step_time.py --shape qwen3-0.6b --device cuda --dtype bfloat16 --colocate \
    --steps 10 --threads 4 --quiet 2>&1 | grep -v "Loading weights\|Writing model" | tee -a "$OUT/loop.log"
fi
if [[ $STEPS == *onpolicy* ]]; then
  echo "=== on-policy mode on CUDA (tiny model)" | tee -a "$OUT/loop.log"
  rm -rf /tmp/hpcrl-onpolicy
  timeout 120 python3 -m hpcrl.cli run experiments/quickstart.yaml num_steps=4 sft.num_steps=20 \
    model.path=/tmp/hpcrl-onpolicy-model engine.device=cuda train.device=cuda engine.batch_invariant=true \
    train.logprobs=invariant guard.mode=off --run-dir /tmp/hpcrl-onpolicy 2>&1 | tail -6 | tee -a "$OUT/loop.log"
  python3 -c "
from hpcrl.store import load_metrics
m = load_metrics('/tmp/hpcrl-onpolicy/metrics.h5')
print('cuda on-policy train_rollout_logprob_abs_diff per step:', m['train/train_rollout_logprob_abs_diff'].tolist())
" 2>&1 | tee -a "$OUT/loop.log"
fi
if [[ $STEPS == *guard* ]]; then
  echo "=== thermal guard" | tee -a "$OUT/loop.log"
  timeout 280 python3 tools/gpu/guard_nvml.py --out "$OUT" 2>&1 | tail -40 | tee -a "$OUT/loop.log"
fi
