#!/usr/bin/env bash
# The embedded engine's GPU measurements in one run (see benchmarks/decode_h200_2026-12.md):
#   bash tools/gpu/run_engine_gpu.sh            # from the repo root; results go to $OUT
# 1. decode microbenchmark (ceilings, eager vs fused vs graph, sampler, attention configs, profile)
# 2. throughput: engine vs transformers generate, Qwen3-0.6B shape, bf16, 256 seqs x 512 new tokens
# 3. CUDA weight handover from another process, memory release/resume (torch and NVML)
# 4. the CUDA engine tests (tests/gpu)
# Sections are independent: one failing does not stop the next.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/hpcrl-gpu-out}
mkdir -p "$OUT" /tmp/hpcrl-gpu
STEPS=${STEPS:-"micro bench ablation handover tests"}
{
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/all.log"
ENGINE_ARGS=(--engine-arg=--decode-profile)
if [[ $STEPS == *micro* ]]; then
  echo "=== decode microbenchmark" | tee -a "$OUT/all.log"
  timeout 300 python3 tools/gpu/decode_microbench.py --out /tmp/hpcrl-gpu --sections "${MICRO_SECTIONS:-all}" 2>&1 \
    | tee -a "$OUT/all.log"
  cp /tmp/hpcrl-gpu/microbench.json "$OUT/" 2>/dev/null
fi
if [[ -f /tmp/hpcrl-gpu/best_attn_config.txt ]]; then
  ENGINE_ARGS+=("--engine-arg=--kernels-attn-config=$(cat /tmp/hpcrl-gpu/best_attn_config.txt)")
fi
if [[ -f /tmp/hpcrl-gpu/best_sample_config.txt ]]; then
  ENGINE_ARGS+=("--engine-arg=--kernels-sample-config=$(cat /tmp/hpcrl-gpu/best_sample_config.txt)")
fi
if [[ $STEPS == *bench* ]]; then
  echo "=== throughput: engine vs generate (${ENGINE_ARGS[*]})" | tee -a "$OUT/all.log"
  timeout 480 python3 tools/bench/engine_throughput.py --init-qwen3-0.6b-shape --device cuda --dtype bfloat16 \
    --num-seqs 256 --prompt-len 128 --max-new-tokens 512 "${ENGINE_ARGS[@]}" ${BENCH_ARGS:-} \
    --workdir /tmp/hpcrl-gpu/bench --json-out "$OUT/bench.json" 2>&1 | tee -a "$OUT/all.log"
  cp /tmp/hpcrl-gpu/bench/embedded.log "$OUT/engine_bench.log" 2>/dev/null
fi
if [[ $STEPS == *ablation* ]]; then
  echo "=== engine only, eager decode path (the path before the fused kernels)" | tee -a "$OUT/all.log"
  timeout 300 python3 tools/bench/engine_throughput.py --model /tmp/hpcrl-gpu/bench/qwen3-0.6b-shape --device cuda \
    --dtype bfloat16 --num-seqs 256 --prompt-len 128 --max-new-tokens 512 --skip-generate --warmup-runs 0 \
    --engine-arg=--decode-mode=eager --engine-arg=--decode-profile \
    --workdir /tmp/hpcrl-gpu/eager --json-out "$OUT/bench_eager.json" 2>&1 | tee -a "$OUT/all.log"
fi
if [[ $STEPS == *handover* ]]; then
  echo "=== CUDA weight handover and memory release/resume" | tee -a "$OUT/all.log"
  MODEL_ARG=()
  [[ -d /tmp/hpcrl-gpu/bench/qwen3-0.6b-shape ]] && MODEL_ARG=(--model /tmp/hpcrl-gpu/bench/qwen3-0.6b-shape)
  timeout 300 python3 tools/gpu/handover_memory.py "${MODEL_ARG[@]}" --out /tmp/hpcrl-gpu 2>&1 | tee -a "$OUT/all.log"
  cp /tmp/hpcrl-gpu/handover_memory.json /tmp/hpcrl-gpu/engine_handover.log "$OUT/" 2>/dev/null
fi
if [[ $STEPS == *tests* ]]; then
  echo "=== tests/gpu" | tee -a "$OUT/all.log"
  timeout 300 python3 -m pytest ${TEST_PATHS:-tests/gpu} -q -x -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/all.log"
fi
