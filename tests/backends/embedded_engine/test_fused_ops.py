"""The engine's fused Triton kernels (RMSNorm, rotary embedding, SiLU gate) against the Hugging Face
modules they replace, on CUDA (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def needs_triton():
    from slime.backends.embedded_engine import triton_attention

    if not (torch.cuda.is_available() and triton_attention.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")


def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 1, 1024), (3, 1, 16, 128), (2, 300, 2048)])
def test_rms_norm_matches_hf(dtype, shape):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from slime.backends.embedded_engine.fused_ops import rms_norm

    norm = Qwen3RMSNorm(shape[-1], eps=1e-6).to("cuda", dtype)
    norm.weight.data.normal_()
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,seq", [(128, 1), (2, 37)])
def test_rotary_matches_hf(dtype, batch, seq):
    from transformers.models.qwen3 import modeling_qwen3

    from slime.backends.embedded_engine.fused_ops import apply_rotary_pos_emb

    q = torch.randn(batch, seq, 16, 128, device="cuda", dtype=dtype).transpose(1, 2)  # HF's layout
    k = torch.randn(batch, seq, 8, 128, device="cuda", dtype=dtype).transpose(1, 2)
    angles = torch.rand(batch, seq, 64, device="cuda") * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    got = apply_rotary_pos_emb(q, k, cos, sin)
    want = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_gate_matches_torch(dtype):
    from slime.backends.embedded_engine.fused_ops import silu_mul

    gate = torch.randn(128, 1, 3072, device="cuda", dtype=dtype) * 4
    up = torch.randn_like(gate)
    torch.testing.assert_close(silu_mul(gate, up), torch.nn.functional.silu(gate) * up, **tolerance(dtype))


def test_install_patches_a_qwen3_model_and_keeps_its_outputs(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    from slime.backends.embedded_engine import fused_ops

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).to("cuda").eval()
    ids = torch.randint(5, 500, (3, 40), device="cuda")
    original_rope = modeling_qwen3.apply_rotary_pos_emb
    try:
        with torch.no_grad():
            before = model(ids).logits
            counts = fused_ops.install(model)
            after = model(ids).logits
    finally:  # install() patches the module function for the whole process (the engine owns its process)
        modeling_qwen3.apply_rotary_pos_emb = original_rope
    layers = model.config.num_hidden_layers
    assert counts == {"rmsnorm": 4 * layers + 1, "mlp": layers, "rope": 1}
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
