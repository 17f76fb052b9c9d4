#!/usr/bin/env bash
# The Megatron backend's GPU measurements in one run (figures in benchmarks/megatron_h200_2026-12.md):
#   bash tools/gpu/run_megatron_gpu.sh     # from the repo root, with .whl/ holding megatron-core 0.19.x (py3.12)
# 0. the backend's CPU tests under megatron-core 0.19 (the version a Python 3.12 cluster installs)
# 1. Megatron forward vs transformers, Qwen3-0.6B shape, fp32
# 2. train throughput and MFU at 8 x 2048, bf16, Megatron vs the torch backend
# mfu. (STEPS=mfu) the MFU levers (fused head, compiled layers, micro-batch 8) on megatron vs the torch backend
# 3. the GRPO loop with the Megatron trainer, then the torch trainer (colocated engine): step time and the
#    train/rollout log-prob gap
# moe. (STEPS=moe) a reduced Qwen3-30B-A3B (4 layers, 128 experts, top-8) trained by the Megatron backend with
#    expert parallelism 1 in bf16: step seconds and the log-prob gap with and without routing replay
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/hpcrl-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core-*.whl
export PYTHONPATH=/tmp/site:$PWD  # absolute: tests start subprocesses in other directories
STEPS=${STEPS:-"tests forward bench loop"}
python3 -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)" 2>&1 | tee "$OUT/megatron.log"
if [[ $STEPS == *tests* ]]; then
  echo "=== CPU tests of the backend under this megatron-core" | tee -a "$OUT/megatron.log"
  OMP_NUM_THREADS=2 timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_megatron.py tests/unit/test_megatron_moe.py -k "not killed" --tb=short 2>&1 | grep -v Warning | tail -40 | tee -a "$OUT/megatron.log"
fi
if [[ $STEPS == *forward* ]]; then
  echo "=== forward equality" | tee -a "$OUT/megatron.log"
  timeout 120 python3 tools/gpu/megatron_forward.py 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/megatron.log"
fi
if [[ $STEPS == *bench* ]]; then
  echo "=== throughput" | tee -a "$OUT/megatron.log"
  for mb in ${MICRO_BATCHES:-4 8}; do
    timeout 240 python3 tools/bench/megatron_train.py --batch 8 --seq-len 2048 --micro-batch $mb --steps 6 2>&1 \
      | grep -v Warning | tail -6 | tee -a "$OUT/megatron.log"
  done
fi
if [[ $STEPS == *mfu* ]]; then
  # the torch backend's MFU levers on megatron-core's layers (benchmarks/megatron_h200_2026-12.md)
  echo "=== MFU levers on the Megatron backend" | tee -a "$OUT/megatron.log"
  timeout 420 python3 tools/bench/megatron_train.py --batch 8 --seq-len 2048 --micro-batch 4 --steps 6 \
    --backends megatron megatron+head+compile+mb8 torch+head+compile+mb8 ${MFU_EXTRA:-} --timeout-s 150 \
    --json "$OUT/mfu_megatron.json" 2>&1 | grep -v Warning | tail -12 | tee -a "$OUT/megatron.log"
fi
if [[ $STEPS == *loop* ]]; then
  echo "=== GRPO loop, Megatron trainer" | tee -a "$OUT/megatron.log"
  for backend in megatron torch; do
    timeout 200 python3 tools/bench/step_time.py --shape qwen3-0.6b --device cuda --dtype bfloat16 --colocate \
      --backend $backend --steps 8 --threads 4 --no-baseline 2>&1 | grep -E "abs_diff|^\| [a-z]" | tee -a "$OUT/megatron.log"
  done
fi
if [[ $STEPS == *moe* ]]; then
  echo "=== Qwen3-MoE on the Megatron backend, EP=1, bf16" | tee -a "$OUT/megatron.log"
  timeout 540 python3 tools/gpu/megatron_moe_gpu.py --out "$OUT/megatron_moe" --steps 4 --layers ${MOE_LAYERS:-4} 2>&1 \
    | grep -v Warning | tail -12 | tee -a "$OUT/megatron.log"
fi
