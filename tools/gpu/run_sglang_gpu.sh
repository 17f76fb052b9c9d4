#!/usr/bin/env bash
# Stock SGLang 0.5.16 on one H200 (docs/sglang.md), from the repo root, with .sglang/ holding an SGLang 0.5.16
# site (.sglang/activate.sh unpacks .sglang/sglang-site.tar.xz and puts it on the path):
#   bash tools/gpu/run_sglang_gpu.sh [weights] [quickstart]
# weights:    tools/gpu/sglang_weights.py (payload, memory rental, pushed == fresh server)
# quickstart: the quickstart with engine.kind=sglang, colocated, memory rented every step
# fault:      12 steps whose engine's scheduler is SIGKILLed at step 6 (FAULT_AT/FAULT_COUNT say when)
# record:     tools/gpu/record_sglang.py (the answers under tests/golden/sglang-0.5.16/), as $OUT/golden.tgz
# replay:     tools/gpu/sglang_replay_gap.py (top_k=64 top_p=0.95: the gap with and without support replay)
# multiturn:  experiments/tool-quickstart.yaml (multi-turn episodes through the session server) with
#             engine.kind=sglang, colocated, for 6 steps after 200 SFT steps (TQ_ARGS="num_steps=25 sft.num_steps=500"
#             runs the whole recipe); its metrics.h5 rows and engine log come back
# family-live: a stock SGLang server with the tiny model, then tools/gpu/family_check_live.py --family tiny
#             against it (the battery's turns sampled by the live model through a real session server)
# throughput: decode tok/s of the embedded engine, then of SGLang (triton attention, CUDA graphs), 256 x 512
#             tokens with log-probs, Qwen3-0.6B shape bf16; runs alone, before the other sections start
# Sections run at once (each SGLang start is 130-150 s); every server caps its KV cache
# (--max-total-tokens) so that several share the GPU.
set -u
source .sglang/activate.sh .sglang/sglang-site.tar.xz
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hpcrl-sglang-out}; mkdir -p "$OUT"
STEPS=${*:-"weights quickstart"}
SGLANG_ARGS='["--attention-backend","triton","--sampling-backend","pytorch","--grammar-backend","none","--max-total-tokens","65536"]'
pids=()
if [[ $STEPS == *throughput* ]]; then
  timeout 560 python3 tools/bench/engine_throughput.py --init-qwen3-0.6b-shape --device cuda --dtype bfloat16 \
    --num-seqs 256 --prompt-len 128 --max-new-tokens 512 --engine both --logprobs --skip-generate \
    --timed-runs 3 --sglang-arg=--attention-backend --sglang-arg=triton --workdir /tmp/tp \
    --json-out "$OUT/throughput.json" > "$OUT/throughput.log" 2>&1
  echo "throughput exit $?" >> "$OUT/throughput.log"
  tail -n 5 /tmp/tp/sglang.log > "$OUT/throughput_sglang_tail.log" 2>/dev/null
fi
if [[ $STEPS == *replay* ]]; then
  timeout 560 python3 tools/gpu/sglang_replay_gap.py --out "$OUT" > "$OUT/replay.log" 2>&1 &
  pids+=($!)
fi
if [[ $STEPS == *weights* ]]; then
  timeout 560 python3 tools/gpu/sglang_weights.py --workdir /tmp/sgw --out "$OUT/w" > "$OUT/weights.log" 2>&1 &
  pids+=($!)
fi
if [[ $STEPS == *quickstart* ]]; then
  rm -rf /tmp/qs-sglang
  timeout 560 python3 -m hpcrl.cli run experiments/quickstart.yaml \
    model.path=/tmp/models/tiny-qwen3 engine.kind=sglang engine.device=cuda train.device=cuda \
    engine.dtype=bfloat16 train.dtype=bfloat16 engine.mem_fraction_static=0.5 engine.enable_memory_saver=true \
    engine.offload_during_train=true "engine.sglang_args=$SGLANG_ARGS" --run-dir /tmp/qs-sglang > "$OUT/quickstart.log" 2>&1 &
  pids+=($!)
fi
if [[ $STEPS == *multiturn* ]]; then
  rm -rf /tmp/tq-sglang
  timeout 560 python3 -m hpcrl.cli run experiments/tool-quickstart.yaml ${TQ_ARGS:-num_steps=6 sft.num_steps=200} \
    model.path=/tmp/models/tiny-qwen3-512 engine.kind=sglang engine.device=cuda train.device=cuda \
    engine.dtype=bfloat16 train.dtype=bfloat16 engine.mem_fraction_static=0.5 engine.enable_memory_saver=true \
    engine.offload_during_train=true "engine.sglang_args=$SGLANG_ARGS" --run-dir /tmp/tq-sglang > "$OUT/multiturn.log" 2>&1 &
  pids+=($!)
fi
if [[ $STEPS == *family-live* ]]; then
  (
    python3 -m hpcrl.cli model init-tiny /tmp/models/tiny-family > /dev/null
    FL_PORT=30177
    python3 -m sglang.launch_server --model-path /tmp/models/tiny-family --port $FL_PORT --dtype bfloat16 \
      --attention-backend triton --sampling-backend pytorch --grammar-backend none --skip-server-warmup \
      --mem-fraction-static 0.15 --max-total-tokens 65536 --random-seed 0 > "$OUT/family_live_sglang.log" 2>&1 &
    srv=$!
    for _ in $(seq 400); do
      curl -sf "http://127.0.0.1:$FL_PORT/health" > /dev/null && break
      kill -0 $srv 2> /dev/null || break
      sleep 1
    done
    timeout 300 python3 tools/gpu/family_check_live.py --engine "http://127.0.0.1:$FL_PORT" \
      --model /tmp/models/tiny-family --family tiny --out "$OUT/family_live.json" > "$OUT/family_live.log" 2>&1
    echo "family-live exit $?" >> "$OUT/family_live.log"
    kill $srv 2> /dev/null; wait $srv 2> /dev/null
  ) &
  pids+=($!)
fi
if [[ $STEPS == *fault* ]]; then
  # SIGKILL the SGLang scheduler of a run when its engine log shows FAULT_COUNT lines matching FAULT_AT
  # (default: the 12th release_memory_occupation, i.e. step 6's second release: the trainer trains while
  # the engine holds no memory, and the push comes next). The fleet must see the engine die, restart it,
  # push the current weights, and the run must finish every step.
  FAULT_AT=${FAULT_AT:-"POST /release_memory_occupation"}; FAULT_COUNT=${FAULT_COUNT:-12}
  rm -rf /tmp/fault-sglang
  timeout 560 python3 -m hpcrl.cli run experiments/quickstart.yaml num_steps=12 sft.num_steps=0 \
    model.path=/tmp/models/tiny-qwen3 engine.kind=sglang engine.device=cuda train.device=cuda \
    engine.dtype=bfloat16 train.dtype=bfloat16 engine.mem_fraction_static=0.5 engine.enable_memory_saver=true \
    engine.offload_during_train=true "engine.sglang_args=$SGLANG_ARGS" --run-dir /tmp/fault-sglang \
    > "$OUT/fault.log" 2>&1 &
  pids+=($!)
  (
    log=/tmp/fault-sglang/logs/engine-0.log
    deadline=$((SECONDS + 420))  # the server's start (about 2 minutes) comes first
    # The scheduler's pid is looked up once the server has answered, so that the kill itself follows the
    # FAULT_COUNT-th FAULT_AT line within milliseconds (with FAULT_AT="POST /pause_generation": mid-push).
    until [[ -f $log ]] && grep -q "POST /pause_generation" "$log"; do
      (( SECONDS > deadline )) && { echo "fault: the engine never paused" >> "$OUT/fault_kill.log"; exit 1; }
      sleep 0.05
    done
    pid=$(python3 -c "import json;print(json.load(open('/tmp/fault-sglang/engines/engine-0.json'))['pid'])")
    sched=$(ps -o pid=,args= --ppid "$pid" | grep -i scheduler | awk '{print $1}' | head -1)
    until (( $(grep -c "$FAULT_AT" "$log") >= FAULT_COUNT )); do
      (( SECONDS > deadline )) && { echo "fault: '$FAULT_AT' x$FAULT_COUNT never came" >> "$OUT/fault_kill.log"; exit 1; }
      sleep 0.002
    done
    kill -9 "$sched"
    echo "fault: killed scheduler $sched of sglang server $pid at $(date +%T.%N) after '$FAULT_AT' x$FAULT_COUNT" \
      >> "$OUT/fault_kill.log"  # not fault.log: the run's own writes to it would overwrite this line
  ) &
fi
if [[ $STEPS == *record* ]]; then
  ( timeout 560 python3 tools/gpu/record_sglang.py --out /tmp/golden > "$OUT/record.log" 2>&1;
    echo "record exit $?" >> "$OUT/record.log"; tar -C /tmp/golden -czf "$OUT/golden.tgz" . ) &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; echo "section pid $p exit $?"; done
[[ -d /tmp/qs-sglang ]] && { cp /tmp/qs-sglang/logs/engine-0.log "$OUT/qs_engine.log" 2>/dev/null;
  python3 -m hpcrl.cli report /tmp/qs-sglang -o /tmp/qs-report > "$OUT/qs_report.txt" 2>&1; }
[[ -d /tmp/tq-sglang ]] && { cp /tmp/tq-sglang/logs/engine-0.log "$OUT/tq_engine.log" 2>/dev/null;
  python3 -m hpcrl.cli report /tmp/tq-sglang -o /tmp/tq-report > "$OUT/tq_report.txt" 2>&1;
  python3 -c "from hpcrl.store import load_metrics; m = load_metrics('/tmp/tq-sglang/metrics.h5')
for k in sorted(m):
    if k.startswith('rollout/'): print(k, [round(float(x), 4) for x in m[k]])" > "$OUT/tq_metrics.txt" 2>&1; }
[[ -d /tmp/fault-sglang ]] && cp /tmp/fault-sglang/logs/engine-0.log "$OUT/fault_engine.log" && python3 -m hpcrl.cli report /tmp/fault-sglang -o /tmp/fault-report > "$OUT/fault_report.txt" 2>&1
tail -n 30 "$OUT"/*.log "$OUT"/w/*.json 2>/dev/null | cut -c1-400
