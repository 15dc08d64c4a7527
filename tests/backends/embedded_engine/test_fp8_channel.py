"""Per-channel FP8 (``--quantization w8a8_fp8``, ``fp8_channel.py``): the row quantizer's math, the Triton
token quantizer against it (under the interpreter in ``scripts/test.sh``'s second pass), the weight-update
name mapping over fused projections of any row counts, greedy decoding of a quantized tiny model, and, on a
GPU, ``torch._scaled_mm``'s row-wise path and the engine under CUDA graphs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slime.backends.embedded_engine import fp8_channel
from test_fp8 import (MAX_MEAN_LOGPROB_GAP, PROMPTS, _engine_greedy,
                      check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs, swap_in_fused_layer_forwards)

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")


def test_rows_round_trip_within_half_an_e4m3_spacing_and_zero_rows():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 300, generator=gen) * torch.logspace(-3, 1, 70)[:, None]  # rows of different scales
    weight[5] = 0.0
    values, scales = fp8_channel.quantize_rows(weight)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (70, 1) and scales[5] == 1.0
    assert torch.equal(scales[:, 0], torch.where(weight.abs().amax(1) > 0, weight.abs().amax(1) / 448, 1.0))
    assert values.float().abs().amax(1)[torch.arange(70) != 5].eq(448).all()  # each row's peak maps to e4m3's max
    error = (fp8_channel.dequantize(values, scales) - weight).abs()
    bound = torch.maximum(weight.abs() * 2.0**-4, scales * 2.0**-10) * (1 + 1e-6)
    assert (error <= bound).all() and error.max() > 0
    assert not values[5].float().any()


def test_backend_resolution_and_flags(tiny_model_dir):
    from slime.backends.embedded_engine.config import parse_args

    assert fp8_channel.resolve_backend("auto", torch.device("cpu")) == "dequant"
    with pytest.raises(ValueError, match="'triton' with --quantization w8a8_fp8"):
        fp8_channel.resolve_backend("triton", torch.device("cpu"))
    assert parse_args(["--model-path", tiny_model_dir, "--quantization", "w8a8_fp8"]).quantization == "w8a8_fp8"
    with pytest.raises(SystemExit, match="--fp8-gemm-backend cublas is a block-wise"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "w8a8_fp8", "--fp8-gemm-backend", "cublas"])


@needs_interpreter
@pytest.mark.parametrize("rows,cols,dtype", [(5, 300, torch.float32), (3, 2500, torch.bfloat16),
                                             (4, 1024, torch.float32), (1, 7, torch.bfloat16)])
def test_token_quantizer_interpreted_is_bit_exact(rows, cols, dtype):
    """One program a row, two passes of 1024 columns (2500: three, the last ragged): the same e4m3 bytes and
    scales as the torch reference, including a zero row and values next to e4m3 rounding ties."""
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    x[0, : min(cols, 4)] = torch.tensor([448.0, 13.0, 13.0 * (1 + 2**-5), -0.75])[: min(cols, 4)].to(dtype)
    if rows > 2:
        x[2] = 0
    values, scales = fp8_channel.quantize_tokens(x)
    expected_values, expected_scales = fp8_channel.quantize_rows(x)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(scales, expected_scales)


@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    return {q: ModelRunner(tiny_model_dir, num_slots=2, slot_capacity=64, quantization=q)
            for q in (None, "w8a8_fp8")}


def test_decoder_linears_become_per_channel_and_fuse_at_any_row_count(runners):
    runner = runners["w8a8_fp8"]
    layers = runner.model.config.num_hidden_layers
    assert all(isinstance(m, fp8_channel.ChannelFp8Linear) for m in runner.fp8.linears.values())
    # q/k/v (128 + 64 + 64 rows) fuse too: a part's channels carry their own scales, no 128-row blocks to share
    assert runner.fused_projections == {"qkv": layers, "gate_up": layers}
    assert {name.rsplit(".", 1)[-1] for name in runner.fp8.linears} == {"qkv_proj", "o_proj", "gate_up_proj",
                                                                        "down_proj"}
    elements = sum(m.weight_fp8.numel() for m in runner.fp8.linears.values())
    saved = runners[None].weight_bytes() - runner.weight_bytes()
    assert 3 * elements * 0.98 < saved < 3 * elements, (saved, elements)  # 4 bytes (fp32) -> 1 + a scale a row


def test_a_fused_part_reads_and_updates_only_its_own_rows(runners):
    runner = runners["w8a8_fp8"]
    name = "model.layers.1.self_attn.k_proj.weight"  # rows 128..192 of the fused qkv
    full = runners[None].get_weight(name)
    assert torch.equal(runner.get_weight(name), fp8_channel.dequantize(*fp8_channel.quantize_rows(full)))
    fused = runner.fp8.linears["model.layers.1.self_attn.qkv_proj"]
    before_values, before_scales = fused.weight_fp8.clone(), fused.weight_scale.clone()
    new = torch.randn(full.shape, generator=torch.Generator().manual_seed(3)) * 0.05
    assert runner.load_named_tensors([(name, new.to(torch.bfloat16))]) == 1
    values, scales = fp8_channel.quantize_rows(new.to(torch.bfloat16))
    assert torch.equal(fused.weight_fp8[128:192].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(fused.weight_scale[128:192], scales)
    for rows in (slice(0, 128), slice(192, None)):  # q's and v's channels untouched
        assert torch.equal(fused.weight_fp8[rows].view(torch.uint8), before_values[rows].view(torch.uint8))
        assert torch.equal(fused.weight_scale[rows], before_scales[rows])
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(fused(x)[:, 128:192], x @ fp8_channel.dequantize(values, scales).T)
    with pytest.raises(ValueError, match=r"expected shape \(64, 128\)"):
        runner.load_named_tensors([(name, new.T.contiguous())])
    runner.load_named_tensors([(name, full)])


def test_disk_update_is_quantized_per_channel(runners, tiny_model_dir, tmp_path):
    from engine_test_utils import copy_with_weights, perturbed_state_dict

    state = perturbed_state_dict(tiny_model_dir, seed=4)
    runner = runners["w8a8_fp8"]
    runner.load_from_disk(str(copy_with_weights(tiny_model_dir, tmp_path / "new", state)))
    name = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(runner.get_weight(name), fp8_channel.dequantize(*fp8_channel.quantize_rows(state[name])))
    runner.load_from_disk(tiny_model_dir)


def test_w8a8_engine_greedy_decode_stays_close_to_fp32(runners, tiny_model_dir):
    from engine_test_utils import hf_greedy, hf_logprobs, load_hf

    hf = load_hf(tiny_model_dir)
    gaps, agree, total = [], 0, 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, _engine_greedy(runners["w8a8_fp8"], PROMPTS)):
        reference = hf_greedy(hf, prompt, len(tokens))
        first_flip = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
        agree, total = agree + first_flip, total + len(tokens)
        gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens, 1.0))]
    mean_gap = sum(gaps) / len(gaps)
    print(f"w8a8_fp8 vs fp32: mean log-prob gap {mean_gap:.4f}, max {max(gaps):.4f}, agree {agree}/{total}")
    assert 1e-4 < mean_gap < MAX_MEAN_LOGPROB_GAP, mean_gap
    assert agree >= total // 2, (agree, total)


def test_routed_experts_are_refused_per_channel(tiny_deepseek_v3_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    with pytest.raises(ValueError, match="w8a8_fp8: the routed experts of .* use --quantization fp8"):
        ModelRunner(tiny_deepseek_v3_dir, num_slots=2, quantization="w8a8_fp8")


# ---------------------------------------------------------------------------------- CUDA (skipped without it)
def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU (torch._scaled_mm's row-wise FP8 GEMM)")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 2560, 4096), (128, 19456, 2560), (77, 3072, 1024)])
def test_gpu_scaled_mm_equals_reference_and_replays_in_a_cuda_graph(rows, out_features, in_features):
    _needs_sm90()
    assert fp8_channel.resolve_backend("auto", torch.device("cuda")) == "scaled_mm"
    gen = torch.Generator(device="cuda").manual_seed(rows)
    values, scales = fp8_channel.quantize_rows(torch.randn(out_features, in_features, generator=gen, device="cuda")
                                               / in_features**0.5)
    x = torch.randn(rows, in_features, generator=gen, device="cuda").to(torch.bfloat16)
    x8, x_scales = fp8_channel.quantize_tokens(x)
    reference_x8, reference_scales = fp8_channel.quantize_rows(x)
    assert torch.equal(x8.view(torch.uint8), reference_x8.view(torch.uint8)) and torch.equal(x_scales,
                                                                                             reference_scales)
    expected = fp8_channel.reference_matmul(x, values, scales)
    out = fp8_channel.channel_linear(x, values, scales, None, "scaled_mm")
    assert out.dtype == torch.bfloat16
    assert float((out.float() - expected).abs().max() / expected.abs().max()) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_channel.channel_linear(x, values, scales, None, "scaled_mm")
    x.copy_(torch.randn(rows, in_features, generator=gen, device="cuda"))
    graph.replay()
    expected = fp8_channel.reference_matmul(x, values, scales)
    assert float((captured.float() - expected).abs().max() / expected.abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "dequant"])
def test_gpu_w8a8_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, backend):
    _needs_sm90()
    check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, "w8a8_fp8", backend)


def test_calls_the_rowwise_gemm_cannot_take_use_the_dequantized_weight(monkeypatch):
    """``torch._scaled_mm`` row-wise needs bf16 out and K, N in multiples of 16: other calls (an fp32 engine, a
    ragged shape) compute over the dequantized weight instead of failing mid-decode; the rest call it with
    the per-token quantized activations, the weight transposed (column-major) and its scales as [1, N]."""
    calls = []

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
        calls.append((a.dtype, tuple(a.shape), b.stride(), tuple(scale_a.shape), tuple(scale_b.shape), out_dtype))
        return (fp8_channel.dequantize(a, scale_a) @ fp8_channel.dequantize(b.t(), scale_b.t()).t()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    gen = torch.Generator().manual_seed(1)
    values, scales = fp8_channel.quantize_rows(torch.randn(48, 32, generator=gen))
    x = torch.randn(3, 32, generator=gen)
    expected = x @ fp8_channel.dequantize(values, scales).t()
    torch.testing.assert_close(fp8_channel.channel_linear(x, values, scales, None, "scaled_mm"), expected)
    ragged_values, ragged_scales = fp8_channel.quantize_rows(torch.randn(40, 20, generator=gen))
    fp8_channel.channel_linear(x[:, :20].bfloat16(), ragged_values, ragged_scales, None, "scaled_mm")
    assert calls == []  # fp32 in, then K = 20: both on the dequantized weight
    out = fp8_channel.channel_linear(x.bfloat16()[None], values, scales, None, "scaled_mm")
    assert out.shape == (1, 3, 48) and out.dtype == torch.bfloat16
    assert calls == [(torch.float8_e4m3fn, (3, 32), (1, 32), (3, 1), (1, 48), torch.bfloat16)]
    torch.testing.assert_close(out[0].float(), fp8_channel.reference_matmul(x.bfloat16(), values, scales),
                               atol=2e-2, rtol=2e-2)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernels_quantize_per_token_like_the_quantizer(dtype):
    """``fused_ops``' RMSNorm and residual add + RMSNorm with ``quantize="token"`` return the same output and,
    beside it, exactly :func:`fp8_channel.quantize_tokens` of it (values and ``[M, 1]`` scales): the row-wise
    GEMM that reads them computes what it would after its own quantize launch."""
    from slime.backends.embedded_engine import fused_ops

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 384, generator=generator) * torch.logspace(-2, 2, 384)).to(dtype)
    x[3] = 0  # a zero row: scale 1
    residual = torch.randn(5, 384, generator=generator).to(dtype)
    residual[3] = 0
    weight = torch.randn(384, generator=generator).to(dtype)

    def assert_quantized(out, quantized):
        values, scales = quantized
        want_values, want_scales = fp8_channel.quantize_tokens(out)
        assert scales.shape == (5, 1) and torch.equal(scales, want_scales) and scales[3] == 1.0
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))

    out, quantized = fused_ops.rms_norm(x, weight, 1e-6, quantize="token")
    assert torch.equal(out, fused_ops.rms_norm(x, weight, 1e-6))
    assert_quantized(out, quantized)
    normed, total, quantized = fused_ops.add_rms_norm(x, residual, weight, 1e-6, quantize="token")
    want_normed, want_total = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(normed, want_normed) and torch.equal(total, want_total)
    assert_quantized(normed, quantized)


@needs_interpreter
def test_decoder_layers_with_per_token_producers_equal_the_plain_path(monkeypatch):
    """A tiny bf16 Qwen3 under ``w8a8_fp8`` on the row-wise path (``torch._scaled_mm`` runs row-wise scales on
    the CPU too) through ``fused_ops``' decoder-layer forward: with ``FP8_QUANT_IN_PRODUCER`` the two RMSNorms
    hand q/k/v and gate/up their per-token e4m3 activations (the SiLU gate does not: its programs hold slices of
    a row, so the down projection quantizes its own) — the logits are the same bits as without."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.backends.embedded_engine import fp8, fused_ops, fused_projections

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    assert fused_projections.install(model, row_multiple=1) == {"qkv": 2, "gate_up": 2}
    fp8.quantize_model(model, "scaled_mm", per_channel=True)
    swap_in_fused_layer_forwards(model)
    offered = []
    linear_forward = fp8_channel.ChannelFp8Linear.forward

    def spy(self, x, accumulate_into=None):
        offered.append(self._offered is not None and self._offered[0] is x)
        return linear_forward(self, x, accumulate_into=accumulate_into)

    monkeypatch.setattr(fp8_channel.ChannelFp8Linear, "forward", spy)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = model(ids).logits
        handed = sum(offered)
        monkeypatch.setattr(fused_ops, "FP8_QUANT_IN_PRODUCER", False)
        offered.clear()
        plain = model(ids).logits
    assert handed == 4 and sum(offered) == 0  # per layer: q/k/v and gate/up
    assert torch.equal(fused, plain)
