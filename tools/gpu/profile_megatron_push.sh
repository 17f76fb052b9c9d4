#!/usr/bin/env bash
# Where the Megatron trainer's weight push spends its time in the colocated GPU loop (cProfile of the driver).
#   bash tools/gpu/profile_megatron_push.sh      # needs .whl/megatron_core-*.whl (see run_megatron_gpu.sh)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/hpcrl-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core-*.whl
export PYTHONPATH=/tmp/site:.
python3 -c "
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
init_tiny_model('/tmp/prof-model', TinyModelSpec(num_layers=28, hidden_size=1024, intermediate_size=3072, num_heads=16,
                num_kv_heads=8, head_dim=128, max_position_embeddings=512), overwrite=True)" >/dev/null 2>&1
python3 -m cProfile -o "$OUT/push.prof" -m hpcrl.cli run experiments/quickstart.yaml model.path=/tmp/prof-model \
  num_steps=6 sft.num_steps=0 data.prompts_per_step=16 rollout.n_samples_per_prompt=8 rollout.max_new_tokens=8 \
  train.device=cuda engine.device=cuda train.dtype=bfloat16 engine.dtype=bfloat16 train.micro_batch_size=128 \
  sync.transport=tensor checkpoint.every_steps=1000000 train.backend=${BACKEND:-megatron} guard.mode=off \
  --run-dir /tmp/prof-run 2>&1 | grep "^step"
python3 -c "
import pstats; p = pstats.Stats('$OUT/push.prof'); p.sort_stats('cumulative')
p.print_callees('push_weights'); p.print_stats(r'sync|handover|megatron|client', 25)" 2>&1 | grep -v "^$" | head -90
