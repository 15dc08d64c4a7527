"""Block-wise FP8 layers (``fp8/block.py``): the dequant backend, flag refusals, the GEMM dispatch table, the
weight-update name mapping of a quantized model (linears, fused parts, routed experts, disk updates), greedy
decoding of a quantized tiny model against fp32, the quantizing producers of the decoder layers, and on a GPU
the engine under CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slime.backends.embedded_engine.fp8 import block as fp8
from slime.backends.embedded_engine.fp8 import install as fp8_install
from slime.backends.embedded_engine.fp8 import numerics as fp8_numerics
from slime.backends.embedded_engine.fp8 import quantize as fp8_quantize
from fp8_test_utils import (MAX_MEAN_LOGPROB_GAP, PROMPTS, _engine_greedy, _greedy,
                            check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs, needs_interpreter,
                            swap_in_fused_layer_forwards)


def test_dequant_linear_equals_matmul_with_the_dequantized_weight():
    torch.manual_seed(0)
    linear = nn.Linear(300, 200, bias=True)
    module = fp8.Fp8Linear(linear, "dequant")
    x = torch.randn(4, 7, 300)
    linear.requires_grad_(False)
    weight = fp8_numerics.dequantize_weight(module.weight_fp8, module.weight_scale_inv)
    torch.testing.assert_close(module(x), x @ weight.T + linear.bias)
    # and close to the full-precision layer (e4m3 keeps ~2 significant digits of each weight)
    exact = linear(x)
    assert float((module(x) - exact).norm() / exact.norm()) < 0.05


def test_unknown_quantization_and_backend_are_refused(tiny_model_dir):
    from slime.backends.embedded_engine.config import parse_args

    with pytest.raises(SystemExit, match="--quantization 'awq' is not supported"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "awq"])
    with pytest.raises(SystemExit, match="--fp8-gemm-backend 'marlin'"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "fp8", "--fp8-gemm-backend", "marlin"])
    for backend in ("triton", "cublas"):
        with pytest.raises(SystemExit, match=f"--fp8-gemm-backend {backend} runs on --device cuda"):
            parse_args(["--model-path", tiny_model_dir, "--quantization", "fp8", "--fp8-gemm-backend", backend])
    assert parse_args(["--model-path", tiny_model_dir, "--quantization", "fp8"]).quantization == "fp8"


def test_gemm_dispatch_table(monkeypatch):
    """``GEMM_DISPATCH``: every backend's ranges end open; auto takes the fused W8A8 kernel up to 16
    tokens, the two-kernel one up to 256 and above cuBLASLt where it runs and the shape qualifies (every
    Qwen3 linear does), else the two-kernel GEMM; weight_only is weight-only at every size (the H200's
    per-path timings, in fp8.py)."""
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    for backend, ranges in fp8.GEMM_DISPATCH.items():
        assert backend in fp8.GEMM_BACKENDS and ranges[-1][0] is None
        assert all(path in fp8.GEMM_PATHS for _, path in ranges)
    assert set(fp8.GEMM_DISPATCH) == set(fp8.GEMM_BACKENDS)
    expected = {"auto": ["fused", "fused", "two_kernel", "two_kernel", "two_kernel", "cublas", "cublas"],
                "weight_only": ["weight_only"] * 7,
                "triton": ["fused", "fused", "two_kernel", "two_kernel", "two_kernel", "two_kernel", "two_kernel"],
                "cublas": ["cublas"] * 7, "dequant": ["dequant"] * 7}
    for backend, paths in expected.items():
        assert [fp8.dispatch_path(backend, rows) for rows in (1, 16, 17, 128, 256, 257, 2048)] == paths, backend
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fp8_cublas, "available", lambda device: True)
    for out_features, in_features in [(2048, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (1024, 3072),
                                      (4096, 2560), (2560, 4096), (9728, 2560), (2560, 9728), (6144, 2048)]:
        assert fp8.gemm_path("auto", 2048, out_features, in_features, cuda) == "cublas"
        assert fp8.gemm_path("auto", 8, out_features, in_features, cuda) == "fused"
    assert fp8.gemm_path("auto", 2048, 200, 1024, cuda) == "two_kernel"  # N % 16
    assert fp8.gemm_path("auto", 2048, 1024, 384, cuda) == "two_kernel"  # K % 512
    monkeypatch.setattr(fp8_cublas, "available", lambda device: False)
    assert fp8.gemm_path("auto", 2048, 2048, 1024, cuda) == "two_kernel"
    assert fp8.gemm_path("cublas", 1, 2048, 1024, cuda) == "two_kernel"
    with pytest.raises(ValueError, match=r"--fp8-gemm-backend cublas .* cannot run here: it needs a CUDA device"):
        fp8.resolve_backend("cublas", torch.device("cpu"))


@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    return {q: ModelRunner(tiny_model_dir, num_slots=2, slot_capacity=64, quantization=q) for q in (None, "fp8")}


def test_decoder_linears_are_quantized_the_rest_is_not(runners):
    model = runners["fp8"].model
    kinds = {name.rsplit(".", 1)[-1] for name in runners["fp8"].fp8.linears}
    # gate/up (384 rows each: whole 128-row blocks) are one fused FP8 GEMM; q/k/v (k, v: 64 rows) stay apart,
    # since a block across two parts would make a part's update re-quantize its neighbour's rows
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert len(runners["fp8"].fp8.linears) == 6 * model.config.num_hidden_layers
    assert runners["fp8"].fused_projections == {"qkv": 0, "gate_up": model.config.num_hidden_layers}
    assert sorted(runners["fp8"].fp8.parts) == sorted(f"model.layers.{i}.mlp.{p}" for i in
                                                      range(model.config.num_hidden_layers) for p in ("gate_proj", "up_proj"))
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.float32
    # the decoder's linears shrink from 4 bytes (fp32 here) to 1 byte + a scale per 16384 elements
    linear_elements = sum(m.weight_fp8.numel() for m in runners["fp8"].fp8.linears.values())
    saved = runners[None].weight_bytes() - runners["fp8"].weight_bytes()
    assert 3 * linear_elements * 0.99 < saved < 3 * linear_elements, (saved, linear_elements)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight",  # [64, 128]: one ragged row of blocks
                                  "model.layers.1.mlp.up_proj.weight"])  # rows 384..768 of the fused gate_up
def test_get_weight_answers_the_dequantized_weight(runners, name):
    full, quantized = runners[None].get_weight(name), runners["fp8"].get_weight(name)
    assert quantized.shape == full.shape and quantized.dtype == torch.float32
    assert not torch.equal(quantized, full)
    values, scales = fp8_quantize.quantize_weight(full)
    assert torch.equal(quantized, fp8_numerics.dequantize_weight(values, scales))


def test_a_fused_part_updates_only_its_own_blocks(runners):
    runner = runners["fp8"]
    fused = runner.fp8.linears["model.layers.0.mlp.gate_up_proj"]
    values_before, scales_before = fused.weight_fp8.clone(), fused.weight_scale_inv.clone()
    gate = runner.get_weight("model.layers.0.mlp.gate_proj.weight").clone()
    new = torch.randn(gate.shape, generator=torch.Generator().manual_seed(7)) * 0.05
    assert runner.load_named_tensors([("model.layers.0.mlp.gate_proj.weight", new)]) == 1
    expected_values, expected_scales = fp8_quantize.quantize_weight(new)
    assert torch.equal(fused.weight_fp8[:384].view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(fused.weight_scale_inv[:3], expected_scales)
    # up_proj's rows and scales are untouched
    assert torch.equal(fused.weight_fp8[384:].view(torch.uint8), values_before[384:].view(torch.uint8))
    assert torch.equal(fused.weight_scale_inv[3:], scales_before[3:])
    # and the layer computes with the new gate: the fused GEMM's gate columns are x @ dequant(new)ᵀ
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(fused(x)[:, :384],
                               x @ fp8_numerics.dequantize_weight(expected_values, expected_scales).T)
    runner.load_named_tensors([("model.layers.0.mlp.gate_proj.weight", gate)])


def test_weight_update_quantizes_by_name_and_refuses_bad_names(runners):
    runner = runners["fp8"]
    name = "model.layers.0.mlp.down_proj.weight"
    original = runner.get_weight(name).clone()
    new = torch.randn(original.shape, generator=torch.Generator().manual_seed(5)) * 0.02
    storage = runner.fp8.linears["model.layers.0.mlp.down_proj"].weight_fp8
    before = storage.data_ptr()
    assert runner.load_named_tensors([(name, new.to(torch.bfloat16))]) == 1
    expected = fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(new.to(torch.bfloat16)))
    assert torch.equal(runner.get_weight(name), expected)
    assert storage.data_ptr() == before  # updated in place: captured CUDA graphs stay valid
    with pytest.raises(ValueError, match=r"expected shape \(128, 384\)"):
        runner.load_named_tensors([(name, new.T.contiguous())])
    with pytest.raises(KeyError, match="not a parameter"):
        runner.load_named_tensors([("model.layers.0.mlp.nope_proj.weight", new)])
    runner.load_named_tensors([(name, original)])


def test_disk_update_is_quantized(runners, tiny_model_dir, tmp_path):
    from engine_test_utils import copy_with_weights, perturbed_state_dict

    state = perturbed_state_dict(tiny_model_dir, seed=2)
    new_dir = copy_with_weights(tiny_model_dir, tmp_path / "new", state)
    runner = runners["fp8"]
    runner.load_from_disk(str(new_dir))
    name = "model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(runner.get_weight(name),
                       fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(state[name])))
    assert torch.equal(runner.get_weight("model.norm.weight"), state["model.norm.weight"])
    runner.load_from_disk(tiny_model_dir)


def test_moe_experts_are_quantized_and_updated_by_checkpoint_and_fused_names(tiny_deepseek_v3_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    from engine_test_utils import load_hf
    from slime.backends.embedded_engine.model_runner import ForwardRow

    runner = ModelRunner(tiny_deepseek_v3_dir, num_slots=2, slot_capacity=64, quantization="fp8")
    assert runner.fp8.experts, "the routed experts were not quantized"
    # the FP8 experts route and compute like transformers' fp32 ones, up to the FP8 rounding
    prompt = PROMPTS[2] + PROMPTS[0]
    _, (logits,) = runner.forward([0], [ForwardRow(prompt, 0, want_all_logits=True)])
    with torch.no_grad():
        reference = load_hf(tiny_deepseek_v3_dir)(torch.tensor([prompt])).logits[0]
    gap = (torch.log_softmax(logits, -1) - torch.log_softmax(reference, -1)).abs().mean()
    print(f"DeepSeek-V3 fp8 vs fp32: mean log-prob gap {float(gap):.4f}")
    assert 1e-5 < float(gap) < MAX_MEAN_LOGPROB_GAP, float(gap)
    prefix = next(iter(runner.fp8.experts))
    assert not any(name.endswith("kv_b_proj") for name in runner.fp8.linears)  # absorbed MLA reads it as a matrix
    assert not any(name.endswith(".gate") for name in runner.fp8.linears)
    # the graph-capturable dense form (every expert, zero weight where not routed) equals the routed loop
    experts = runner.fp8.experts[prefix]
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, experts.gate_fp8.shape[-1], generator=generator)
    picks = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=generator)
    torch.testing.assert_close(experts.dense_forward(hidden, picks, weights),
                               experts.routed_forward(hidden, picks, weights), rtol=1e-5, atol=1e-6)
    gate = runner.get_weight(f"{prefix}.3.gate_proj.weight")
    new_gate = torch.randn(gate.shape, generator=torch.Generator().manual_seed(0)) * 0.05
    runner.load_named_tensors([(f"{prefix}.3.gate_proj.weight", new_gate)])
    assert torch.equal(runner.get_weight(f"{prefix}.3.gate_proj.weight"),
                       fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(new_gate)))
    fused = runner.get_weight(f"{prefix}.gate_up_proj")
    assert torch.equal(fused[3, :gate.shape[0]], runner.get_weight(f"{prefix}.3.gate_proj.weight"))
    new_fused = torch.randn(fused.shape, generator=torch.Generator().manual_seed(1)) * 0.05
    runner.load_named_tensors([(f"{prefix}.gate_up_proj", new_fused)])
    half = fused.shape[1] // 2
    assert torch.equal(runner.get_weight(f"{prefix}.5.up_proj.weight"),
                       fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(new_fused[5, half:])))
    with pytest.raises(ValueError, match="expected shape"):
        runner.load_named_tensors([(f"{prefix}.gate_up_proj", new_fused[:, :half])])


def test_fp8_engine_greedy_decode_stays_close_to_fp32(runners, tiny_model_dir):
    from engine_test_utils import hf_greedy, hf_logprobs, load_hf

    hf = load_hf(tiny_model_dir)
    gaps, agree, total = [], 0, 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, _engine_greedy(runners["fp8"], PROMPTS)):
        reference = hf_greedy(hf, prompt, len(tokens))
        # tokens agree until the first flip (after it the continuations differ by construction)
        first_flip = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
        agree, total = agree + first_flip, total + len(tokens)
        gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens, 1.0))]
    mean_gap = sum(gaps) / len(gaps)
    print(f"fp8 vs fp32: mean log-prob gap {mean_gap:.4f}, max {max(gaps):.4f}, tokens before a flip {agree}/{total}")
    assert 1e-4 < mean_gap < MAX_MEAN_LOGPROB_GAP, mean_gap  # quantized (not fp32), and close to it
    assert agree >= total // 2, (agree, total)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["weight_only", "triton", "auto", "dequant"])
def test_gpu_fp8_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, backend):
    check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, "fp8", backend)


@pytest.mark.gpu
def test_gpu_fp8_moe_engine_decodes_through_cuda_graphs(tiny_deepseek_v3_dir):
    """FP8 routed experts switch to their dense form while a decode step is captured (no host sync)."""
    import httpx
    from engine_test_utils import hf_logprobs, load_hf
    from slime.backends.embedded_engine.serving.launch import running_engine

    hf = load_hf(tiny_deepseek_v3_dir)
    with running_engine(tiny_deepseek_v3_dir, extra_args=["--device", "cuda", "--context-length", "256",
                                                          "--max-running-requests", "8", "--quantization", "fp8"]) as proc, \
            httpx.Client(base_url=proc.url, timeout=120) as http:
        gaps = []
        for prompt in PROMPTS:
            tokens, logprobs = _greedy(http, prompt)
            gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens, 1.0))]
        assert http.get("/get_server_info").json()["internal_states"][0]["cuda_graph_captures"] > 0
    mean_gap = sum(gaps) / len(gaps)
    print(f"DeepSeek-V3 fp8 on CUDA: mean log-prob gap vs HF fp32 {mean_gap:.4f}")
    assert mean_gap < 2 * MAX_MEAN_LOGPROB_GAP, mean_gap


@needs_interpreter
@pytest.mark.parametrize("tokens", [20, 6])
def test_fp8_decoder_layers_with_quantizing_producers_equal_the_plain_path(monkeypatch, tokens):
    """A tiny Qwen3 under FP8 (``triton`` backend, fp32) through ``fused_ops``' decoder-layer forward:
    with ``FP8_QUANT_IN_PRODUCER`` the RMSNorms and the SiLU gate hand each projection its e4m3
    activations and the MLP's residual add runs in the down GEMM's epilogue — the logits are the same
    bits as without (20 tokens: the two-kernel GEMM; 6: the fused kernel, where nothing is handed over)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kernels import fused_projections

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    assert fused_projections.install(model, row_multiple=128) == {"qkv": 2, "gate_up": 2}
    weights = fp8_install.quantize_model(model, "triton")
    swap_in_fused_layer_forwards(model)
    offered, epilogue = [], []
    linear_forward = fp8.Fp8Linear.forward

    def spy(self, x, accumulate_into=None):
        offered.append(self._offered is not None and self._offered[0] is x)
        epilogue.append(accumulate_into is not None)
        return linear_forward(self, x, accumulate_into=accumulate_into)

    monkeypatch.setattr(fp8.Fp8Linear, "forward", spy)
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = model(ids).logits
        handed, added = sum(offered), sum(epilogue)
        monkeypatch.setattr(fused_ops, "FP8_QUANT_IN_PRODUCER", False)
        offered.clear(), epilogue.clear()
        plain = model(ids).logits
    assert sum(offered) == 0 and sum(epilogue) == 0
    # per layer: q/k/v, gate/up and down take handed-over activations, down adds the residual (o does not)
    assert (handed, added) == ((6, 2) if tokens > 16 else (0, 0))
    assert len(weights.linears) == 8
    assert torch.equal(fused, plain)
