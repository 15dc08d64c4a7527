"""The engine's fused Triton kernels (RMSNorm, residual add + RMSNorm, rotary embedding, SiLU gate)
against the Hugging Face modules they replace: on CUDA (``gpu``), and some on the CPU under Triton's
interpreter (``bash scripts/test.sh`` runs them with ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")


@pytest.fixture
def needs_triton():
    from slime.backends.embedded_engine.kernels import triton_attention

    if not (torch.cuda.is_available() and triton_attention.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")




def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 1, 1024), (3, 1, 16, 128), (2, 300, 2048)])
def test_rms_norm_matches_hf(dtype, shape):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from slime.backends.embedded_engine.kernels.fused_ops import rms_norm

    norm = Qwen3RMSNorm(shape[-1], eps=1e-6).to("cuda", dtype)
    norm.weight.data.normal_()
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,seq", [(128, 1), (2, 37)])
def test_rotary_matches_hf(dtype, batch, seq):
    from transformers.models.qwen3 import modeling_qwen3

    from slime.backends.embedded_engine.kernels.fused_ops import apply_rotary_pos_emb

    q = torch.randn(batch, seq, 16, 128, device="cuda", dtype=dtype).transpose(1, 2)  # HF's layout
    k = torch.randn(batch, seq, 8, 128, device="cuda", dtype=dtype).transpose(1, 2)
    angles = torch.rand(batch, seq, 64, device="cuda") * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    got = apply_rotary_pos_emb(q, k, cos, sin)
    want = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_gate_matches_torch(dtype):
    from slime.backends.embedded_engine.kernels.fused_ops import silu_mul

    gate = torch.randn(128, 1, 3072, device="cuda", dtype=dtype) * 4
    up = torch.randn_like(gate)
    torch.testing.assert_close(silu_mul(gate, up), torch.nn.functional.silu(gate) * up, **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_triton")
def test_install_patches_a_qwen3_model_and_keeps_its_outputs(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    from slime.backends.embedded_engine.kernels import fused_ops

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
    # unfused projections: no q/k/v output to norm and rotate in one kernel (fused_projections.py binds it)
    assert counts == {"rmsnorm": 4 * layers + 1, "mlp": layers, "rope": 1, "add_rmsnorm": layers, "qk_norm_rope": 0,
                      "small_m_linear": 7 * layers, "layer_hand_offs": layers - 1}
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_layer_hand_offs_pair_the_layers_the_forward_runs_and_refuse_another_input():
    """``link_layers`` pairs each two consecutive decoder layers on the fused forward among the first
    ``num_hidden_layers`` (the ones HF's loop runs, in order): none across a layer left on HF's forward, none to a
    layer past that count. A layer handed the previous layer's unscaled down product for another tensor than its
    input refuses it before running anything (the product would be added to the wrong residual), and the hand-off
    is empty after."""
    import types

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from slime.backends.embedded_engine.kernels import fused_ops

    def model_with(fused: list[int], run: int):
        config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        model = Qwen3ForCausalLM(config)
        model.config.num_hidden_layers = run
        for i in fused:
            layer = model.model.layers[i]
            layer.forward = types.MethodType(fused_ops._decoder_layer_forward, layer)
        return model, model.model.layers

    model, layers = model_with([0, 1, 2, 3], run=4)
    assert fused_ops.link_layers(model) == 3
    assert all(layers[i]._hand_off_out is layers[i + 1]._hand_off_in for i in range(3))
    assert not hasattr(layers[0], "_hand_off_in") and not hasattr(layers[3], "_hand_off_out")
    assert not any("hand_off" in name for name, _ in model.named_modules())  # not registered as submodules
    model, layers = model_with([0, 1, 3], run=4)  # layer 2 on HF's forward
    assert fused_ops.link_layers(model) == 1 and hasattr(layers[0], "_hand_off_out")
    assert not hasattr(layers[1], "_hand_off_out") and not hasattr(layers[3], "_hand_off_in")
    model, layers = model_with([0, 1, 2, 3], run=3)  # a fourth layer the forward does not run
    assert fused_ops.link_layers(model) == 2 and not hasattr(layers[3], "_hand_off_in")

    hand_off = layers[1]._hand_off_in
    returned, other = torch.zeros(1, 3, 32), torch.zeros(1, 3, 32)
    product, scales = torch.ones(1, 3, 32), (torch.ones(3, 1), torch.ones(32, 1))
    hand_off.pending = (returned, product, scales)
    with pytest.raises(RuntimeError, match="input is not the residual the previous layer returned"):
        layers[1](other)
    assert hand_off.pending is None
    hand_off.pending = (returned, product, scales)
    taken = hand_off.take(returned)
    assert taken[0] is product and taken[1] is scales and hand_off.pending is None and hand_off.take(other) is None


def _add_rms_norm_reference(x, residual, weight, eps):
    """HF: ``h = residual + x`` in the activations' dtype, then the family's RMSNorm module."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(x.shape[-1], eps=eps).to(x.device, weight.dtype)
    norm.weight.data.copy_(weight)
    total = residual + x
    return norm(total), total


@needs_interpreter
@pytest.mark.parametrize("shape", [(4, 1, 64), (2, 3, 96)])
def test_add_rms_norm_interpreted_matches_hf(shape):
    from slime.backends.embedded_engine.kernels.fused_ops import add_rms_norm

    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 4
    weight = torch.randn(shape[-1], generator=gen)
    normed, total = add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_total = _add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("shape", [(3, 1, 2 * 48), (5, 2 * 1500)])
def test_packed_silu_gate_interpreted_equals_torch(shape):
    from slime.backends.embedded_engine.kernels.fused_ops import silu_mul_packed

    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul_packed(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_hf_on_cuda(dtype):
    from slime.backends.embedded_engine.kernels.fused_ops import add_rms_norm

    x = torch.randn(128, 1, 1024, device="cuda", dtype=dtype)
    residual = torch.randn_like(x) * 4
    weight = torch.randn(1024, device="cuda", dtype=dtype)
    normed, total = add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_total = _add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)  # the same rounded add
    torch.testing.assert_close(normed, want_normed, **tolerance(dtype))


@needs_interpreter
@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "qwen3"])
def test_decoder_layer_with_fused_add_norm_interpreted_keeps_the_logits(family):
    """The decoder-layer forward that :func:`install` swaps in on CUDA, bound on the CPU (its Triton
    kernel interpreted), on fused and unfused projections alike: the logits do not change."""
    import types

    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kernels import fused_projections
    from test_fused_projections import _models

    reference, patched = _models(family)
    fused_projections.install(patched)
    packed = 0
    for layer in patched.model.layers:
        layer.forward = types.MethodType(fused_ops._decoder_layer_forward, layer)
        if hasattr(layer.mlp, "gate_up_proj"):  # as install() binds it: the MLP's residual add goes into its GEMM
            layer.mlp.forward = types.MethodType(fused_ops._packed_mlp_forward, layer.mlp)
            packed += 1
    assert packed == {"llama": 2, "qwen2_moe": 0, "qwen3": 2}[family]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_interpreted_matches_hf(norm):
    """One launch for Qwen3's q_norm / k_norm and the rotary embedding of queries and keys (or the
    rotary alone, Llama), read straight from the fused q/k/v output: equal to HF's modules."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from slime.backends.embedded_engine.kernels.fused_ops import qk_norm_rope

    gen = torch.Generator().manual_seed(3)
    batch, seq, q_heads, kv_heads, dim = 2, 3, 4, 2, 32
    qkv = torch.randn(batch, seq, (q_heads + 2 * kv_heads) * dim, generator=gen) * 3
    angles = torch.randn(1, seq, dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [1, S, D]: one batch row
    q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6), Qwen3RMSNorm(dim, eps=1e-6)
    q_norm.weight.data = torch.randn(dim, generator=gen)
    k_norm.weight.data = torch.randn(dim, generator=gen)  # different from q's: a swapped weight shows
    query = qkv[..., :q_heads * dim].reshape(batch, seq, q_heads, dim)
    key = qkv[..., q_heads * dim:(q_heads + kv_heads) * dim].reshape(batch, seq, kv_heads, dim)
    if norm:
        query, key = q_norm(query), k_norm(key)
    want_q, want_k = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    weights = (q_norm.weight.data, k_norm.weight.data) if norm else (None, None)
    got_q, got_k = qk_norm_rope(qkv, q_heads, kv_heads, cos, sin, *weights, eps=1e-6)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_attention_with_fused_qk_norm_rope_interpreted_keeps_the_logits(family):
    """The q/k norm + rotary kernel that :func:`install` binds on CUDA, bound on the CPU (interpreted)
    on every fused-projection attention of a model: the logits do not change, and it ran in every layer."""
    import types

    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kernels import fused_projections
    from test_fused_projections import _models

    reference, patched = _models(family)
    fused_projections.install(patched)
    calls = []

    def counted(self, qkv, cos, sin, cache=None):
        out = fused_ops._attention_norm_rope(self, qkv, cos, sin, cache=cache)
        calls.append(out is not None)
        return out

    for layer in patched.model.layers:
        layer.self_attn.fused_norm_rope = types.MethodType(counted, layer.self_attn)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert calls == [True] * len(patched.model.layers)


@needs_interpreter
@pytest.mark.parametrize("cache_dtype,dtype,scales", [
    (torch.float32, torch.float32, (1.0, 1.0)), (torch.bfloat16, torch.bfloat16, (1.0, 1.0)),
    (torch.float32, torch.bfloat16, (1.0, 1.0)), (torch.float8_e4m3fn, torch.bfloat16, (0.5, 4.0)),
    (torch.float8_e5m2, torch.float32, (1.0, 1.0))])
def test_qk_norm_rope_interpreted_writes_the_cache_as_the_decode_write_does(cache_dtype, dtype, scales):
    """With ``cache_write`` the q/k norm + rotary kernel stores each token's rotated key and its value
    in the cache at (its slot, its position), in the cache's dtype, exactly what the separate decode
    write of the kernel's key output stores (``index_put``; FP8 caches: ``write_decode_kv``, scaled and
    saturated — the inputs reach past 448 / scale); the queries are unchanged and nothing else moves."""
    from slime.backends.embedded_engine.kernels.fused_ops import qk_norm_rope
    from slime.backends.embedded_engine.kv_cache import FP8_DTYPES, CacheShape, SlotKVCache, write_decode_kv

    gen = torch.Generator().manual_seed(5)
    batch, q_heads, kv_heads, dim = 5, 4, 2, 32
    qkv = (torch.randn(batch, 1, (q_heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    qkv[:, :, -dim:] *= 200  # the last value head: past e4m3's range at scale 4 (saturated)
    angles = torch.randn(batch, 1, dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    weights = (torch.randn(dim, generator=gen).to(dtype), torch.randn(dim, generator=gen).to(dtype))
    shape = CacheShape(1, kv_heads, dim, num_slots=batch + 2, slot_capacity=40)
    fused, reference = (SlotKVCache(shape, cache_dtype, torch.device("cpu")) for _ in range(2))
    slots, positions = torch.tensor([3, 0, 6, 1, 2]), torch.tensor([0, 39, 7, 7, 21])

    want_q, want_k = qk_norm_rope(qkv, q_heads, kv_heads, cos, sin, *weights)
    value = qkv[:, 0, (q_heads + kv_heads) * dim:].reshape(batch, kv_heads, dim)
    if cache_dtype in FP8_DTYPES:
        write_decode_kv(reference.keys[0], reference.values[0], want_k[:, :, 0], value, slots, positions, *scales)
    else:
        reference.keys[0][slots, :, positions] = want_k[:, :, 0].to(cache_dtype)
        reference.values[0][slots, :, positions] = value.to(cache_dtype)

    got_q, got_k = qk_norm_rope(qkv, q_heads, kv_heads, cos, sin, *weights,
                                cache_write=(fused.keys[0], fused.values[0], slots, positions, *scales))
    assert got_k is None and torch.equal(got_q, want_q)
    as_bytes = (lambda t: t.view(torch.uint8)) if cache_dtype in FP8_DTYPES else (lambda t: t)
    assert torch.equal(as_bytes(fused.keys[0]), as_bytes(reference.keys[0]))
    assert torch.equal(as_bytes(fused.values[0]), as_bytes(reference.values[0]))
    assert fused.keys[0].float().abs().sum() > 0 and fused.values[0].float().abs().sum() > 0
    if cache_dtype in FP8_DTYPES:
        assert torch.isfinite(fused.values[0].float()).all()
    if cache_dtype == torch.float8_e4m3fn:  # the large value head saturated at 448, not inf/NaN
        assert float(fused.values[0].float().abs().max()) == torch.finfo(cache_dtype).max


@needs_interpreter
def test_decode_with_the_cache_write_in_the_norm_rope_kernel_interpreted_keeps_the_logits(tiny_model_dir,
                                                                                            monkeypatch):
    """The engine's decode steps with the fused q/k norm + rotary kernel storing the keys and values
    itself (the CUDA decode path, here interpreted on the CPU) give the logits of the plain runner over
    a prompt and six generated tokens: the cache the kernel wrote is the one the attention read."""
    import types

    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kv_cache import DecodeCacheView
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

    def run(fused: bool) -> list[torch.Tensor]:
        runner = ModelRunner(tiny_model_dir, num_slots=3, slot_capacity=32)
        written = []
        if fused:
            def target(view, layer_idx):
                written.append(layer_idx)
                return (view.cache.keys[layer_idx], view.cache.values[layer_idx], view.rows, view.positions,
                        view.cache.k_scales[layer_idx], view.cache.v_scales[layer_idx])

            monkeypatch.setattr(DecodeCacheView, "fused_write_target", target)
            for module in runner.model.modules():
                if hasattr(module, "qkv_proj"):
                    module.fused_norm_rope = types.MethodType(fused_ops._attention_norm_rope, module)
        prompts = [[5, 17, 33, 2, 91, 40], [7, 7, 8], [60, 1, 2, 3, 4, 5, 6, 9]]
        logits, _ = runner.forward([0, 1, 2], [ForwardRow(p, 0) for p in prompts])
        tokens, positions, out = [int(t) for t in logits.argmax(-1)], [len(p) for p in prompts], [logits]
        for _ in range(6):
            step = runner.decode(tokens, positions)
            out.append(step)
            tokens, positions = [int(t) for t in step.argmax(-1)], [p + 1 for p in positions]
        layers = runner.model.config.num_hidden_layers
        assert written == ([] if not fused else list(range(layers)) * 6)
        monkeypatch.undo()
        return out

    plain, fused = run(False), run(True)
    for want, got in zip(plain, fused):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
