"""The engine's decode attention (grouped matmuls over the slot cache) against PyTorch's SDPA."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slime.backends.embedded_engine.kernels.attention import decode_attention
from slime.backends.embedded_engine.kv_cache import CacheShape, DecodeCacheView, SlotKVCache

needs_interpreter = pytest.mark.skipif(  # scripts/test.sh runs these again with TRITON_INTERPRET=1
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")


def reference(query, key, value, positions, scale):
    """SDPA per row with the key/value heads repeated and the row's cache cut at its position."""
    groups = query.shape[1] // key.shape[1]
    outs = []
    for i, pos in enumerate(positions):
        k = key[i: i + 1, :, : pos + 1].repeat_interleave(groups, dim=1)
        v = value[i: i + 1, :, : pos + 1].repeat_interleave(groups, dim=1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(query[i: i + 1], k, v, scale=scale))
    return torch.cat(outs).transpose(1, 2)  # [B, 1, H, D]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_decode_attention_matches_sdpa(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    batch, dim, capacity = 5, 16, 40
    positions = [0, 3, 17, 39, 8]
    length = max(positions) + 1
    cache = SlotKVCache(CacheShape(1, kv_heads, dim, num_slots=8, slot_capacity=capacity), torch.float32,
                        torch.device("cpu"))
    cache.keys[0].normal_(generator=gen)
    cache.values[0].normal_(generator=gen)
    key, value = cache.keys[0][:batch, :, :length], cache.values[0][:batch, :, :length]  # strided views
    query = torch.randn(batch, heads, 1, dim, generator=gen)
    pos = torch.tensor(positions)
    mask = torch.zeros(batch, 1, 1, length)
    mask.masked_fill_(torch.arange(length).view(1, 1, 1, -1) > pos.view(-1, 1, 1, 1), torch.finfo(torch.float32).min)
    out = decode_attention(query, key, value, mask, scaling=0.3)
    assert out.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(out, reference(query, key, value, positions, 0.3), atol=1e-5, rtol=1e-5)


def test_decode_cache_view_writes_each_row_at_its_position():
    cache = SlotKVCache(CacheShape(2, 2, 4, num_slots=4, slot_capacity=10), torch.float32, torch.device("cpu"))
    rows, positions = torch.arange(3), torch.tensor([0, 5, 9])
    view = DecodeCacheView(cache, rows, positions, kv_length=10)
    new_k = torch.randn(3, 2, 1, 4)
    new_v = torch.randn(3, 2, 1, 4)
    keys, values = view.update(new_k, new_v, layer_idx=1)
    for i, p in enumerate([0, 5, 9]):
        torch.testing.assert_close(cache.keys[1][i, :, p], new_k[i, :, 0])
        torch.testing.assert_close(cache.values[1][i, :, p], new_v[i, :, 0])
    assert keys.shape == (3, 2, 10, 4) and values.shape == (3, 2, 10, 4)
    assert cache.keys[0].abs().sum() == 0  # other layers untouched
    assert cache.keys[1][3].abs().sum() == 0  # the slot outside the batch untouched


def _kv_write_case(device, key_dim, value_dim, cache_dtype, dtype, batch=5, heads=3):
    """Random step keys/values in HF's [B, heads, 1, dim] layout (strided: a transposed projection
    output) and two caches to write them into, a row's position anywhere in its slot."""
    gen = torch.Generator().manual_seed(key_dim + value_dim)
    shape = CacheShape(1, heads, key_dim, num_slots=batch + 2, slot_capacity=37, value_dim=value_dim)
    caches = [SlotKVCache(shape, cache_dtype, torch.device(device)) for _ in range(2)]
    key = torch.randn(batch, 1, heads, key_dim, generator=gen).transpose(1, 2).to(device, dtype)
    value = torch.randn(batch, 1, heads, value_dim, generator=gen).transpose(1, 2).to(device, dtype)
    rows = torch.tensor([0, 2, 1, 4, 3][:batch], device=device)
    positions = torch.tensor([0, 36, 5, 17, 36][:batch], device=device)
    return caches, key, value, rows, positions


@needs_interpreter
@pytest.mark.parametrize("key_dim,value_dim,cache_dtype,dtype", [
    (16, 16, torch.float32, torch.float32), (64, 64, torch.bfloat16, torch.bfloat16),
    (48, 24, torch.float32, torch.bfloat16)])  # MLA-like: different, non-power-of-two widths; an upcast
def test_triton_decode_kv_write_interpreted_equals_index_put(key_dim, value_dim, cache_dtype, dtype):
    from slime.backends.embedded_engine.kv_cache import write_decode_kv

    (fused, reference), key, value, rows, positions = _kv_write_case("cpu", key_dim, value_dim, cache_dtype, dtype)
    write_decode_kv(fused.keys[0], fused.values[0], key[:, :, 0], value[:, :, 0], rows, positions)
    reference.keys[0][rows, :, positions] = key[:, :, 0].to(cache_dtype)
    reference.values[0][rows, :, positions] = value[:, :, 0].to(cache_dtype)
    assert torch.equal(fused.keys[0], reference.keys[0]) and torch.equal(fused.values[0], reference.values[0])
    assert fused.keys[0].abs().sum() > 0 and fused.values[0].abs().sum() > 0


@pytest.mark.gpu
def test_decode_cache_view_triton_write_equals_index_put_on_cuda():
    """On CUDA :class:`DecodeCacheView` writes with the Triton kernel; the result equals the CPU path's."""
    from slime.backends.embedded_engine.kernels import triton_attention

    if not (torch.cuda.is_available() and triton_attention.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")
    (cuda_cache, _), key, value, rows, positions = _kv_write_case("cuda", 128, 128, torch.bfloat16, torch.bfloat16,
                                                                  batch=5, heads=8)
    (cpu_cache, _), *_ = _kv_write_case("cpu", 128, 128, torch.bfloat16, torch.bfloat16, batch=5, heads=8)
    DecodeCacheView(cuda_cache, rows, positions, kv_length=37).update(key, value, layer_idx=0)
    DecodeCacheView(cpu_cache, rows.cpu(), positions.cpu(), kv_length=37).update(key.cpu(), value.cpu(), layer_idx=0)
    assert torch.equal(cuda_cache.keys[0].cpu(), cpu_cache.keys[0])
    assert torch.equal(cuda_cache.values[0].cpu(), cpu_cache.values[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 16, 8), (7, 8, 2), (128, 16, 8), (33, 4, 4)])
def test_triton_decode_attention_matches_reference(dtype, batch, heads, kv_heads):
    """The flash-decoding kernel: each row attends to its own length only (rows of one batch differ),
    splits merged exactly; fp32 to rounding, bf16 within bf16 output precision."""
    from slime.backends.embedded_engine.kernels import triton_attention

    if not (torch.cuda.is_available() and triton_attention.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")
    gen = torch.Generator(device="cuda").manual_seed(batch)
    dim, capacity = 128, 1100
    cache = SlotKVCache(CacheShape(1, kv_heads, dim, num_slots=batch + 3, slot_capacity=capacity), dtype,
                        torch.device("cuda"))
    cache.keys[0].normal_(generator=gen)
    cache.values[0].normal_(generator=gen)
    positions = torch.randint(0, 1000, (batch,), generator=gen, device="cuda")
    positions[0] = 0  # a row with a single key
    length = int(positions.max()) + 1
    key, value = cache.keys[0][:batch, :, :length], cache.values[0][:batch, :, :length]
    query = torch.randn(batch, heads, 1, dim, generator=gen, device="cuda", dtype=dtype)
    out = triton_attention.decode_attention(query.reshape(batch, heads, dim), key, value, positions + 1, length, 0.088)
    expected = reference(query.float(), key.float(), value.float(), positions.tolist(), 0.088)[:, 0]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("dim", [32, 128, 256])  # 128-position steps up to 128-wide heads, 64 above
@pytest.mark.parametrize("merge_here,early_v", [(True, True), (False, False)])
def test_triton_decode_attention_interpreted_matches_reference(dim, merge_here, early_v, monkeypatch):
    """The flash-decoding kernel on the CPU (interpreter): rows of one batch at different lengths
    (one key, one position past a step, several splits), each attending to its own length only; the
    splits merged by the last program of each (row, kv_head) or by a second kernel. Twice: the merge
    tickets are left at zero for the next call."""
    from slime.backends.embedded_engine.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "MERGE_IN_SPLIT_KERNEL", merge_here)
    monkeypatch.setattr(triton_attention, "EARLY_V_LOAD", early_v)
    empty = torch.empty

    def poisoned(*args, **kwargs):  # scratch buffers start as NaN: a merge reading a split not yet written shows
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)

    gen = torch.Generator().manual_seed(dim)
    batch, heads, kv_heads, capacity = 3, 4, 2, 400
    keys = torch.randn(batch + 1, kv_heads, capacity, dim, generator=gen)
    values = torch.randn(batch + 1, kv_heads, capacity, dim, generator=gen)
    positions = torch.tensor([0, 128, 300])  # lengths 1, one past a 128-step, several steps
    length = int(positions.max()) + 1
    splits = triton_attention.plan_splits(batch, kv_heads, length, triton_attention.block_n(dim))
    assert splits > 1  # the merge of partial softmaxes is exercised
    query = torch.randn(batch, heads, dim, generator=gen)
    key, value = keys[:batch, :, :length], values[:batch, :, :length]
    expected = reference(query[:, :, None], key, value, positions.tolist(), dim ** -0.5)[:, 0]
    for _ in range(2):
        out = triton_attention.decode_attention(query, keys, values, positions + 1, length, dim ** -0.5)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    if merge_here:
        assert int(triton_attention._tickets.by_device[query.device].abs().sum()) == 0
    one_split = triton_attention.decode_attention(query[:, :, :], keys, values, torch.ones(batch, dtype=torch.long),
                                                  1, dim ** -0.5)  # kv_length 1: one split, no merge at all
    first = values[:batch, :, 0].repeat_interleave(heads // kv_heads, dim=1)
    torch.testing.assert_close(one_split, first, atol=1e-6, rtol=1e-6)


@needs_interpreter
def test_triton_decode_attention_interpreted_every_launch_matches_reference():
    """Every launch a sweep may pick (``triton_attention.Launch``: 32-128 positions a step, one split to
    more splits than blocks, 4/8 warps, 1-3 stages) computes the same attention: rows of different
    lengths (one key, one past a block, several blocks), against the dense reference — planned for
    the longest row and for the whole capacity (what a graph captured per batch size passes), where
    each row cuts its own length into the splits and a short row leaves most of them empty."""
    from slime.backends.embedded_engine.kernels import triton_attention

    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, dim, capacity = 3, 8, 2, 64, 1024
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=gen)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=gen)
    positions = torch.tensor([0, 64, 300])
    query = torch.randn(batch, heads, dim, generator=gen)
    expected = reference(query[:, :, None], keys, values, positions.tolist(), dim ** -0.5)[:, 0]
    for length in (301, capacity):
        for launch in [triton_attention.Launch(32, 1, 4, 1), triton_attention.Launch(32, 4, 8, 3),
                       triton_attention.Launch(64, 16, 4, 2), triton_attention.Launch(128, 2, 8, 1),
                       triton_attention.Launch(128, 1, 4, 3), triton_attention.Launch(64, 3, 4, 2)]:
            out = triton_attention.decode_attention(query, keys, values, positions + 1, length, dim ** -0.5,
                                                    launch=launch)
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"{launch} over {length}: {m}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_plan_launch_picks_the_h200_sweeps_best_launches():
    """The default launch at the shapes swept on the H200 (Qwen3-4B: 8 KV heads of 128;
    bench/results/decode_attention-nvidia-h200-qwen3-b128-sweep-kv-*.json and
    decode_attention-nvidia-h200-qwen3-4b-b16-64-sweep-kv-bf16-fp8-p511-2047.json): one split of 64-position steps
    from 32 rows up, two at 16 rows, three stages over an FP8 cache and in launches of fewer than 512 programs."""
    from slime.backends.embedded_engine.kernels.triton_attention import Launch, plan_launch

    assert plan_launch(128, 8, 160, 128) == Launch(64, 1, 4, 2)  # 27.3 us, the sweep's best
    assert plan_launch(128, 8, 512, 128, kv_element_bytes=1) == Launch(64, 1, 4, 3)  # 60.5, the best
    assert plan_launch(64, 8, 2048, 128) == Launch(64, 1, 4, 2)  # 130.8 vs best 130.2 (141.0 with two splits)
    assert plan_launch(16, 8, 2048, 128, kv_element_bytes=1) == Launch(64, 2, 4, 3)  # 37.4, the best (one: 49.8)
    assert plan_launch(16, 8, 512, 128) == Launch(64, 2, 4, 3)  # 14.5 vs 16.1 with two stages
    assert plan_launch(1, 8, 2048, 128).splits == 32  # a lone row still spreads over the GPU: 256 programs
    assert plan_launch(1, 8, 100, 128).splits == 2  # never more splits than 64-position blocks


def reference_tokens(query, keys, values, lengths, scale):
    """``query [B, H, T, D]``: token t of row b at position ``lengths[b] - T + t`` attends to the row's
    cache up to and including that position -> ``[B, T, H, D]`` (the dense reference, token by token)."""
    tokens = query.shape[2]
    outs = [reference(query[:, :, t: t + 1], keys, values, [int(n) - tokens + t for n in lengths], scale)
            for t in range(tokens)]
    return torch.cat(outs, dim=1)


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 2, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (6, 1, 16), (2, 2, 128)])
def test_triton_verify_attention_interpreted_matches_reference(tokens, heads, kv_heads, dim, monkeypatch):
    """The flash-decoding kernel with T query tokens per row (a verify step): rows of different lengths
    (the shortest holds just its T tokens, one spans several splits, one ends T-1 positions into a new
    block, so that block has keys for some of its tokens only), GQA groups 1-6; token t of a row attends
    to the row's cache up to its own position. Against the dense reference in fp32, the query in HF's
    strided layout; T=1 also through the one-token entry (``[B, H, D]``), which must give the same bits."""
    from slime.backends.embedded_engine.kernels import triton_attention

    gen = torch.Generator().manual_seed(tokens * 100 + dim)
    block = triton_attention.block_n(dim)
    lengths = torch.tensor([tokens, 3 * block + tokens - 1, 40 + tokens, block + 1])
    batch, capacity = len(lengths), 3 * block + 8
    keys = torch.randn(batch + 1, kv_heads, capacity, dim, generator=gen)
    values = torch.randn(batch + 1, kv_heads, capacity, dim, generator=gen)
    length = int(lengths.max())
    splits = triton_attention.plan_splits(batch, kv_heads, length, block)
    assert splits > 1  # split partials merged
    query = torch.randn(batch, tokens, heads, dim, generator=gen).transpose(1, 2)  # [B, H, T, D], HF's strides
    out = triton_attention.decode_attention(query, keys, values, lengths, length, dim ** -0.5)
    assert out.shape == (batch, tokens, heads, dim)
    expected = reference_tokens(query, keys[:batch, :, :length], values[:batch, :, :length], lengths, dim ** -0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    if tokens == 1:
        one = triton_attention.decode_attention(query[:, :, 0].contiguous(), keys, values, lengths, length, dim ** -0.5)
        assert torch.equal(one, out[:, 0])
    else:  # each token equals a one-token step of its own length (the rows' later positions are not seen)
        for t in range(tokens):
            one = triton_attention.decode_attention(query[:, :, t].contiguous(), keys, values,
                                                    lengths - (tokens - 1 - t), length, dim ** -0.5)
            torch.testing.assert_close(out[:, t], one, atol=1e-6, rtol=1e-6)
        monkeypatch.setattr(triton_attention, "MERGE_IN_SPLIT_KERNEL", True)  # the splits merged in the kernel
        merged = triton_attention.decode_attention(query, keys, values, lengths, length, dim ** -0.5)
        torch.testing.assert_close(merged, expected, atol=2e-5, rtol=2e-5)
        assert int(triton_attention._tickets.by_device[query.device].abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,tokens", [(1, 16, 8, 5), (33, 16, 8, 12), (128, 32, 8, 4), (7, 8, 8, 2)])
def test_triton_verify_attention_matches_reference_on_cuda(dtype, batch, heads, kv_heads, tokens):
    """The T-token flash-decoding kernel compiled on the GPU: rows of random lengths (one holding only its
    T tokens), GQA groups 1-4, T up to 12 (T * G = 48 query rows a program); fp32 to rounding, bf16
    within bf16 output precision."""
    from slime.backends.embedded_engine.kernels import triton_attention

    if not (torch.cuda.is_available() and triton_attention.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")
    gen = torch.Generator(device="cuda").manual_seed(batch + tokens)
    dim, capacity = 128, 1100
    keys = torch.randn(batch + 2, kv_heads, capacity, dim, generator=gen, device="cuda").to(dtype)
    values = torch.randn(batch + 2, kv_heads, capacity, dim, generator=gen, device="cuda").to(dtype)
    lengths = torch.randint(tokens, 1000, (batch,), generator=gen, device="cuda")
    lengths[0] = tokens
    length = int(lengths.max())
    query = torch.randn(batch, tokens, heads, dim, generator=gen, device="cuda", dtype=dtype).transpose(1, 2)
    out = triton_attention.decode_attention(query, keys, values, lengths, length, 0.088)
    expected = reference_tokens(query.float(), keys[:batch, :, :length].float(), values[:batch, :, :length].float(),
                                lengths.tolist(), 0.088)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
