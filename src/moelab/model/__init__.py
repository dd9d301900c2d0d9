"""The model (layer 1): pure functions of params and tokens, no mesh and no files.

- `layers`: RMSNorm, the dense SwiGLU and the init scales the transformer and the MoE block share.
- `fp8`: FP8 matmuls (`model.fp8`): e4m3 operands, e5m2 gradients, current scaling.
- `transformer`: embedding, pre-norm blocks (GQA attention with RoPE, MoE), lm head, loss.
- `moe`: the MoE block: router, LatentMoE projection, routed experts, shared experts; `build_moe`, the one
  builder of how a block runs (`Dispatch`: backend, capacity, FP8, the mesh axes of its tokens, the tiles it is
  traced with) for a purpose.
- `router`: scores, biased top-k, combine weights and router statistics.
- `balancing`: the rules that move the router's bias (quantile, sign, aux loss) and their estimators.
- `dispatch`: the single-device backends (dense, capacity, dropless, grouped).
- `exchange`: the expert-parallel backend (`ep`), per device: pooled all-to-all over the mesh axis "expert".
- `grouped_matmul`: the Pallas grouped GEMM and its tile choice (the GPU's dropless fast path).
- `rows`: row moves whose gradients are gathers.
- `decode`: KV-cache decoding and sampling.
"""
