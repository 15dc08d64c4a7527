#!/usr/bin/env bash
# Sets up .venv (if needed) and runs the whole CPU test suite. GPU tests are marked and skipped
# where CUDA is absent. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/utils -x`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup-env.sh dev
export TOKENIZERS_PARALLELISM=false
# the coding-agent CLIs (Claude Code, Codex) the harness tests install into sandboxes: ~360 MB from npm once,
# cached in ~/.cache/slime/agent-clis (SLIME_SKIP_AGENT_CLIS=1: not fetched, those tests skip)
if [ -z "${SLIME_SKIP_AGENT_CLIS:-}" ]; then eval "$(bash scripts/fetch-agent-clis.sh)"; fi
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -ra --timeout=900 "$@"
fi
.venv/bin/python -m pytest -q -ra --timeout=900 --durations=25 tests
# The fused Triton log-prob kernels, the sampler's kernel and the FP8 GEMM on the CPU, run by Triton's interpreter, and the FP8 GEMM compiled
# for sm_90 by triton's bundled ptxas (no GPU needed) (~20 s). triton is not a
# dependency: setup-env.sh keeps a copy in .venv/sglang-args, off the import path; this pass sees
# only that package (a directory holding a link to it), so the main run above stays triton-free.
interp_dir=.venv/triton-interpreter
if [ -d .venv/sglang-args/triton ]; then
  mkdir -p "$interp_dir" && ln -sfn "$root/.venv/sglang-args/triton" "$interp_dir/triton"
  echo "[test] the Triton kernels under TRITON_INTERPRET=1"
  PYTHONPATH="$interp_dir" TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -ra --timeout=900 -p no:cacheprovider \
    tests/backends/training/test_logprob_head.py tests/backends/megatron_utils/test_logprobs.py \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_triton_gemm_interpreted_equals_reference \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_triton_gemm_interpreted_rounds_ties_like_the_gpu_cast \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_triton_gemm_interpreted_divides_like_the_reference_next_to_ties \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_e4m3_grid_rounding_equals_torch_cast \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_tile_plan_fills_the_gpu_for_qwen3_decode_shapes \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_planned_tiles_compile_for_h200_without_spilling \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_triton_linear_interpreted_bf16_with_bias \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_weight_only_gemm_interpreted_equals_the_dequantized_matmul \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_weight_only_linear_interpreted_equals_the_dequant_backend \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_weight_only_plan_fills_the_gpu_for_qwen3_decode_shapes \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_weight_only_tiles_compile_for_h200_on_register_fed_wgmma \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_activation_quantizer_interpreted_is_bit_exact \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_weight_quantizer_interpreted_is_bit_exact \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_weight_quantizer_interpreted_writes_into_views_and_reads_strided_rows \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_weight_quantizer_compiles_for_h200 \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_token_quantizer_interpreted_is_bit_exact \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_auto_picks_cublas_else_triton_else_cutlass_for_bf16_on_sm90_else_dequant \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_norm_kernels_quantize_per_token_like_the_quantizer \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_decoder_layers_with_per_token_producers_equal_the_plain_path \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_silu_gate_quantizes_per_token_like_the_quantizer \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_channel_triton_gemm_interpreted_equals_reference \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_channel_triton_linear_interpreted_bf16_with_bias_and_refusals \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_channel_gemm_compiles_for_h200_keeping_a_wgmma_in_flight \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_warm_up_compiles_every_launch_of_the_channel_gemm \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_readers_of_an_unscaled_product_scale_it_as_apply_scales_does \
    tests/backends/embedded_engine/fp8/test_fp8_channel.py::test_cublas_decode_steps_scale_in_the_readers_and_keep_the_logits \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_two_kernel_gemm_interpreted_equals_reference \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_two_kernel_gemm_by_tma_equals_pointer_loads \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_tma_usable_needs_16_byte_rows \
    tests/backends/embedded_engine/fp8/test_fp8_install.py::test_warm_up_runs_one_gemm_per_launch_and_covers_every_token_count \
    tests/backends/embedded_engine/fp8/test_fp8_install.py::test_warm_up_interpreted_runs_the_real_gemms \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_norm_and_silu_kernels_quantize_their_output_like_the_quantizer \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_two_kernel_gemm_takes_quantized_activations_and_accumulates_in_its_epilogue \
    tests/backends/embedded_engine/fp8/test_fp8_block.py::test_fp8_decoder_layers_with_quantizing_producers_equal_the_plain_path \
    tests/backends/embedded_engine/fp8/test_fp8_triton_kernels.py::test_producer_quantizing_kernels_compile_for_h200 \
    tests/backends/embedded_engine/fp8/test_fp8_cublas.py::test_cublas_path_calls_scaled_mm_by_its_contract_and_falls_back_for_other_shapes \
    tests/backends/embedded_engine/fp8/test_fp8_cublas.py::test_cublas_check_gemm_catches_a_refused_or_misread_recipe \
    tests/backends/embedded_engine/kernels/test_attention.py::test_triton_decode_kv_write_interpreted_equals_index_put \
    tests/backends/embedded_engine/kernels/test_attention.py::test_triton_decode_attention_interpreted_matches_reference \
    tests/backends/embedded_engine/kernels/test_attention.py::test_triton_decode_attention_interpreted_every_launch_matches_reference \
    tests/backends/embedded_engine/kernels/test_attention.py::test_triton_verify_attention_interpreted_matches_reference \
    tests/backends/embedded_engine/kernels/test_attention.py::test_plan_launch_picks_the_h200_sweeps_best_launches \
    tests/backends/embedded_engine/speculative/test_verify_step.py::test_verify_step_on_the_cuda_path_interpreted_equals_the_generic_forward \
    tests/backends/embedded_engine/test_kv_cache_fp8.py::test_triton_decode_kv_write_interpreted_saturates_and_scales \
    tests/backends/embedded_engine/test_kv_cache_fp8.py::test_triton_decode_attention_interpreted_over_fp8_equals_the_dequantized_reference \
    tests/backends/embedded_engine/test_kv_cache_fp8.py::test_triton_decode_attention_interpreted_over_fp8_with_a_bf16_query_dots_in_fp16 \
    tests/backends/embedded_engine/kernels/test_fused_ops.py::test_packed_silu_gate_interpreted_equals_torch \
    tests/backends/embedded_engine/kernels/test_fused_ops.py::test_add_rms_norm_interpreted_matches_hf \
    tests/backends/embedded_engine/kernels/test_fused_ops.py::test_decoder_layer_with_fused_add_norm_interpreted_keeps_the_logits \
    tests/backends/embedded_engine/kernels/test_fused_ops.py::test_qk_norm_rope_interpreted_matches_hf \
    tests/backends/embedded_engine/kernels/test_fused_ops.py::test_attention_with_fused_qk_norm_rope_interpreted_keeps_the_logits \
    tests/backends/embedded_engine/kernels/test_fused_ops.py::test_qk_norm_rope_interpreted_writes_the_cache_as_the_decode_write_does \
    tests/backends/embedded_engine/kernels/test_fused_ops.py::test_decode_with_the_cache_write_in_the_norm_rope_kernel_interpreted_keeps_the_logits \
    tests/backends/embedded_engine/kernels/test_small_gemm.py \
    tests/backends/embedded_engine/kernels/test_sampling_kernel.py \
    tests/backends/embedded_engine/kernels/test_kernels_compile.py \
    tests/backends/embedded_engine/test_kv_cache_fp8.py::test_cuda_decode_path_interpreted_with_fp8_kv_stays_close
fi
