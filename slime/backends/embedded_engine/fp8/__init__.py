"""FP8 weights: block-wise (``--quantization fp8``) and per-channel (``--quantization w8a8_fp8``), their
quantizers and GEMM backends (Triton, cuBLASLt)."""
