"""Triton kernels for the embedded engine's CUDA decode step.

At batch 256 the eager decode step of a 28-layer model is ~2,000 small launches (RMSNorm alone is
eight elementwise ops in fp32), an attention that expands the grouped K/V heads and a sampler that
runs ~40 passes over [B, V] int64/fp32 tensors. These kernels fuse each of those into one launch:

- `norms.add_rmsnorm`: residual add + RMSNorm (transformers' op order: normalise in fp32, cast, scale);
  `norms.embed_rmsnorm`, the first layer's: the embedding lookup + RMSNorm;
- `norms.qk_norm_rope_store`: per-head QK-norm + RoPE for q (in place) and k, and the K/V cache write,
  reading one fused QKV projection and the RoPE tables at each row's position;
- `attention.decode_attention`: one query token per row against its own cache length, or the last `window` keys
  of it in a sliding-window layer (GQA heads share one K/V read, and no row reads past its length, so CUDA graphs
  need no attention-length buckets);
- `gemm.silu_mul`: the SwiGLU product of one fused gate/up projection; `gemm.linear`, the Triton GEMM of
  engine.kernels.gemm triton, and `gemm.split_k_linear`, the cuBLAS path's split-K GEMM;
- `sampler.sample_rows`: `sampling.sample`'s draw (a chunk of ids by its mass, then Gumbel-max inside it, with the
  same counter-based noise as `sampling.counter_uniform`: a pure function of seed, token index and vocab id),
  plus the log-probs at temperature 1 and at the row's temperature, in one kernel over the logits (each chunk
  scanned for its max, then from L1 for its sum-exp) and one over the drawn chunk, without materialising noise.

`launch` holds what every kernel launch reads: the resolved `engine.kernels` settings, programmatic dependent
launch, and whether Triton is there at all.

Every kernel reads its row lengths and positions from device memory, so a decode step has no host
sync and can be captured in a CUDA graph. Triton is optional: without it (CPU installs) `launch.AVAILABLE`
is False and the engine runs the eager model.
"""
