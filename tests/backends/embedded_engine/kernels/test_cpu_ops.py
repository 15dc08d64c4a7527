"""The CPU path's fewer-op forms (``cpu_ops.py``) equal Hugging Face's modules in fp32: RMSNorm, the
q/k norm + rotary embedding of the fused q/k/v output, the decoder layer; the whole model's logits for
the six families, through prefill and the engine's decode steps; and the tests see a wrong op."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from slime.backends.embedded_engine.kernels import cpu_ops
from slime.backends.embedded_engine.kernels import fused_projections

from engine_test_utils import hf_greedy, load_hf
from test_fused_projections import GATE_UP, _models


def _rotary(model, batch: int, seq: int, start: int = 0):
    """HF's cos/sin ``[B, S, D]`` of the model's own rotary module at positions ``start + s`` (+ b)."""
    positions = torch.arange(start, start + seq).view(1, -1) + torch.arange(batch).view(-1, 1)
    hidden = torch.zeros(batch, seq, model.config.hidden_size)
    return model.model.rotary_emb(hidden, positions)


@pytest.mark.parametrize("shape", [(5, 1, 32), (3, 7, 32), (2, 3, 6, 8), (4, 1, 256)])
def test_rms_norm_is_hfs_bit_for_bit(shape):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(shape[-1], eps=1e-6)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(cpu_ops.rms_norm_forward(norm, x), norm(x))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("batch,seq,cos_rows", [(4, 1, 4), (3, 5, 3), (2, 4, 1)])
def test_qk_norm_rope_is_hfs_bit_for_bit(family, batch, seq, cos_rows):
    """Qwen3 (per-head q/k RMSNorm), Llama and Qwen2 (rotary only; Qwen2's q/k/v biases) against the
    modules and ``apply_rotary_pos_emb`` of the family, from the same fused q/k/v output."""
    reference, fused = _models(family)
    fused_projections.install(fused)
    attention = fused.model.layers[0].self_attn
    modeling = importlib.import_module(type(attention).__module__)
    qkv = torch.randn(batch, seq, attention.qkv_proj.out_features, generator=torch.Generator().manual_seed(3))
    cos, sin = _rotary(fused, cos_rows, seq, start=7)
    dim = attention.head_dim
    query, key, _ = (part.view(batch, seq, -1, dim) for part in attention.qkv_proj.split(qkv))
    if family == "qwen3":
        query, key = attention.q_norm(query), attention.k_norm(key)
    want_q, want_k = modeling.apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    cpu_ops.install(fused)
    got_q, got_k = attention.fused_norm_rope(qkv, cos, sin)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_decoder_layer_is_hfs_and_leaves_its_input_alone():
    reference, fused = _models("qwen3")
    fused_projections.install(fused)
    cpu_ops.install(fused)
    x = torch.randn(3, 5, fused.config.hidden_size, generator=torch.Generator().manual_seed(4))
    kept = x.clone()
    cos, sin = _rotary(fused, 3, 5)
    mask = torch.zeros(3, 1, 5, 5).masked_fill_(torch.ones(5, 5, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = reference.model.layers[0](x, attention_mask=mask, position_embeddings=(cos, sin))
        got = fused.model.layers[0](x, attention_mask=mask, position_embeddings=(cos, sin))
    assert torch.equal(x, kept)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", list(GATE_UP))
def test_model_logits_equal_hf(family):
    reference, fused = _models(family)
    fused_projections.install(fused)
    counts = cpu_ops.install(fused)
    assert counts["rmsnorm"] > 0 and counts["qk_norm_rope"] == 2
    # MoE layers keep HF's forward (their MLP is the sparse block); Qwen3-MoE's dense layer 0 is swapped
    assert counts["decoder_layer"] == {"qwen2_moe": 0, "qwen3_moe": 1}.get(family, 2)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_wrong_rotary_is_seen():
    """The logits check has the power to see a wrong op: the rotary with one sign flipped fails it."""
    reference, fused = _models("qwen3")
    fused_projections.install(fused)
    cpu_ops.install(fused)
    good = cpu_ops.qk_norm_rope

    def wrong(qkv, q_heads, kv_heads, cos, sin, *args, **kwargs):
        return good(qkv, q_heads, kv_heads, cos, -sin, *args, **kwargs)

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        cpu_ops.qk_norm_rope = wrong
        try:
            got = fused(ids).logits
        finally:
            cpu_ops.qk_norm_rope = good
    assert (got - want).abs().max() > 1e-3


def test_not_installed_off_fp32_or_when_switched_off(monkeypatch):
    _, fused = _models("qwen3")
    bf16 = copy.deepcopy(fused).to(torch.bfloat16)
    assert not any(cpu_ops.install(bf16).values())
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    assert not any(cpu_ops.install(fused).values())


def test_engine_decode_steps_equal_hf(tiny_model_dir):
    """The engine's runner on the CPU (fused projections + these ops, the slot cache's decode step):
    every decode step's logits within 1e-5 of HF's full forward over the same tokens, rows of
    different lengths, and the greedy continuation HF's."""
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

    runner = ModelRunner(tiny_model_dir, device="cpu", num_slots=4)
    assert runner.fused_ops["qk_norm_rope"] > 0 and runner.fused_ops["rmsnorm"] > 0
    hf = load_hf(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    last, _ = runner.forward([0, 1, 2], [ForwardRow(tokens=p, start=0) for p in prompts])
    sequences = [list(p) for p in prompts]
    for step in range(6):
        with torch.no_grad():
            for row, seq in enumerate(sequences):
                want = hf(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(last[row], want, atol=1e-5, rtol=1e-5)
        for row, seq in enumerate(sequences):
            seq.append(int(last[row].argmax()))
        last = runner.decode([seq[-1] for seq in sequences], [len(seq) - 1 for seq in sequences])
    for prompt, seq in zip(prompts, sequences):
        assert seq[len(prompt):] == hf_greedy(hf, prompt, 6)
