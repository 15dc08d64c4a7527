"""The engine's compute kernels: attention (SDPA and the Triton flash-decoding kernel), the fused per-layer
ops (Triton on CUDA, fewer torch ops on the CPU), fused projections, the small-M GEMM, the sampler's Triton
kernels and the absorbed-weight MLA decode."""
