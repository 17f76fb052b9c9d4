#!/usr/bin/env bash
# Issue #21 item 2: the 8-bit decode-attention variants in one device call, Nsight Compute on the fastest of each,
# then the whole decode step with each K/V cache (figures in docs/benchmarks.md).
#   bash tools/gpu/run_attention_variants.sh     # from the repo root; results in $OUT
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:tools/gpu
OUT=${OUT:-/tmp/hpcrl-gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/variants.log"
CONFIGS=${CONFIGS:-"32,2,2;32,2,3;32,2,4;32,4,2;32,4,3;32,4,4;64,2,3;64,4,2;64,4,3;64,4,4;64,8,3;128,4,2;128,8,2"}
timeout 420 python3 tools/gpu/attention_kv8_variants.py --configs "$CONFIGS" ${ONLY:+--only $ONLY} 2>&1 | tee -a "$OUT/variants.log"
NCU="ncu --clock-control none -k regex:_decode_attention_kernel|_attn_kt_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy
  --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis"
for v in engine engine_kfirst k_first; do  # Nsight Compute's duration of each at its fastest config in the sweep
  cfg=$(grep -E "^\| $v \| [a-z0-9_]+ \| [0-9]" "$OUT/variants.log" | sort -t'|' -k5 -g | head -1 | cut -d'|' -f4 | tr -d ' ')
  [[ -n $cfg ]] && timeout 60 $NCU python3 tools/gpu/attention_kv8_variants.py --only $v --configs "$cfg" --copies 1 \
    > "$OUT/ncu_$v.txt" 2>&1
done
grep -E "^ *(Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Waves Per SM)" \
  "$OUT"/ncu_*.txt | cut -c1-160
# The whole decode step with each cache: graph replay, the engine's loop body, and a kernel table.
for cache in fp8_e4m3 auto; do
  mkdir -p "$OUT/step_$cache"
  timeout 150 python3 tools/gpu/decode_microbench.py --kv-cache-dtype $cache --out "$OUT/step_$cache" \
    --sections prefill,graph_forward,full_steps,profile 2>&1 | tail -32 | tee -a "$OUT/variants.log"
done
