#!/usr/bin/env bash
# The quickstarts' learning over three seeds, every sweep at once on a many-core host's CPUs (the runs are the
# CPU quickstarts: no GPU is used). Figures go to the benchmarks/ reports of each capability.
#   SWEEPS="lora moe fsdp2" bash tools/gpu/run_seed_sweeps.sh      # from the repo root; tables go to $OUT
# Sweeps: quickstart (as shipped), lora, moe, moe-noreplay (seed 0: the curve without routing replay, for hpcrl compare), fsdp2 (2 ranks),
# gspo, cispo, dr_grpo, dapo (the quickstart with that objective), distill (on-policy distillation from the
# GRPO-trained quickstart policy, trained first if runs/quickstart/model is absent) and distill-grpo (the same
# student, GRPO alone: compare its curves with distill's). Each sweep runs its seeds in parallel, one torch
# thread a process (tools/bench/quickstart_rewards.py --parallel 3).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/hpcrl-seeds-out}
RUNS=${RUNS:-/tmp/hpcrl-seeds}
SWEEPS=${SWEEPS:-"quickstart lora moe moe-noreplay fsdp2 gspo cispo dr_grpo dapo distill distill-grpo"}
mkdir -p "$OUT" "$RUNS"
nproc | sed 's/^/cpus: /' | tee "$OUT/seeds.log"
sweep() {  # name, seeds, config, overrides...
  local name=$1 seeds=$2 config=$3
  shift 3
  python3 tools/bench/quickstart_rewards.py --config "$config" --seeds $seeds --parallel 3 \
    --out-dir "$RUNS/$name" "$@" >"$OUT/$name.txt" 2>&1
  cp "$RUNS/$name"/seed*.log "$OUT/" 2>/dev/null
  for s in $seeds; do
    [[ -f $RUNS/$name/seed$s/metrics.h5 ]] && cp "$RUNS/$name/seed$s/metrics.h5" "$OUT/$name-seed$s.h5"
  done
}
for name in $SWEEPS; do
  case $name in
    lora) (  # the LoRA quickstart adapts the quickstart's SFT warm start (experiments/quickstart-lora.yaml)
      [[ -f runs/quickstart-sft/model/config.json ]] || python3 -m hpcrl.cli run experiments/quickstart.yaml \
        num_steps=0 --run-dir runs/quickstart-sft >"$OUT/lora-sft.log" 2>&1
      sweep lora "0 1 2" experiments/quickstart-lora.yaml
    ) & ;;
    quickstart) sweep quickstart "0 1 2" experiments/quickstart.yaml & ;;
    moe) sweep moe "0 1 2" experiments/moe-quickstart.yaml & ;;
    moe-noreplay) sweep moe-noreplay "0" experiments/moe-quickstart.yaml train.routing_replay=off & ;;
    fsdp2) sweep fsdp2 "0 1 2" experiments/quickstart.yaml train.parallelism=fsdp2 train.num_ranks=2 & ;;
    gspo | cispo | dr_grpo) sweep "$name" "0 1 2" experiments/quickstart.yaml train.loss="$name" & ;;
    dapo) sweep dapo "0 1 2" experiments/quickstart.yaml rollout.dynamic_sampling=true \
      train.overlong_window_tokens=2 train.mask_truncated=true & ;;
    distill) (  # the teacher: the GRPO-trained quickstart policy (experiments/distill-quickstart.yaml)
      [[ -f runs/quickstart/model/config.json ]] || python3 -m hpcrl.cli run experiments/quickstart.yaml \
        --run-dir runs/quickstart >"$OUT/distill-teacher.log" 2>&1
      sweep distill "0 1 2" experiments/distill-quickstart.yaml
    ) & ;;
    distill-grpo) sweep distill-grpo "0 1 2" experiments/distill-quickstart.yaml distill=null name=distill-grpo & ;;
    *) echo "unknown sweep $name" >&2 ;;
  esac
done
wait
for name in $SWEEPS; do
  echo "=== $name" | tee -a "$OUT/seeds.log"
  tail -8 "$OUT/$name.txt" | tee -a "$OUT/seeds.log"
done
