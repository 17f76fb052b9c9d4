#!/usr/bin/env bash
# Everything that needs two GPUs of one host (nvidia-h200-x2), in one run (
# figures in benchmarks/weight-push_h200x2_2026-12.md):
#   bash tools/gpu/run_two_gpus.sh     # from the repo root, with .whl/ holding megatron-core 0.19.x (py3.12)
# STEPS picks a subset: megatron (tests/gpu/test_megatron_gpus.py: distributed optimizer vs local, TP=2 vs
# TP=1, resume), fault (tests/gpu/test_fleet_gpus.py: SIGKILL an engine mid NCCL push), push
# (tools/gpu/push_two_gpus.py: NCCL push vs a plain broadcast), tp2loop (the 0.6B GRPO loop, Megatron
# trainer with TP=2 over both GPUs vs TP=1).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/hpcrl-gpu-out}
mkdir -p "$OUT"
LOG=$OUT/two_gpus.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core-*.whl
export PYTHONPATH=/tmp/site:$PWD  # absolute: tests start hpcrl runs in other directories
STEPS=${STEPS:-"megatron fault push tp2loop"}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$LOG"
python3 -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$LOG"
if [[ $STEPS == *megatron* ]]; then
  echo "=== Megatron on two GPUs" | tee -a "$LOG"
  timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_gpus.py --tb=short ${MEGATRON_K:-} \
    > "$OUT/megatron_tests.log" 2>&1
  grep -E "max \||passed|failed|Error|^E " "$OUT/megatron_tests.log" | tail -30 | tee -a "$LOG"
fi
if [[ $STEPS == *fault* ]]; then
  echo "=== SIGKILL during an NCCL push" | tee -a "$LOG"
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fleet_gpus.py --tb=short \
    > "$OUT/fault_test.log" 2>&1
  grep -E "SIGKILL|passed|failed|Error|^E " "$OUT/fault_test.log" | tail -30 | tee -a "$LOG"
fi
if [[ $STEPS == *push* ]]; then
  echo "=== NCCL weight push, GPU 0 -> GPU 1" | tee -a "$LOG"
  for shape in ${SHAPES:-qwen3-0.6b qwen3-4b}; do
    timeout 300 python3 tools/gpu/push_two_gpus.py --out "$OUT" --shape $shape ${PUSH_ARGS:-} 2>&1 \
      | grep -v -i warn | tail -14 | tee -a "$LOG"
  done
fi
if [[ $STEPS == *tp2loop* ]]; then
  echo "=== GRPO loop, Qwen3-0.6B shape, bf16, Megatron TP=1 then TP=2 (trainer ranks on GPUs 0 and 1)" | tee -a "$LOG"
  for tp in ${TPS:-1 2}; do
    timeout 300 python3 tools/bench/step_time.py --shape qwen3-0.6b --device cuda --dtype bfloat16 --colocate \
      --backend megatron --steps 6 --threads 4 --no-baseline --quiet \
      --set train.num_ranks=$tp --set train.tensor_parallel_size=$tp 2>&1 \
      > "$OUT/tp${tp}_loop.log" 2>&1
    grep -E "abs_diff|^step 0|^\| [a-z]|Error|exited" "$OUT/tp${tp}_loop.log" | tee -a "$LOG"
  done
fi
