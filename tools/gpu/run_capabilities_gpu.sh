#!/usr/bin/env bash
# The GPU runs of the LoRA, MoE, disk-delta, distillation and FSDP2 capabilities, on one H100/H200, from the repo
# root with .sglang/ (docs/sglang.md) beside it:
#   SECTIONS="record fsdp lora" bash tools/gpu/run_capabilities_gpu.sh
# record: the SGLang 0.5.16 recorders of tools/gpu/record_sglang_{disk,lora,moe,distill}.py at once (each starts
#         its own small server); their cases come back in $OUT/golden.tgz, one folder per topic, for
#         tests/golden/sglang-0.5.16/<topic>/
# fsdp:   tools/gpu/fsdp_mfu.py: the Qwen3-4B shape (DDP against FSDP2, with and without activation checkpointing,
#         defaults against every lever), then the Qwen3-8B shape that DDP cannot hold, with FSDP2 + offload
# lora, moe, delta, opd: tools/gpu/{lora,moe,delta,opd}_gpu.py --out $OUT/<section> $LORA_ARGS (MOE_ARGS, ...)
# moeprof: tools/gpu/moe_decode_profile.py after moe (on the model moe_gpu.py built)
# pytest: pytest tests/gpu $PYTEST_ARGS (default: all of tests/gpu), bounded by SECTION_S
# RECORD_S and SECTION_S (default 400 each) bound the recorders and those scripts; RECORD_TOPICS picks recorders.
# Sections run at once where they can share the GPU (the recorders' servers are tiny); fsdp's timings are the
# GPU's share left by the others, which the report states. Everything lands in $OUT/results.tgz and $OUT/summary.log.
set -u
OUT=${OUT:-/tmp/hpcrl-capabilities-out}
WORK=/tmp/hpcrl-cap
SECTIONS=${SECTIONS:-"record fsdp"}
mkdir -p "$OUT" "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2> /dev/null
source .sglang/activate.sh .sglang/sglang-site.tar.xz > /dev/null 2>&1
export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.log"
pids=()
if [[ $SECTIONS == *record* ]]; then
  for topic in ${RECORD_TOPICS:-disk lora moe distill}; do
    [[ -f tools/gpu/record_sglang_$topic.py ]] || continue
    (
      timeout ${RECORD_S:-400} python3 tools/gpu/record_sglang_$topic.py --out "$WORK/golden/$topic" --startup-timeout-s 360 \
        > "$WORK/record_$topic.log" 2>&1
      echo "record $topic exit $?" >> "$WORK/record_$topic.log"
    ) &
    pids+=($!)
  done
fi
for section in lora moe delta opd; do
  if [[ $SECTIONS == *$section* ]]; then
    args_var=${section^^}_ARGS  # e.g. LORA_ARGS="--sections push,sglang"
    ( timeout ${SECTION_S:-400} python3 tools/gpu/${section}_gpu.py --out "$WORK/$section" ${!args_var:-} \
        > "$WORK/$section.log" 2>&1
      echo "$section exit $?" >> "$WORK/$section.log"
      if [[ $section == moe && $SECTIONS == *moeprof* ]]; then
        timeout 200 python3 tools/gpu/moe_decode_profile.py --out "$WORK/moeprof" > "$WORK/moeprof.log" 2>&1
        echo "moeprof exit $?" >> "$WORK/moeprof.log"
      fi ) &
    pids+=($!)
  fi
done
if [[ $SECTIONS == *pytest* ]]; then
  # addopts name pytest-timeout, which the GPU machine lacks; the section's timeout bounds the run instead.
  ( timeout ${SECTION_S:-400} python3 -m pytest -q -o addopts="" -ra -p no:cacheprovider ${PYTEST_ARGS:-tests/gpu} \
      > "$WORK/pytest.log" 2>&1
    echo "pytest exit $?" >> "$WORK/pytest.log" ) &
  pids+=($!)
fi
if [[ $SECTIONS == *fsdp* ]]; then
  timeout 200 python3 tools/gpu/fsdp_mfu.py --shape qwen3-4b --steps 4 --timeout-s 120 \
    --variants ddp+defaults fsdp2+ac fsdp2+ac+head+compile+mb8 2>&1 | tee "$WORK/fsdp_4b.txt"
  timeout 200 python3 tools/gpu/fsdp_mfu.py --shape qwen3-8b --steps 2 --timeout-s 180 \
    --variants ddp+defaults fsdp2+ac+offload 2>&1 | tee "$WORK/fsdp_8b.txt"
fi
for p in "${pids[@]}"; do wait "$p"; done
for f in "$WORK"/*.log; do echo "=== $f"; tail -n 25 "$f"; done >> "$OUT/summary.log" 2>&1
tar -C "$WORK" --exclude='*.safetensors' --exclude='*.h5' --exclude='model' -czf "$OUT/results.tgz" . 2> /dev/null
tail -c 6000 "$OUT/summary.log"
