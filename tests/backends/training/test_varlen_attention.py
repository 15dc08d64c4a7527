"""The packed varlen attention path on CPU, through a stand-in with the flash kernel's contract.

PyTorch's ``varlen_attn`` only runs on CUDA, and its flash kernel refuses a value head size that
differs from the query's ("v must have shape (total_k, num_heads_k, head_size_og)", seen on the
H200 with DeepSeek-V3's multi-latent attention: 192 for q/k, 128 for v). The stand-in enforces the
same rule and computes causal attention per packed sample, so these tests check what
``varlen_attention_forward`` hands the kernel and what it returns.
"""

import math

import pytest
import torch

from slime.backends.training import varlen_attention


def flash_like_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, is_causal=False):
    """``q [T, H, D]``, ``k/v [T, H, D]`` (one head size, equal head counts, as the kernel wants)."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "v must have shape (total_k, num_heads_k, head_size_og)"
    assert q.shape[1] == k.shape[1], "this stand-in has no grouped-query support"
    assert is_causal
    out = torch.empty_like(q)
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def reference(query, key, value, cu, scaling):
    """Plain causal attention per sample at the real head sizes, grouped-query heads repeated."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        q, k, v = (t[0, :, start:end].double() for t in (query, key, value))
        scores = q @ k.transpose(-1, -2) * scaling
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        pieces.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(pieces).unsqueeze(0)


@pytest.mark.parametrize("qk_dim,value_dim", [(192, 128), (64, 64), (32, 48)], ids=["mla", "equal", "wider-v"])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_varlen_attention_pads_head_sizes_the_kernel_needs_equal(monkeypatch, qk_dim, value_dim, scaling):
    monkeypatch.setattr(varlen_attention, "_varlen_fn", lambda: flash_like_varlen)
    torch.manual_seed(0)
    heads, kv_heads, total = 4, 2, 13
    cu = torch.tensor([0, 5, 6, 13])
    query = torch.randn(1, heads, total, qk_dim)
    key = torch.randn(1, kv_heads, total, qk_dim)
    value = torch.randn(1, kv_heads, total, value_dim)
    out, _ = varlen_attention.varlen_attention_forward(
        None, query, key, value, None, scaling=scaling, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=7, max_length_k=7)
    assert out.shape == (1, total, heads, value_dim)
    expected = reference(query, key, value, cu, scaling if scaling is not None else 1 / math.sqrt(qk_dim))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def _segments_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, is_causal=False, detach=()):
    """A stand-in kernel with autograd: causal SDPA per packed sample; ``detach`` names inputs whose
    gradient it drops, as a kernel with a partial backward would."""
    inputs = {"q": q, "k": k, "v": v}
    q, k, v = (t.detach() if name in detach else t for name, t in inputs.items())
    pieces = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        pieces.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(pieces)


def test_gradient_check_accepts_a_kernel_that_trains_and_refuses_one_that_drops_q_and_k():
    """The start-up check behind ``available()``: a kernel whose backward reaches q, k and v passes; one
    that leaves q and k without a gradient (attention projections that never train), one that scales a
    gradient wrongly, or one that raises, fails — so ``auto`` falls back to sdpa on that PyTorch."""
    cpu = torch.device("cpu")
    assert varlen_attention.gradients_match_sdpa(_segments_sdpa, cpu, torch.float32)

    def no_qk_grad(*args, **kwargs):
        return _segments_sdpa(*args, **kwargs, detach=("q", "k"))

    def half_v_grad(q, k, v, *args, **kwargs):
        v = v * 0.5 + v.detach() * 0.5  # same forward, half the gradient to v
        return _segments_sdpa(q, k, v, *args, **kwargs)

    def raises(*args, **kwargs):
        raise RuntimeError("no backward for this dtype")

    for broken in (no_qk_grad, half_v_grad, raises):
        assert not varlen_attention.gradients_match_sdpa(broken, cpu, torch.float32), broken.__name__
