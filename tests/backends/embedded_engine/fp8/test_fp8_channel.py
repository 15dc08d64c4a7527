"""Per-channel FP8 (``--quantization w8a8_fp8``, ``fp8_channel.py``): the row quantizer's math, the Triton
token quantizer, the per-token quantizing norms and SiLU gate, and the per-channel Triton GEMM against it (under
the interpreter in ``scripts/test.sh``'s second pass; the GEMM also compiled for sm_90), the weight-update name
mapping over fused projections of any row counts, greedy decoding of a quantized tiny model, and, on a GPU, both
FP8 paths (``cutlass``: ``torch._scaled_mm`` row-wise; ``triton``) and the engine under CUDA graphs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slime.backends.embedded_engine.fp8 import channel as fp8_channel
from fp8_test_utils import (_SM90_COMPILE, MAX_MEAN_LOGPROB_GAP, PROMPTS, _engine_greedy,
                            check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs,
                            swap_in_fused_layer_forwards)

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


def test_backend_resolution_and_flags(tiny_model_dir, monkeypatch):
    from slime.backends.embedded_engine.config import parse_args

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fp8_channel.resolve_backend("auto", torch.device("cpu")) == "dequant"
    with pytest.raises(ValueError, match="'weight_only' with --quantization w8a8_fp8"):
        fp8_channel.resolve_backend("weight_only", torch.device("cpu"))
    with pytest.raises(ValueError, match="cutlass with --quantization w8a8_fp8 cannot run here: .*CUDA only"):
        fp8_channel.resolve_backend("cutlass", torch.device("cpu"))
    with pytest.raises(ValueError, match="triton with --quantization w8a8_fp8 cannot run here"):
        fp8_channel.resolve_backend("triton", torch.device("cpu"))
    assert parse_args(["--model-path", tiny_model_dir, "--quantization", "w8a8_fp8"]).quantization == "w8a8_fp8"
    for backend in ("cutlass", "triton"):
        with pytest.raises(SystemExit, match=f"--fp8-gemm-backend {backend} runs on --device cuda only"):
            parse_args(["--model-path", tiny_model_dir, "--quantization", "w8a8_fp8", "--fp8-gemm-backend", backend])
    with pytest.raises(ValueError, match="cublas with --quantization w8a8_fp8 cannot run here: .*CUDA only"):
        fp8_channel.resolve_backend("cublas", torch.device("cpu"))
    with pytest.raises(SystemExit, match="--fp8-gemm-backend cublas runs on --device cuda only"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "w8a8_fp8", "--fp8-gemm-backend", "cublas"])
    with pytest.raises(SystemExit, match="--fp8-gemm-backend weight_only is a block-wise"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "w8a8_fp8", "--fp8-gemm-backend",
                    "weight_only"])
    with pytest.raises(SystemExit, match="--fp8-gemm-backend cutlass is the per-channel"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "fp8", "--fp8-gemm-backend", "cutlass"])


@needs_interpreter
def test_auto_picks_cublas_else_triton_else_cutlass_for_bf16_on_sm90_else_dequant(monkeypatch):
    """``auto`` on a (pretended) CUDA device: ``cublas`` (cuBLASLt for the attention's projections, Triton for the
    rest: fastest on the H100, ``AUTO_ORDER``) where its start-up GEMM passed for the model's dtype, else the Triton
    GEMM, else — without Triton, which ``cublas`` needs too — ``cutlass`` for a bf16 model where the row-wise GEMM
    passed its check, else ``dequant``; below sm_89 (no e4m3 tensor cores) ``dequant``, and ``triton`` asked for by
    name is refused."""
    capability = [(9, 0)]
    problem = [None]
    unscaled_problem = {torch.float32: "torch._scaled_mm refused e4m3 operands with unit scales writing torch.float32"}
    triton_missing = [None]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fp8_channel, "_scaled_mm_problem", lambda index: problem[0])
    monkeypatch.setattr(fp8_channel, "_unscaled_mm_problem", lambda device, dtype: (
        f"cuBLASLt's FP8 GEMM needs sm_89 or newer; this GPU is sm_{capability[0][0]}{capability[0][1]}"
        if capability[0] < (8, 9) else unscaled_problem.get(dtype)))
    real_triton_problem = fp8_channel._triton_problem
    monkeypatch.setattr(fp8_channel, "_triton_problem",
                        lambda device: triton_missing[0] or real_triton_problem(device))
    cuda = torch.device("cuda", 0)
    assert fp8_channel.AUTO_ORDER == ("cublas", "triton", "cutlass")
    assert fp8_channel.resolve_backend("auto", cuda, torch.bfloat16) == "cublas"
    # fp16 cannot hold an unscaled product (one e4m3 x e4m3 product reaches 448^2 > 65504): refused before the probe
    assert fp8_channel.resolve_backend("auto", cuda, torch.float16) == "triton"
    with pytest.raises(ValueError, match="cublas with --quantization w8a8_fp8 cannot run here: its unscaled product "
                                         "is written in the model's dtype, and one product of two e4m3 values "
                                         r"\(up to 448 x 448\) already overflows torch.float16; use "
                                         "--fp8-gemm-backend triton or dequant"):
        fp8_channel.resolve_backend("cublas", cuda, torch.float16)
    assert fp8_channel.resolve_backend("auto", cuda, torch.float32) == "triton"  # cuBLASLt refused fp32 out
    triton_missing[0] = "it needs CUDA and the triton package"
    assert fp8_channel.resolve_backend("auto", cuda, torch.bfloat16) == "cutlass"
    assert fp8_channel.resolve_backend("auto", cuda, torch.float16) == "dequant"  # the row-wise call writes bf16
    with pytest.raises(ValueError, match="cublas with --quantization w8a8_fp8 cannot run here: the kernels that apply "
                                         "its scales are Triton's, and it needs CUDA and the triton package; use "
                                         "--fp8-gemm-backend cutlass or dequant"):
        fp8_channel.resolve_backend("cublas", cuda)
    problem[0] = "torch._scaled_mm refused row-wise scales: ..."
    assert fp8_channel.resolve_backend("auto", cuda, torch.bfloat16) == "dequant"
    with pytest.raises(ValueError, match="cutlass with --quantization w8a8_fp8 cannot run here: torch._scaled_mm.*; "
                                         "use --fp8-gemm-backend dequant"):
        fp8_channel.resolve_backend("cutlass", cuda)
    triton_missing[0], problem[0] = None, None
    capability[0] = (8, 0)
    problem[0] = "torch._scaled_mm's row-wise FP8 GEMM needs sm_89"
    assert fp8_channel.resolve_backend("auto", cuda, torch.bfloat16) == "dequant"
    with pytest.raises(ValueError, match="need sm_89 or newer; this GPU is sm_80"):
        fp8_channel.resolve_backend("triton", cuda)
    with pytest.raises(ValueError, match="cuBLASLt's FP8 GEMM needs sm_89 or newer; this GPU is sm_80; use "
                                         "--fp8-gemm-backend dequant"):
        fp8_channel.resolve_backend("cublas", cuda)


def test_cublas_check_refuses_what_the_gemm_will_not_run_or_gets_wrong(monkeypatch):
    """The ``cublas`` backend's start-up check: the scalar-scale GEMM writing the model's dtype against the
    dequantized reference (it passes with torch's own CPU kernel), a refusal by torch (fp32 out, say) or a wrong
    result named, sm_80 refused; ``--fp8-gemm-backend cublas`` on a (pretended) GPU then resolves to ``cublas`` or is
    refused with that reason and the way out, and ``auto`` takes the next path (``triton``) for a refused dtype."""
    check = fp8_channel._unscaled_mm_problem.__wrapped__  # uncached
    cpu = torch.device("cpu")
    assert check(cpu, torch.bfloat16) is None and check(cpu, torch.float32) is None
    # fp16 out: the unscaled sums of e4m3 products overflow it (inf against the reference); the backend refuses fp16
    # before this probe runs (test_auto_picks_cublas...), but the probe catches it too
    assert check(cpu, torch.float16) == "torch._scaled_mm's scalar-scale result is off the reference by inf (relative)"
    scaled_mm = torch._scaled_mm

    def refuse(*args, out_dtype, **kwargs):
        if out_dtype == torch.float32:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")
        return scaled_mm(*args, out_dtype=out_dtype, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert check(cpu, torch.bfloat16) is None
    assert check(cpu, torch.float32) == ("torch._scaled_mm refused e4m3 operands with unit scales writing "
                                         "torch.float32: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kwargs: scaled_mm(a, b, **kwargs) * 1.1)
    assert check(cpu, torch.bfloat16).startswith("torch._scaled_mm's scalar-scale result is off the reference by 0.1")
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert check(torch.device("cuda", 0), torch.bfloat16) == "cuBLASLt's FP8 GEMM needs sm_89 or newer; this GPU is sm_80"

    problem = [None]
    monkeypatch.setattr(fp8_channel, "_unscaled_mm_problem", lambda device, dtype: problem[0])
    monkeypatch.setattr(fp8_channel, "_triton_problem", lambda device: None)
    cuda = torch.device("cuda", 0)
    assert fp8_channel.resolve_backend("cublas", cuda, torch.bfloat16) == "cublas"
    assert fp8_channel.resolve_backend("auto", cuda, torch.bfloat16) == "cublas"
    problem[0] = "torch._scaled_mm refused e4m3 operands with unit scales writing torch.float32: ..."
    with pytest.raises(ValueError, match="cublas with --quantization w8a8_fp8 cannot run here: torch._scaled_mm "
                                         "refused .*; use --fp8-gemm-backend triton or dequant"):
        fp8_channel.resolve_backend("cublas", cuda, torch.float32)
    assert fp8_channel.resolve_backend("auto", cuda, torch.float32) == "triton"


@needs_interpreter
@pytest.mark.parametrize("rows,cols,dtype", [(5, 300, torch.float32), (3, 2500, torch.bfloat16),
                                             (4, 1024, torch.float32), (1, 7, torch.bfloat16)])
@pytest.mark.parametrize("one_pass", [True, False])
def test_token_quantizer_interpreted_is_bit_exact(rows, cols, dtype, one_pass, monkeypatch):
    """One program a row, the row held whole or read twice 1024 columns at a time (2500: three, the last
    ragged): the same e4m3 bytes and scales as the torch reference, including a zero row and values next to
    e4m3 rounding ties."""
    monkeypatch.setattr(fp8_channel, "QUANTIZE_ONE_PASS", fp8_channel.QUANTIZE_ONE_PASS if one_pass else 0)
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


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_moe_experts_are_quantized_per_channel_and_updated_by_checkpoint_and_fused_names(
        arch, tiny_deepseek_v3_dir, tiny_qwen3_moe_dir):
    """Routed experts under ``w8a8_fp8``: one scale per output channel of each expert's gate, up and down
    (``[E, N, 1]``); the model's log-probs within the FP8 bound of transformers' fp32 ones; the graph-capturable
    dense form equal to the routed loop; an update by checkpoint name (one expert's gate) and by the fused
    ``gate_up_proj`` re-quantizing exactly those rows, per channel; a wrong shape refused by name."""
    from engine_test_utils import load_hf
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

    model_dir = tiny_deepseek_v3_dir if arch == "deepseek_v3" else tiny_qwen3_moe_dir
    runner = ModelRunner(model_dir, num_slots=2, slot_capacity=64, quantization="w8a8_fp8")
    assert runner.fp8.experts and all(isinstance(m, fp8_channel.ChannelFp8Experts)
                                      for m in runner.fp8.experts.values())
    prefix, experts = next(iter(runner.fp8.experts.items()))
    num, inter, hidden = experts.gate_fp8.shape
    assert experts.gate_scale.shape == (num, inter, 1) and experts.down_scale.shape == (num, hidden, 1)
    prompt = PROMPTS[2] + PROMPTS[0]
    _, (logits,) = runner.forward([0], [ForwardRow(prompt, 0, want_all_logits=True)])
    with torch.no_grad():
        reference = load_hf(model_dir)(torch.tensor([prompt])).logits[0]
    gap = float((torch.log_softmax(logits, -1) - torch.log_softmax(reference, -1)).abs().mean())
    print(f"{arch} w8a8_fp8 vs fp32: mean log-prob gap {gap:.4f}")
    assert 1e-5 < gap < MAX_MEAN_LOGPROB_GAP, gap
    generator = torch.Generator().manual_seed(4)
    states = torch.randn(6, hidden, generator=generator)
    picks = torch.stack([torch.randperm(num, generator=generator)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=generator)
    torch.testing.assert_close(experts.dense_forward(states, picks, weights),
                               experts.routed_forward(states, picks, weights), rtol=1e-5, atol=1e-6)
    name = f"{prefix}.3.gate_proj.weight"
    before_up = experts.up_fp8.clone()
    new_gate = torch.randn(inter, hidden, generator=torch.Generator().manual_seed(0)) * 0.05
    runner.load_named_tensors([(name, new_gate)])
    assert torch.equal(runner.get_weight(name), fp8_channel.dequantize(*fp8_channel.quantize_rows(new_gate)))
    assert torch.equal(experts.gate_scale[3], fp8_channel.quantize_rows(new_gate)[1])
    assert torch.equal(experts.up_fp8.view(torch.uint8), before_up.view(torch.uint8))
    new_fused = torch.randn(num, 2 * inter, hidden, generator=torch.Generator().manual_seed(1)) * 0.05
    runner.load_named_tensors([(f"{prefix}.gate_up_proj", new_fused)])
    assert torch.equal(runner.get_weight(f"{prefix}.5.up_proj.weight"),
                       fp8_channel.dequantize(*fp8_channel.quantize_rows(new_fused[5, inter:])))
    assert torch.equal(runner.get_weight(f"{prefix}.gate_up_proj")[2, :inter],
                       fp8_channel.dequantize(*fp8_channel.quantize_rows(new_fused[2, :inter])))
    with pytest.raises(ValueError, match="expected shape"):
        runner.load_named_tensors([(f"{prefix}.gate_up_proj", new_fused[:, :inter])])


# ---------------------------------------------------------------------------------- CUDA (skipped without it)
def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU (torch._scaled_mm's row-wise FP8 GEMM)")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cutlass", "triton"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 2560, 4096), (128, 19456, 2560), (77, 3072, 1024),
                                                           (16, 2560, 9728)])
def test_gpu_channel_gemm_equals_reference_and_replays_in_a_cuda_graph(rows, out_features, in_features, backend):
    """Both FP8 paths on the GPU against the fp32 reference (bf16 out: within 1% of the output's peak), captured
    in a CUDA graph and replayed on new activations; the Triton one also with the residual in its epilogue."""
    _needs_sm90()
    assert fp8_channel.resolve_backend("auto", torch.device("cuda")) == "cublas"  # AUTO_ORDER: the H100 A/B
    assert fp8_channel.resolve_backend(backend, torch.device("cuda")) == backend
    # fp16: the unscaled e4m3 product overflows it (the H100 run of session 29 found this assert wrong as "cublas")
    assert fp8_channel.resolve_backend("auto", torch.device("cuda"), torch.float16) == "triton"
    assert fp8_channel._unscaled_mm_problem(torch.device("cuda", torch.cuda.current_device()), torch.float16) \
        is not None  # and the probe catches it on the GPU too (an overflowed or refused GEMM)
    with pytest.raises(ValueError, match="writes bf16 and this model runs in torch.float16"):
        fp8_channel.resolve_backend("cutlass", torch.device("cuda"), torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    values, scales = fp8_channel.quantize_rows(torch.randn(out_features, in_features, generator=gen, device="cuda")
                                               / in_features**0.5)
    x = torch.randn(rows, in_features, generator=gen, device="cuda").to(torch.bfloat16)
    x8, x_scales = fp8_channel.quantize_tokens(x)
    reference_x8, reference_scales = fp8_channel.quantize_rows(x)
    assert torch.equal(x8.view(torch.uint8), reference_x8.view(torch.uint8)) and torch.equal(x_scales,
                                                                                             reference_scales)
    expected = fp8_channel.reference_matmul(x, values, scales)
    out = fp8_channel.channel_linear(x, values, scales, None, backend)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - expected).abs().max() / expected.abs().max()) < 1e-2
    residual = torch.randn(rows, out_features, generator=gen, device="cuda").to(torch.bfloat16)
    total = fp8_channel.channel_linear(x, values, scales, None, backend, accumulate_into=residual.clone())
    assert float((total.float() - residual.float() - expected).abs().max() / expected.abs().max()) < 1.5e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_channel.channel_linear(x, values, scales, None, backend)
    x.copy_(torch.randn(rows, in_features, generator=gen, device="cuda"))
    graph.replay()
    expected = fp8_channel.reference_matmul(x, values, scales)
    assert float((captured.float() - expected).abs().max() / expected.abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,out_features,in_features", [(128, 6144, 2560), (128, 2560, 4096), (3, 272, 384)])
def test_gpu_unscaled_gemm_scaled_after_equals_reference_and_replays_in_a_cuda_graph(rows, out_features, in_features,
                                                                                     out_dtype):
    """The ``cublas`` backend's GEMM on the GPU (cuBLASLt, unit scales) at Qwen3-4B's q/k/v and o shapes: scaled
    afterwards it is the reference within 1% of the output's peak, and it replays in a CUDA graph on new e4m3
    activations."""
    _needs_sm90()
    assert fp8_channel.resolve_backend("cublas", torch.device("cuda")) == "cublas"
    gen = torch.Generator(device="cuda").manual_seed(rows)
    values, scales = fp8_channel.quantize_rows(torch.randn(out_features, in_features, generator=gen, device="cuda")
                                               / in_features**0.5)
    x = torch.randn(rows, in_features, generator=gen, device="cuda").to(out_dtype)
    x8, x_scales = fp8_channel.quantize_tokens(x)
    raw = fp8_channel.unscaled_mm(x8, values, out_dtype)
    assert raw.dtype == out_dtype and raw.shape == (rows, out_features)
    expected = fp8_channel.reference_matmul(x, values, scales)
    out = fp8_channel.apply_scales(raw, (x_scales, scales)).float()
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_channel.unscaled_mm(x8, values, out_dtype)
    new8, new_scales = fp8_channel.quantize_tokens(torch.randn(rows, in_features, generator=gen, device="cuda"))
    x8.copy_(new8)
    graph.replay()
    expected = fp8_channel.dequantize(new8, torch.ones_like(new_scales)) @ values.float().t()
    assert float((captured.float() - expected).abs().max() / expected.abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "cutlass", "triton", "cublas", "dequant"])
def test_gpu_w8a8_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, backend):
    _needs_sm90()
    check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, "w8a8_fp8", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cutlass", "triton"])
def test_gpu_w8a8_moe_engine_decodes_through_cuda_graphs(tiny_deepseek_v3_dir, backend):
    """Per-channel routed experts switch to their dense form while a decode step is captured (no host sync)."""
    import httpx
    from engine_test_utils import hf_logprobs, load_hf
    from slime.backends.embedded_engine.serving.launch import running_engine
    from fp8_test_utils import _greedy

    _needs_sm90()
    hf = load_hf(tiny_deepseek_v3_dir)
    with running_engine(tiny_deepseek_v3_dir, extra_args=["--device", "cuda", "--context-length", "256",
                                                          "--max-running-requests", "8", "--quantization", "w8a8_fp8",
                                                          "--fp8-gemm-backend", backend]) as proc, \
            httpx.Client(base_url=proc.url, timeout=120) as http:
        gaps = []
        for prompt in PROMPTS:
            tokens, logprobs = _greedy(http, prompt)
            gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens, 1.0))]
        assert http.get("/get_server_info").json()["internal_states"][0]["cuda_graph_captures"] > 0
    mean_gap = sum(gaps) / len(gaps)
    print(f"DeepSeek-V3 w8a8_fp8 {backend} on CUDA: mean log-prob gap vs HF fp32 {mean_gap:.4f}")
    assert mean_gap < 2 * MAX_MEAN_LOGPROB_GAP, mean_gap


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
    torch.testing.assert_close(fp8_channel.channel_linear(x, values, scales, None, "cutlass"), expected)
    ragged_values, ragged_scales = fp8_channel.quantize_rows(torch.randn(40, 20, generator=gen))
    fp8_channel.channel_linear(x[:, :20].bfloat16(), ragged_values, ragged_scales, None, "cutlass")
    assert calls == []  # fp32 in, then K = 20: both on the dequantized weight
    out = fp8_channel.channel_linear(x.bfloat16()[None], values, scales, None, "cutlass")
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
    from slime.backends.embedded_engine.kernels import fused_ops

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
@pytest.mark.parametrize("backend,dtype", [("cutlass", torch.bfloat16), ("triton", torch.float32)])
def test_decoder_layers_with_per_token_producers_equal_the_plain_path(monkeypatch, backend, dtype):
    """A tiny Qwen3 under ``w8a8_fp8`` through ``fused_ops``' decoder-layer forward, on the row-wise
    ``torch._scaled_mm`` (``cutlass``: it runs row-wise scales on the CPU too; bf16) and on the per-channel Triton
    GEMM (interpreted; fp32, where an add in the epilogue rounds as the separate add does): with
    ``FP8_QUANT_IN_PRODUCER`` the two RMSNorms and the SiLU gate hand q/k/v, gate/up and down their per-token
    e4m3 activations and the down projection takes the residual — the logits are the same bits as without."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.backends.embedded_engine.fp8 import install as fp8_install
    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kernels import fused_projections

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    assert fused_projections.install(model, row_multiple=1) == {"qkv": 2, "gate_up": 2}
    fp8_install.quantize_model(model, backend, per_channel=True)
    swap_in_fused_layer_forwards(model)
    offered, epilogue = [], []
    linear_forward = fp8_channel.ChannelFp8Linear.forward

    def spy(self, x, accumulate_into=None):
        offered.append(self._offered is not None and self._offered[0] is x)
        epilogue.append(accumulate_into is not None)
        return linear_forward(self, x, accumulate_into=accumulate_into)

    monkeypatch.setattr(fp8_channel.ChannelFp8Linear, "forward", spy)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = model(ids).logits
        handed, added = sum(offered), sum(epilogue)
        monkeypatch.setattr(fused_ops, "FP8_QUANT_IN_PRODUCER", False)
        offered.clear(), epilogue.clear()
        plain = model(ids).logits
    assert (handed, added) == (6, 2) and sum(offered) == sum(epilogue) == 0  # per layer: q/k/v, gate/up, down
    assert torch.equal(fused, plain)


@needs_interpreter
@pytest.mark.parametrize("rows,width,dtype", [(4, 2500, torch.bfloat16), (3, 384, torch.float32),
                                              (1, 1024, torch.bfloat16)])
@pytest.mark.parametrize("one_pass", [True, False], ids=["row_held_whole", "two_passes"])
def test_silu_gate_quantizes_per_token_like_the_quantizer(rows, width, dtype, one_pass, monkeypatch):
    """``fused_ops.silu_mul_packed(quantize="token")`` (one program a row, held whole or, past
    ``SILU_TOKEN_ONE_PASS``, in slices — 2500 channels: three, the last ragged) returns the same output as without and exactly :func:`fp8_channel.quantize_tokens` of it, a zero row
    scaled 1: the down projection's GEMM reads what its own quantize launch would have made."""
    from slime.backends.embedded_engine.kernels import fused_ops

    if not one_pass:
        monkeypatch.setattr(fused_ops, "SILU_TOKEN_ONE_PASS", 256)
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 3).to(dtype)
    gate_up[-1, :width] = 0  # silu(0) * up = 0: a zero row
    out, (values, scales) = fused_ops.silu_mul_packed(gate_up, quantize="token")
    assert torch.equal(out, fused_ops.silu_mul_packed(gate_up))
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate_up[:, :width].float()) * gate_up[:, width:]
                               .float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    want_values, want_scales = fp8_channel.quantize_tokens(out)
    assert scales.shape == (rows, 1) and torch.equal(scales, want_scales) and scales[-1] == 1.0
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert values.float().abs().amax(1)[:-1].eq(448).all()


def _channel_case(rows: int, out_features: int, in_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * torch.logspace(-2, 0, out_features)[:, None]
    values, scales = fp8_channel.quantize_rows(weight)
    x = torch.randn(rows, in_features, generator=gen) * torch.logspace(-1, 1, rows)[:, None]
    return x, values, scales


@needs_interpreter
@pytest.mark.parametrize("rows,out_features,in_features,tiles,tma", [
    (5, 96, 384, None, True),  # the planned launch (16-row tiles), loaded by TMA
    (20, 80, 512, (64, 64, 2), True),  # split K, a ragged column tile
    (20, 80, 512, (64, 64, 2), False),  # the same by pointer loads
    (70, 80, 512, (64, 32, 2), True),  # the sweep's 32-column tiles: two row tiles, a ragged column tile
    (3, 48, 300, None, False)])  # K = 300: rows not 16-byte aligned, pointer loads, a ragged K step
def test_channel_triton_gemm_interpreted_equals_reference(monkeypatch, rows, out_features, in_features, tiles, tma):
    """``fp8_channel.triton_matmul`` (``_fp8_gemm_kernel`` with ``PER_CHANNEL``: the token's and the channel's
    scales applied once, after the K loop) against :func:`fp8_channel.reference_matmul` (the dequantized operands
    multiplied in fp32), in fp32 out: equal to fp32 rounding (a scale applied per K step, a wrong row's or
    column's scale, or a lost split are off by far more); the residual added in the epilogue; and the same bits
    from activations quantized by their producer as from its own quantize launch."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    monkeypatch.setattr(fp8_triton, "USE_TMA", tma)
    x, values, scales = _channel_case(rows, out_features, in_features, seed=rows + in_features)
    assert fp8_triton.tma_usable(fp8_channel.quantize_tokens(x)[0], values) == tma
    if tiles is not None:
        tiles = fp8_triton.Tiles(*tiles, num_warps=4, num_stages=3)
    expected = fp8_channel.reference_matmul(x, values, scales)
    out = fp8_channel.triton_matmul(x, values, scales, torch.float32, tiles=tiles)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    again = fp8_channel.triton_matmul(x, values, scales, torch.float32, quantized=fp8_channel.quantize_rows(x),
                                      tiles=tiles)
    assert torch.equal(again, out)
    residual = torch.randn(rows, out_features, generator=torch.Generator().manual_seed(9))
    total = residual.clone()
    assert fp8_channel.triton_matmul(x, values, scales, torch.float32, accumulate_into=total, tiles=tiles) is total
    torch.testing.assert_close(total, residual + expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@needs_interpreter
def test_channel_triton_linear_interpreted_bf16_with_bias_and_refusals(monkeypatch):
    """The ``triton`` backend through ``channel_linear``: bf16 activations with a leading batch dimension and a
    bias, within a bf16 rounding of the fp32 reference; an offered quantization of the wrong layout is refused by
    name, not misread."""
    x, values, scales = _channel_case(6, 64, 256, seed=2)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = fp8_channel.channel_linear(x.to(torch.bfloat16)[None], values, scales, bias, "triton")
    assert out.shape == (1, 6, 64) and out.dtype == torch.bfloat16
    expected = fp8_channel.reference_matmul(x.to(torch.bfloat16), values, scales) + bias.float()
    torch.testing.assert_close(out[0].float(), expected, rtol=2**-7, atol=2**-7 * float(expected.abs().max()))
    x8, _ = fp8_channel.quantize_tokens(x)
    with pytest.raises(ValueError, match="one contiguous scale a token"):
        fp8_channel.triton_matmul(x, values, scales, torch.float32, quantized=(x8, torch.ones(6, 2)))


@needs_interpreter
def test_channel_gemm_compiles_for_h200_keeping_a_wgmma_in_flight(tmp_path):
    """The per-channel GEMM compiled for sm_90 by Triton's own ptxas, without a GPU, at the launches the plan
    gives Qwen3 decode shapes (64 x 64 five stages, 64 x 128 split two ways, 16-row tiles) and the largest and
    narrowest the channel sweep tries (128 x 128 on 8 warps, split two ways, four stages; 64 x 32, six stages):
    Hopper's e4m3 wgmma
    loaded by TMA, and — the point of applying the scales after the K loop — a wait that leaves one wgmma group
    in flight inside the loop (the block-scaled kernel waits on every K step's: test_fp8), no register spills.
    16-row tiles take mma.sync, as in the block-scaled kernel."""
    import json
    import subprocess
    import sys

    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not os.path.exists(os.path.join(os.path.dirname(fp8_triton.triton.__file__), "backends", "nvidia", "bin",
                                       "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    tiles = [(64, 64, 1, 4, 1, 1, 5, 1), (64, 128, 2, 4, 1, 1, 4, 1), (16, 128, 4, 4, 1, 1, 4, 1),
             (128, 128, 2, 8, 1, 1, 4, 1),  # and the sweep's largest: 128 rows on two warp groups, split K
             (64, 32, 1, 4, 1, 1, 6, 1)]  # and its narrowest, six stages deep
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_BACKENDS_IN_TREE="1", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", _SM90_COMPILE, json.dumps(tiles), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])[:-1]  # the last entry: the block-wise quantizer
    assert [entry["tiles"] for entry in report] == [list(t[:7]) for t in tiles]
    for entry in report:
        assert entry["stack"] == 0 and entry["tma_loads"] and not entry["gpu_e4m3_cast"], entry
        if entry["tiles"][0] >= 64:
            assert entry["fp8_wgmma"] and entry["wgmma_waits"] == [0, 1], entry
        else:
            assert entry["mma_sync"] and entry["wgmma_waits"] == [], entry


def test_warm_up_compiles_every_launch_of_the_channel_gemm(monkeypatch):
    """``fp8_install.warm_up`` on ``w8a8_fp8`` linears on the ``triton`` path runs the per-channel GEMM (and its
    epilogue-add variant) once per distinct launch of each weight shape, however many layers share it, and every
    token count up to the limit maps to a launch it ran: no decode bucket or prefill compiles mid-rollout."""
    from torch import nn

    from slime.backends.embedded_engine.fp8 import install as fp8_install
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if fp8_triton.triton is None:
        pytest.skip("needs triton (the tile planners)")
    monkeypatch.setattr(fp8_triton, "available", lambda device: True)
    monkeypatch.setattr(fp8_channel.ChannelFp8Linear, "forward", lambda self, x, accumulate_into=None: None)
    ran = []
    monkeypatch.setattr(fp8_install, "_warm_up_channel_gemm", lambda values, scales, dtype, rows: ran.append(
        (rows, *values.shape)))
    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.ModuleDict({"up": nn.Linear(256, 1024, bias=False), "down": nn.Linear(1024, 256, bias=False)})
        for _ in range(3))})
    weights = fp8_install.quantize_model(model, "triton", per_channel=True)
    count, _ = fp8_install.warm_up(weights, max_rows=600)
    assert count == len(ran) + 1  # and the first linear's call: the token quantizer
    cpu = torch.device("cpu")
    for n, k in ((1024, 256), (256, 1024)):
        tma = fp8_triton.tma_usable_for(weights.linears["layers.0.up" if n == 1024 else "layers.0.down"].weight_fp8)
        launched = [fp8_triton.launch_key("two_kernel", rows, n, k, cpu, tma) for rows, rn, rk in ran
                    if (rn, rk) == (n, k)]
        assert len(launched) == len(set(launched)) < 60
        assert set(launched) == {fp8_triton.launch_key("two_kernel", rows, n, k, cpu, tma) for rows in range(1, 601)}


def _cublas_linear(in_features: int, out_features: int, seed: int, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
    return fp8_channel.ChannelFp8Linear(linear.bfloat16(), "cublas")


def test_cublas_linear_leaves_its_product_unscaled_only_for_an_announced_reader(monkeypatch):
    """``--fp8-gemm-backend cublas`` under w8a8_fp8: ``forward_unscaled`` is cuBLASLt's scalar-scale GEMM (unit
    scales) of the per-token e4m3 activations — with :func:`fp8_channel.apply_scales` it is the per-channel product
    to the product's bf16 rounding — and the call announced by ``defer_scales_once`` returns that unscaled product
    and hands its scales over once, to the very tensor only; other calls (unannounced, too many tokens, a bias)
    take the fallback path and come back scaled."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fp8_channel.fallback_backend(torch.device("cpu")) == "cutlass"  # no Triton here: torch's row-wise GEMM
    linear = _cublas_linear(256, 384, seed=0)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    reference = fp8_channel.reference_matmul(x.view(10, 256), linear.weight_fp8, linear.weight_scale)
    raw, scales = linear.forward_unscaled(x)
    assert raw.shape == (2, 5, 384) and raw.dtype == torch.bfloat16
    assert scales[0].shape == (10, 1) and scales[1] is linear.weight_scale
    assert raw.float().abs().max() > 50 * reference.abs().max()  # unscaled: e4m3 numbers up to 448
    scaled = fp8_channel.apply_scales(raw, scales)
    torch.testing.assert_close(scaled.view(10, 384).float(), reference, atol=1e-4, rtol=2**-7)  # two bf16 roundings
    torch.testing.assert_close(linear(x).float(), scaled.float(), atol=1e-3, rtol=2**-7)  # the fallback, scaled

    assert linear.take_scales(raw) is None  # nothing announced
    linear.defer_scales_once()
    out = linear(x)
    assert torch.equal(out, raw) and linear.take_scales(out)[0].shape == (10, 1)
    assert linear.take_scales(out) is None  # handed over once
    linear.defer_scales_once()
    out = linear(x)
    with pytest.raises(RuntimeError, match="unscaled product did not reach the residual add"):
        linear.take_scales(out.clone())
    assert torch.equal(linear(x), linear(x)) and not torch.equal(linear(x), raw)  # the announcement was used up

    assert [linear.defers_scales(rows, x.device) for rows in (0, 1, 512, 513)] == [False, True, True, False]
    linear.defer_scales_once()
    out = linear(torch.randn(513, 256).bfloat16())  # past DEFERRED_MAX_ROWS: the fallback, scaled
    assert out.float().abs().max() < 50 * reference.abs().max() and linear.take_scales(out) is None
    assert not _cublas_linear(256, 384, seed=0, bias=True).defers_scales(10, x.device)
    assert not _cublas_linear(256, 388, seed=0).defers_scales(10, x.device)  # N not a multiple of 16


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_readers_of_an_unscaled_product_scale_it_as_apply_scales_does(dtype):
    """The kernels that read the ``cublas`` backend's unscaled products apply the token and channel scales as
    they load them, bit for bit as :func:`fp8_channel.apply_scales` followed by the plain kernel: the residual add
    + RMSNorm (also quantizing its output per token), the q/k norm + rotary kernel with and without its cache
    write (keys, values and queries); scales of the wrong shape are refused by name. (In bf16 to one rounding:
    Triton's interpreter truncates fp32 -> bf16 casts where the GPU and torch round to nearest.)"""
    from slime.backends.embedded_engine.kernels import fused_ops

    def same(got, want):
        if dtype == torch.float32:
            return torch.equal(got, want)
        return torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-7 * float(want.float().abs().max()))

    gen = torch.Generator().manual_seed(3)
    tokens, hidden = 6, 256
    raw = (torch.randn(tokens, hidden, generator=gen) * 300).to(dtype)
    scales = (torch.rand(tokens, 1, generator=gen) * 1e-2 + 1e-4, torch.rand(hidden, 1, generator=gen) * 1e-2 + 1e-4)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    scaled = fp8_channel.apply_scales(raw, scales)
    got = fused_ops.add_rms_norm(raw, residual, weight, 1e-6, quantize="token", x_scales=scales)
    want = fused_ops.add_rms_norm(scaled, residual, weight, 1e-6, quantize="token")
    assert same(got[0], want[0]) and same(got[1], want[1]) and same(got[2][1], want[2][1])
    if dtype == torch.float32:
        assert torch.equal(got[2][0].view(torch.uint8), want[2][0].view(torch.uint8))
    assert not same(fused_ops.add_rms_norm(raw, residual, weight, 1e-6)[1], want[1])
    with pytest.raises(ValueError, match=r"contiguous fp32 \[6, 1\] and \[256, 1\] expected"):
        fused_ops.add_rms_norm(raw, residual, weight, 1e-6, x_scales=(scales[0], scales[1][:128]))

    q_heads, kv_heads, dim, batch, seq = 4, 2, 64, 2, 3
    width = (q_heads + 2 * kv_heads) * dim
    qkv = (torch.randn(batch, seq, width, generator=gen) * 300).to(dtype)
    qkv_scales = (torch.rand(batch * seq, 1, generator=gen) * 1e-2 + 1e-4,
                  torch.rand(width, 1, generator=gen) * 1e-2 + 1e-4)
    angles = torch.rand(1, seq, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    norms = (torch.randn(dim, generator=gen).to(dtype), torch.randn(dim, generator=gen).to(dtype))
    plain = fused_ops.qk_norm_rope(fp8_channel.apply_scales(qkv, qkv_scales), q_heads, kv_heads, cos, sin, *norms)
    fused = fused_ops.qk_norm_rope(qkv, q_heads, kv_heads, cos, sin, *norms, scales=qkv_scales)
    assert same(fused[0], plain[0]) and same(fused[1], plain[1])
    assert not same(fused_ops.qk_norm_rope(qkv, q_heads, kv_heads, cos, sin, *norms)[1], plain[1])

    def cache_write():
        keys, values = (torch.zeros(3, kv_heads, 8, dim, dtype=dtype) for _ in range(2))
        return keys, values, torch.tensor([2, 2, 2, 0, 0, 0]), torch.tensor([4, 5, 6, 0, 1, 2]), 1.0, 1.0

    want_cache, got_cache = cache_write(), cache_write()
    want_query, _ = fused_ops.qk_norm_rope(fp8_channel.apply_scales(qkv, qkv_scales), q_heads, kv_heads, cos, sin,
                                           *norms, cache_write=want_cache)
    got_query, _ = fused_ops.qk_norm_rope(qkv, q_heads, kv_heads, cos, sin, *norms, cache_write=got_cache,
                                          scales=qkv_scales)
    assert same(got_query, want_query) and want_cache[1].abs().sum() > 0
    assert same(got_cache[0], want_cache[0]) and same(got_cache[1], want_cache[1])


@needs_interpreter
def test_cublas_decode_steps_scale_in_the_readers_and_keep_the_logits(tiny_model_dir, monkeypatch):
    """A w8a8_fp8 engine's decode steps on the ``cublas`` backend with the CUDA path's fused kernels (interpreted):
    in every layer of every step the q/k/v and output projections leave their products unscaled, read by the
    norm + rotary kernel (which also writes the cache) and by the residual add + RMSNorm, and every layer but the
    last hands its down projection's unscaled product to the next layer's input RMSNorm — and the logits are the
    fallback path's (every GEMM scaling its own product) to fp32 rounding, over a prompt and three steps; also with
    the prompt's forward too long to defer (its layers scale their own products, the steps after it hand theirs
    on), and with the down hand-off switched off (``fused_ops.DOWN_SCALES_TO_NEXT_LAYER``)."""
    import types

    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kv_cache import DecodeCacheView
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

    unscaled = []
    forward_unscaled = fp8_channel.ChannelFp8Linear.forward_unscaled

    def spy(self, x):
        unscaled.append(self.out_features if self.in_features != intermediate else "down")
        return forward_unscaled(self, x)

    def run(max_rows: int, down_hand_off: bool = True) -> list[torch.Tensor]:
        unscaled.clear()
        monkeypatch.setattr(fp8_channel.ChannelFp8Linear, "forward_unscaled", spy)
        monkeypatch.setattr(fp8_channel, "DEFERRED_MAX_ROWS", max_rows)
        monkeypatch.setattr(fused_ops, "DOWN_SCALES_TO_NEXT_LAYER", down_hand_off)
        monkeypatch.setattr(DecodeCacheView, "fused_write_target", lambda view, layer_idx: (
            view.cache.keys[layer_idx], view.cache.values[layer_idx], view.rows, view.positions,
            view.cache.k_scales[layer_idx], view.cache.v_scales[layer_idx]))
        runner = ModelRunner(tiny_model_dir, num_slots=3, slot_capacity=32, quantization="w8a8_fp8")
        for module in runner.fp8.linears.values():
            module.backend = "cublas"
        swap_in_fused_layer_forwards(runner.model)
        for module in runner.model.modules():
            if hasattr(module, "qkv_proj"):
                module.fused_norm_rope = types.MethodType(fused_ops._attention_norm_rope, module)
        prompts = [[5, 17, 33, 2, 91, 40], [7, 7, 8], [60, 1, 2, 3, 4, 5, 6, 9]]
        logits, _ = runner.forward([0, 1, 2], [ForwardRow(p, 0) for p in prompts])
        tokens, positions, out = [int(t) for t in logits.argmax(-1)], [len(p) for p in prompts], [logits]
        for _ in range(3):
            step = runner.decode(tokens, positions)
            out.append(step)
            tokens, positions = [int(t) for t in step.argmax(-1)], [p + 1 for p in positions]
        monkeypatch.undo()
        return out

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    intermediate = config.intermediate_size
    qkv_width = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    layer_calls = [qkv_width, config.hidden_size, "down"]  # q/k/v, o, and the down projection handed on
    forward_calls = layer_calls * (config.num_hidden_layers - 1) + layer_calls[:2]  # the last layer adds its own
    fallback = run(0)
    assert unscaled == []
    for max_rows, down_hand_off, calls in [
            (512, True, forward_calls * 4),  # the prompt's forward (17 tokens) and three steps
            (8, True, forward_calls * 3),  # the prompt's forward scales its own products
            (512, False, [qkv_width, config.hidden_size] * config.num_hidden_layers * 4)]:
        deferred = run(max_rows, down_hand_off)
        assert unscaled == calls, (max_rows, down_hand_off)
        for want, got in zip(fallback, deferred):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_decode_step_bench_switch_reaches_the_captured_graphs(tiny_model_dir, tmp_path):
    """``bench/decode_step.py --without down_hand_off`` times graphs captured with the switch off: the runner
    captures its decode graphs at start, before the bench applies its switches (session 29's A/B timed the same
    graphs twice). With the hand-off every layer's down projection but the last runs on cuBLASLt, without it all
    of them run on the Triton GEMM beside gate/up: the profiled step has ``layers - 1`` more Triton GEMMs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    _needs_sm90()
    root = Path(__file__).resolve().parents[3]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    counts = {}
    for name, extra in (("with", []), ("without", ["--without", "down_hand_off"])):
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, str(root / "bench" / "decode_step.py"), "--model-path", tiny_model_dir,
                        "--device", "cuda", "--quantization", "w8a8_fp8", "--fp8-gemm-backend", "cublas",
                        "--batch", "8", "--position", "15", "--steps", "3", "--profile-steps", "2", *extra,
                        "--out", str(out)], check=True, cwd=root, env={**os.environ, "PYTHONPATH": path})
        metrics = json.loads(out.read_text())["metrics"]
        assert metrics["cuda_graph"]
        counts[name] = sum(row["count"] for row in metrics["top_kernels"] if row["name"].startswith("_fp8_gemm_kernel"))
    layers = json.loads((Path(tiny_model_dir) / "config.json").read_text())["num_hidden_layers"]
    assert counts == {"with": layers + 1, "without": 2 * layers}, counts
