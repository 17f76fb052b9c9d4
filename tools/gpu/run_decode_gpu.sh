#!/usr/bin/env bash
# The decode benchmarks per K/V cache, the GEMM sweep and the GPU tests in one run (benchmarks/decode_h200_2026-12.md):
#   bash tools/gpu/run_decode_gpu.sh     # from the repo root; .whl/ holds orjson for Python 3.12; results in $OUT
#   BASELINE=.ab bash tools/gpu/run_decode_gpu.sh   # .ab/ (git-ignored) holds another commit's hpcrl/ and tools/:
#                                                   # its 8-bit bench runs too, in the same call, for an A/B
# tests: tests/gpu/test_engine_cuda.py and test_engine_kernels.py (the fp8 cache against the model's own scoring)
# micro: tools/gpu/decode_microbench.py per cache: prefill (the model's forward and the fused path, with kernel
#        tables), the fused sampler, graph replay, the loop body
# gemm: tools/gpu/decode_gemm_sweep.py: each decode GEMM stage, cuBLAS against kernels.linear configs; the best go
#       to $OUT/best_gemm_env.txt and the bench's triton-GEMM run (GEMM_ENV_FILE= names an earlier call's, carried)
# Knobs: STEPS, RUNS, MICRO_CACHES, MICRO_SECTIONS (the default includes step_variants: PDL and cuBLASLt), MICRO_ARGS
# (more decode_microbench.py flags, e.g. "--prefill-profile-tokens 32768"),
# MICRO_TIMEOUT_S, TESTS_TIMEOUT_S, GEMM_TIMEOUT_S, GEMM_ENV_FILE; each section logs its start [s]
# bench: 256 x 512 decode with log-probs, Qwen3-0.6B shape, bf16: K/V cache bf16, then fp8_e4m3, each with the model's
#        prefill (--kernels-prefill=model), then fp8_e4m3 with the fused prefill (the default), then also
#        --kernels-gemm=triton; same model and prompts. RUNS= picks others; "default" leaves a knob at its default
# gap: the colocated GRPO step's train/rollout log-prob gap with each cache (the engine inherits this shell's
#      environment: HPCRL_ENGINE_PREFILL=model STEPS=gap ... measures it with the model's prefill; the engine names
#      the override in its start-up line)
# Sections are independent: one failing does not stop the next.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hpcrl-gpu-out}
mkdir -p "$OUT" /tmp/hpcrl-gpu
python3 -c "import orjson" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/orjson-*.whl
export PYTHONPATH=/tmp/site:.
STEPS=${STEPS:-"tests bench gap"}
BASELINE=${BASELINE:-}
REPO=$PWD
section() { echo "=== [${SECONDS}s] $*" | tee -a "$OUT/decode.log"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>&1 | tee "$OUT/decode.log"
if [[ $STEPS == *tests* ]]; then
  section "tests/gpu (engine)"
  timeout ${TESTS_TIMEOUT_S:-420} python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_engine_cuda.py tests/gpu/test_engine_kernels.py \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|FAILED|error|Error|fp8|\{'auto'" | tail -20 | tee -a "$OUT/decode.log"
fi
if [[ $STEPS == *micro* ]]; then
  for cache in ${MICRO_CACHES:-fp8_e4m3 auto}; do
    section "decode_microbench, kv cache $cache"
    timeout ${MICRO_TIMEOUT_S:-240} python3 tools/gpu/decode_microbench.py --kv-cache-dtype $cache --out /tmp/hpcrl-gpu/micro_$cache \
      --sections ${MICRO_SECTIONS:-prefill,prefill_profile,samplers,graph_forward,full_steps,step_variants} ${MICRO_ARGS:-} 2>&1 \
      | grep -E "^\| [a-z]" | tee -a "$OUT/decode.log"
    # The fused prefill's kernel table, when prefill_profile ran (a file back, not a page of the log).
    cp /tmp/hpcrl-gpu/micro_$cache/profile_prefill_fused.txt "$OUT/profile_prefill_fused_$cache.txt" 2>/dev/null
  done
  if [[ -n $BASELINE ]]; then
    section "decode_microbench samplers, tree $BASELINE"
    (cd "$BASELINE" && timeout 100 python3 tools/gpu/decode_microbench.py --out /tmp/hpcrl-gpu/micro_baseline \
      --sections samplers 2>&1 | grep -E "^\| [a-z]" | tee -a "$OUT/decode.log")
  fi
fi
# The triton-GEMM bench takes this call's sweep, or GEMM_ENV_FILE (an earlier call's best_gemm_env.txt, carried);
# never a file a previous call left in /tmp, which outlives a call on a warm machine.
GEMM_ENV=${GEMM_ENV_FILE:-}
if [[ -n $GEMM_ENV && ! -f $GEMM_ENV ]]; then
  echo "GEMM_ENV_FILE=$GEMM_ENV: no such file; the triton-GEMM bench runs with the default configs" | tee -a "$OUT/decode.log"
fi
if [[ $STEPS == *gemm* ]]; then
  [[ -n $GEMM_ENV ]] && echo "GEMM_ENV_FILE=$GEMM_ENV is ignored: this call's sweep configures the bench" | tee -a "$OUT/decode.log"
  GEMM_ENV=$OUT/best_gemm_env.txt
  rm -f "$GEMM_ENV"
  section "decode GEMMs at M = 256: cuBLAS path against kernels.linear (best configs -> $GEMM_ENV)"
  PYTHONPATH=/tmp/site:.:tools/gpu timeout ${GEMM_TIMEOUT_S:-400} python3 tools/gpu/decode_gemm_sweep.py --env-out "$GEMM_ENV" 2>&1 \
    | tee "$OUT/gemm_sweep.log" | grep -E "^best|^a layer|failed" | tee -a "$OUT/decode.log"
fi
if [[ $STEPS == *bench* ]]; then
  # cache:tree:prefill:gemm[:extra] (engine.kernels.prefill, engine.kernels.gemm, or "default"; triton takes the
  # gemm step's configs when it ran in this call, else GEMM_ENV_FILE's, else the defaults); RUNS= picks others.
  # extra: "+"-separated NAME=VALUE engine variables (HPCRL_ENGINE_<KNOB> overrides) and --bench-flag=value
  # arguments, e.g. fp8_e4m3:.:default:default:HPCRL_ENGINE_PDL=0+--logprob-wire=triples
  runs=${RUNS:-"auto:.:model:cublas fp8_e4m3:.:model:cublas fp8_e4m3:.:fused:cublas fp8_e4m3:.:fused:triton"}
  [[ -n $BASELINE ]] && runs="$runs fp8_e4m3:$BASELINE:default:default"
  for run in $runs; do
    IFS=: read -r cache tree prefill gemm more <<<"$run"
    name=bench_${cache}_${prefill}_${gemm}$([[ $tree == . ]] || echo "_tree_$(basename "$tree")")
    extra=()  # prefill or gemm "default": the knob is left at its default, as a user's run would have it
    if [[ -n ${more:-} ]]; then
      name=${name}_$(tr -c 'A-Za-z0-9_\n' _ <<<"$more")
      IFS=+ read -r -a items <<<"$more"
      for item in "${items[@]}"; do
        [[ -z $item ]] && continue  # a leading, trailing or doubled "+"
        if [[ $item == --* ]]; then extra+=("$item"); else extra+=(--engine-env "$item"); fi
      done
    fi
    [[ $prefill == default ]] || extra+=("--engine-arg=--kernels-prefill=$prefill")
    [[ $gemm == default ]] || extra+=("--engine-arg=--kernels-gemm=$gemm")
    if [[ $gemm == triton && -n $GEMM_ENV && -f $GEMM_ENV ]]; then
      while read -r line; do [[ -n $line ]] && extra+=(--engine-env "$line"); done <"$GEMM_ENV"
    fi
    section "256 x 512 with log-probs, kv cache $cache, prefill $prefill, gemm $gemm ${extra[*]+${extra[*]}}, tree $tree"
    (cd "$tree" && PYTHONPATH=/tmp/site:. timeout 240 python3 tools/bench/engine_throughput.py \
      --init-qwen3-0.6b-shape --device cuda --dtype bfloat16 --num-seqs 256 --prompt-len 128 --max-new-tokens 512 \
      --logprobs --skip-generate --timed-runs 3 --kv-cache-dtype $cache --engine-arg=--decode-profile \
      ${extra[@]+"${extra[@]}"} \
      --workdir /tmp/hpcrl-gpu/$name --json-out "$OUT/$name.json" 2>&1 | grep -E "^config|^engine|rror") \
      | tee -a "$OUT/decode.log"
  done
  cd "$REPO"
fi
if [[ $STEPS == *gap* ]]; then
  for cache in auto fp8_e4m3; do
    section "colocated GRPO step, kv cache $cache"
    timeout 200 python3 tools/bench/step_time.py --shape qwen3-0.6b --device cuda --dtype bfloat16 --colocate \
      --steps 6 --threads 4 --no-baseline --set engine.kv_cache_dtype=$cache 2>&1 \
      | grep -E "abs_diff|gap|^\| [a-z]" | tee -a "$OUT/decode.log"
  done
fi
