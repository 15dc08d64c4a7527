"""Decode attention over the slot cache as a Triton kernel ("flash decoding"), for CUDA.

A decode step has one query token per row and reads each row's cached keys and values, so its
cost is the bytes of KV it reads. This kernel reads every row's cache exactly once, and only up to
the row's own length (the rows of a batch have different lengths; a dense kernel would read all of
them up to the longest):

* program ``(b, kv_head, split)`` loads the ``G`` query heads that share ``kv_head`` (grouped-query
  attention), walks its share of row ``b``'s positions (the row's own length cut into ``SPLITS`` runs
  of whole blocks) in blocks of ``BLOCK_N`` (:func:`block_n`), and keeps an online softmax (running max ``m``, sum ``l``, weighted values
  ``acc``) in fp32;
* it writes ``acc / l`` and ``lse = m + log l`` per (row, head, split); a second small kernel merges
  the splits: ``out = Σ_s exp(lse_s - lse) · out_s`` with ``lse = logsumexp_s lse_s``. A row in one
  split writes its output directly (no merge). ``MERGE_IN_SPLIT_KERNEL`` instead lets the program
  that finishes last among a (row, kv_head)'s splits (an atomic ticket per pair) merge them in the
  same launch — measured slower at B=128, so off.

A speculative verify step has ``T`` query tokens per row (the last token and the drafts, already
written to the cache as the row's last ``T`` positions): program ``(b, kv_head, split)`` then loads the
``T * G`` query rows of its KV head (token-major, padded to ``GROUP_PAD``), walks the row's cache once
for all of them, and masks token ``t`` to positions ``< length_b - (T - 1 - t)``; outputs and ``lse``
are per (row, token, head, split) and the merge runs over ``B * T`` rows. ``TOKENS == 1`` compiles to
the one-token kernel (the extra masking and the guard for a token with no key yet in a block are
static branches; the sm_90 PTX has the same instructions).

Splitting a row over several programs keeps the GPU busy when the batch is small. The number of
splits is fixed per call (by the batch and the longest possible row, :func:`plan_splits`); each row's
split length comes from its own length on the device, so one launch (one CUDA graph per batch size)
serves rows of any length up to the cache's capacity, and a short row's splits past its end write
``lse = -inf`` and weigh nothing. ``lengths`` lives on the device, so the call has no host sync and
is capturable.

An FP8 cache (``--kv-cache-dtype fp8_e4m3``/``fp8_e5m2``) is read as it is stored, one byte per value:
each block is converted as it is loaded (exact: every e4m3/e5m2 value is an fp16 and a bf16 value) to fp16
under a 16-bit query (:data:`FP8_DOTS_IN_FP16`: the query, pre-multiplied by the softmax scale, and the
probabilities go to fp16 for the two dots; fp32 accumulation as always), to the query's dtype otherwise; the
layer's ``k_scale`` is folded into the softmax scale and ``v_scale`` multiplies the output, which equals
attention over the dequantized cache ``stored · scale``.

fp32 caches multiply in full fp32 (``input_precision="ieee"``, not TF32), so an fp32 engine matches
an fp32 reference to rounding. Layout: ``query [B, H, D]``, cache ``[slots, Hkv, capacity, D]`` (row b is slot b), ``D`` a power of
two. The result equals ``softmax(q·Kᵀ·scale) V`` over positions ``< length_b`` (tests compare it with
the dense reference in fp32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from slime.backends.embedded_engine.tickets import Tickets

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses the matmul path of attention.py
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, lengths_ptr, out_ptr, lse_ptr, final_ptr, counter_ptr,
                      stride_qb, stride_qt, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                      stride_vn, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_ft,
                      stride_fh, scale, v_scale, BLOCK_N: tl.constexpr,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
                      SPLITS: tl.constexpr, MERGE_HERE: tl.constexpr, EARLY_V: tl.constexpr, TOKENS: tl.constexpr,
                      DOT_F16: tl.constexpr):
        # GROUP_PAD covers the program's TOKENS * GROUP query rows, token-major: query row r is token
        # r // GROUP of the row (its position length - TOKENS + r // GROUP) and head kv_head * GROUP + r % GROUP.
        # TOKENS == 1 (a decode step) compiles to the one-token kernel: every TOKENS branch below is static.
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lengths_ptr + row)
        if SPLITS == 1:
            start = 0
            end = length
        else:  # the row's own length in SPLITS runs of whole blocks (the last ones empty for a short row)
            split_len = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS) * BLOCK_N
            start = split * split_len
            end = tl.minimum(start + split_len, length)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        if TOKENS == 1:
            parts_base = out_ptr + row * stride_ob  # each query row's (row, token) in the parts / lse buffers
            lse_base = lse_ptr + row * stride_lb
            q_base = q_ptr + row * stride_qb
            final_base = final_ptr + row * stride_fb
            heads = kv_head * GROUP + offs_g
            in_group = offs_g < GROUP
        else:
            token = offs_g // GROUP
            parts_base = out_ptr + (row * TOKENS + token[:, None]) * stride_ob
            lse_base = lse_ptr + (row * TOKENS + token) * stride_lb
            q_base = q_ptr + row * stride_qb + token[:, None] * stride_qt
            final_base = final_ptr + row * stride_fb + token[:, None] * stride_ft
            heads = kv_head * GROUP + offs_g % GROUP
            in_group = offs_g < GROUP * TOKENS
            limit = length - (TOKENS - 1) + token  # query t sees positions < length - (TOKENS - 1 - t)
        q = tl.load(q_base + heads[:, None] * stride_qh + offs_d[None, :], mask=in_group[:, None], other=0.0)
        if DOT_F16:  # an FP8 cache: the dots in fp16 (see FP8_DOTS_IN_FP16), the softmax scale folded into q
            q = (q.to(tl.float32) * scale).to(tl.float16)
            qk_scale = 1.0
        else:
            qk_scale = scale
        k_base = k_ptr + row * stride_kb + kv_head * stride_kh
        v_base = v_ptr + row * stride_vb + kv_head * stride_vh

        m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        for block in range(start, end, BLOCK_N):
            n = block + offs_n
            valid = n < end
            k = tl.load(k_base + n[:, None] * stride_kn + offs_d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            if EARLY_V:  # both loads in flight before the first dot: one memory round trip a block, not two
                v = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :], mask=valid[:, None],
                            other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if TOKENS == 1:
                scores = tl.where(valid[None, :], scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                m_ref = m_new  # every block has a key for the one token: finite
            else:
                scores = tl.where(valid[None, :] & (n[None, :] < limit[:, None]), scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a token with no key yet: weights 0, not NaN
            alpha = tl.exp(m - m_ref)
            p = tl.exp(scores - m_ref[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if not EARLY_V:
                v = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :], mask=valid[:, None],
                            other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            m = m_new

        has_keys = l > 0
        out = acc * (v_scale / tl.where(has_keys, l, 1.0))[:, None]
        lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
        final = final_base + heads[:, None] * stride_fh + offs_d[None, :]
        if SPLITS == 1:  # the row in one program: its result is the output (every token has a key: length >= TOKENS)
            tl.store(final, out.to(final_ptr.dtype.element_ty), mask=in_group[:, None])
        else:
            tl.store(parts_base + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
                     out, mask=in_group[:, None])
            tl.store(lse_base + heads * stride_lh + split, lse, mask=in_group)
            if MERGE_HERE:
                # the last of the (row, kv_head) programs to finish merges the splits (no second launch):
                # the barrier orders every thread's stores before the counter's acq_rel add, which makes
                # them visible to the program that takes the last ticket; it resets the counter for the
                # next call (a CUDA graph replays the same buffer)
                counter = counter_ptr + row * tl.num_programs(1) + kv_head
                tl.debug_barrier()
                ticket = tl.atomic_add(counter, 1)
                if ticket == SPLITS - 1:
                    tl.debug_barrier()
                    top = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
                    for s in range(SPLITS):
                        lse_s = tl.load(lse_base + heads * stride_lh + s, mask=in_group,
                                        other=float("-inf"), cache_modifier=".cg")
                        top = tl.maximum(top, lse_s)
                    top = tl.where(in_group, top, 0.0)  # split 0 has keys: finite for every query row
                    total = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
                    weight_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
                    for s in range(SPLITS):
                        lse_s = tl.load(lse_base + heads * stride_lh + s, mask=in_group,
                                        other=float("-inf"), cache_modifier=".cg")
                        weight = tl.exp(lse_s - top)
                        part = tl.load(parts_base + heads[:, None] * stride_oh + s * stride_os
                                       + offs_d[None, :], mask=in_group[:, None], other=0.0, cache_modifier=".cg")
                        total += weight[:, None] * part
                        weight_sum += weight
                    merged = total / tl.where(weight_sum > 0, weight_sum, 1.0)[:, None]
                    tl.store(final, merged.to(final_ptr.dtype.element_ty), mask=in_group[:, None])
                    tl.atomic_xchg(counter, 0)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                      stride_ob, stride_oh, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + offs_s, mask=offs_s < SPLITS,
                      other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, axis=0))  # split 0 always has keys (every row has length >= 1)
        weights = weights / tl.sum(weights, axis=0)
        parts = tl.load(part_ptr + row * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                        mask=(offs_s < SPLITS)[:, None], other=0.0)
        out = tl.sum(parts * weights[:, None], axis=0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# Splits until there are this many (row, KV head, split) programs (~2 per SM of an H100/H200): fewer, longer splits
# won at every batch of the H200 sweeps of Qwen3-4B's shapes (docs/embedded_engine.md, "Kernels").
TARGET_PROGRAMS = 256
# The last split program of a (row, kv_head) merging the splits itself, instead of a second kernel. Off: no faster at
# 16 rows and slower at 128, where the merging programs run after the others as a serial tail (docs/embedded_engine.md,
# "What the fusions buy"); kept for the A/B.
MERGE_IN_SPLIT_KERNEL = False
# An FP8 cache's blocks convert to fp16 for the dots, the query too (scaled by the softmax scale first, so a
# query element only overflows fp16's 65504 past ~7e5 at 128-wide heads), and the probabilities: sm_90 turns two
# e4m3/e5m2 values into fp16 with one instruction (cvt.rn.f16x2.e4m3x2) and needs a second per value for bf16
# (cvt.bf16.f16, plus moves): the sm_90 PTX of the loop over one 64-position block of a 128-wide head (GROUP 4,
# the JIT's 16-divisible strides) is 557 instructions a thread with fp16 dots, 830 (e5m2: 814) with bf16 ones,
# 312 over a bf16 cache. fp16's 10-bit mantissa also holds every FP8 value and rounds the query and probabilities
# less than bf16's 7. False: bf16 dots, slower at every context of the H200 measurement (docs/embedded_engine.md,
# "FP8 KV cache"; bench/decode_attention.py --fp8-dots).
FP8_DOTS_IN_FP16 = True
EARLY_V_LOAD = True  # load a block's values with its keys (False: after the scores; A/B: no difference measured)
_tickets = Tickets("flash-decoding merge tickets", minimum=1 << 16)  # one per (row, kv_head)


def block_n(dim: int) -> int:
    """Positions per inner step: 64, faster than 128 at every split count and KV dtype of the H200 sweeps, and than
    32 (docs/embedded_engine.md, "Kernels"). Heads wider than 128 need it too (two 128 x 256 bf16 key/value tiles,
    double-buffered, would not fit in shared memory)."""
    return 64


def plan_splits(batch: int, kv_heads: int, kv_length: int, block: int) -> int:
    """Splits of each row for a call: more when the batch is small (until :data:`TARGET_PROGRAMS` programs), never
    more than the longest row ``kv_length`` has blocks. The kernel cuts each row's own length into that many runs of
    whole blocks, so a call planned for the cache's capacity serves rows of any length (what a CUDA graph captured
    once per batch size replays)."""
    return max(1, min(triton.cdiv(kv_length, block), triton.cdiv(TARGET_PROGRAMS, batch * kv_heads)))


class Launch(NamedTuple):
    """One launch of the flash-decoding kernel: positions per inner step, splits of each row (at most;
    whole blocks each), and the kernel's warps and pipeline stages. ``bench/decode_attention.py --sweep``
    times these against the plan."""
    block_n: int
    splits: int
    num_warps: int = 4
    num_stages: int = 2


def plan_launch(batch: int, kv_heads: int, kv_length: int, dim: int, kv_element_bytes: int = 2) -> Launch:
    """The launch :func:`decode_attention` makes by default. Three pipeline stages for an FP8 cache
    (``kv_element_bytes`` 1) and for launches of fewer than 512 programs, two otherwise. H200, 4 warps, 64
    positions a step: FP8 at 128 rows, one split, 26.0 / 60.5 us at 143 / 511 positions with three vs 28.6 / 68.3
    with two; bf16 at 16 rows, two splits, 14.5 / 41.0 us at 511 / 2047 with three vs 16.1 / 44.4; bf16 at 64 rows,
    one split (512 programs), 38.5 / 130.8 with two vs 42.9 / 146.6 (at 128 rows a wash: 27.3 / 72.2 vs 28.5 / 70.5)."""
    block = block_n(dim)
    splits = plan_splits(batch, kv_heads, kv_length, block)
    deep = kv_element_bytes == 1 or batch * kv_heads * splits < 512
    return Launch(block, splits, num_warps=4, num_stages=3 if deep else 2)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     kv_length: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                     launch: Launch | None = None) -> torch.Tensor:
    """``query [B, H, D]`` against cache rows ``keys/values [>=B, Hkv, capacity, D]`` (row b = slot b),
    each row attending to its first ``lengths[b]`` (<= ``kv_length``) positions -> ``[B, H, D]``. The
    cache may be FP8 (any dtype the query's converts from): its values count ``k_scale``/``v_scale`` times.

    ``query [B, H, T, D]`` (HF's layout, any strides with the last dim contiguous) is a verify step's
    ``T`` tokens per row, already in the cache as the row's last ``T`` positions (``lengths[b]`` counts
    them): token ``t`` attends to positions ``< lengths[b] - (T - 1 - t)`` -> ``[B, T, H, D]``. One program
    per (row, KV head, split) loads all ``T * G`` queries of its KV head, so the row's cache is read once
    for its ``T`` tokens. ``launch`` overrides the planned one (:func:`plan_launch`; for sweeps)."""
    if query.dim() == 3:
        batch, heads, dim = query.shape
        tokens, stride_qt = 1, 0
        q_strides = (query.stride(0), query.stride(1))
        out = torch.empty((batch, heads, dim), dtype=query.dtype, device=query.device)
        f_strides = (out.stride(0), 0, out.stride(1))
    else:
        batch, heads, tokens, dim = query.shape
        stride_qt = query.stride(2)
        q_strides = (query.stride(0), query.stride(1))
        out = torch.empty((batch, tokens, heads, dim), dtype=query.dtype, device=query.device)
        f_strides = (out.stride(0), out.stride(1), out.stride(2))
    if query.stride(-1) != 1:
        raise ValueError(f"decode_attention: the query's last dim must be contiguous, got strides {query.stride()}")
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    launch = launch or plan_launch(batch, kv_heads, kv_length, dim, keys.element_size())
    block = launch.block_n
    splits = max(1, min(launch.splits, triton.cdiv(kv_length, block)))
    parts = torch.empty((batch * tokens, heads, splits, dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((batch * tokens, heads, splits), dtype=torch.float32, device=query.device)
    merge_here = MERGE_IN_SPLIT_KERNEL and splits > 1
    counters = _tickets.get(query.device, batch * kv_heads) if merge_here else lse
    dot_f16 = FP8_DOTS_IN_FP16 and keys.element_size() == 1 and query.dtype in (torch.bfloat16, torch.float16)
    _split_kernel[(batch, kv_heads, splits)](
        query, keys, values, lengths, parts, lse, out, counters,
        q_strides[0], stride_qt, q_strides[1], keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1), *f_strides,
        scale * k_scale, v_scale, BLOCK_N=block, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group * tokens)), HEAD_DIM=dim,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SPLITS=splits,
        MERGE_HERE=merge_here, EARLY_V=EARLY_V_LOAD, TOKENS=tokens, DOT_F16=dot_f16, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    if splits > 1 and not merge_here:
        flat = out.view(batch * tokens, heads, dim)  # the (row, token) pairs in order: parts' first dim
        _merge_kernel[(batch * tokens, heads)](
            parts, lse, flat, parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
            flat.stride(0), flat.stride(1), SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=dim,
            num_warps=4)
    return out
