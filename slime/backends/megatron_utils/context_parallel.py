"""Context parallelism (``--context-parallel-size``) for packed micro-batches without Transformer Engine.

Each sample of a micro-batch is padded to a multiple of 2·CP tokens and cut into 2·CP equal chunks;
CP rank ``r`` holds chunks ``r`` and ``2·CP − 1 − r`` of every sample (the load-balanced split
Transformer Engine uses: under a causal mask every rank then does about the same attention work).
Everything but attention is per token, so each rank runs the model on its own tokens; attention
needs the keys and values of the earlier chunks:

* :func:`attention` all-gathers K and V over the CP group (autograd: the backward reduce-scatters
  their gradients back) and attends each local chunk ``j`` of a sample, whose tokens sit at
  positions ``j·c … (j + 1)·c − 1``, to that sample's keys ``0 … (j + 1)·c − 1`` — causal with the
  mask aligned to the last key (varlen flash attention on CUDA; exact attention elsewhere);
* rotary angles come from each token's own position (``position_ids``: the global position within
  its sample), as in every packed micro-batch of the local spec.

The per-token results the trainer reads — log-probs, entropy, values at the response rows — are
gathered back into the samples' order by :func:`gather_rows`, so every CP rank holds the whole
micro-batch's values and the loss code is unchanged. Every CP rank then computes the same loss;
the gradient reaching a rank's own rows is its own share of that loss's gradient (no reduction), and
Megatron's DDP sums the parameter gradients over the data- and context-parallel ranks.

The layout is built on the host (:func:`layout`); the attention index tensors go to the device with
the rest of the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CPLayout", "layout", "attention", "gather_rows", "cp_group"]


@dataclass
class CPLayout:
    """Where this CP rank's tokens and response rows sit (host ints, and device index tensors once
    :func:`~slime.backends.megatron_utils.forward.micro_batch_inputs` has copied them).

    ``positions``/``sample_of``: per local token, its position within its sample and the sample's
    index; ``chunks``: per local chunk ``(sample, chunk index j, chunk length c)``, in local order;
    ``kv_index``: for each local chunk in turn, the rows of the CP-gathered ``[CP·T, …]`` keys that
    are its sample's positions ``0 … (j + 1)·c − 1``; ``cu_q``/``cu_k``: cumulative chunk and key
    prefix lengths; ``rows_per_rank``: how many response rows each CP rank holds;
    ``gather_index``: for the K response tokens in sample order, their row in the CP-gathered
    ``[CP · max(rows_per_rank)]`` values."""

    rank: int
    positions: torch.Tensor
    sample_of: torch.Tensor
    chunks: list[tuple[int, int, int]]
    kv_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    rows_per_rank: list[int]
    gather_index: torch.Tensor


def cp_group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def _rank_tokens(lengths: list[int], size: int, rank: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(chunks, padded lengths) of one CP rank: each chunk ``(sample, j, c)``."""
    chunks, padded = [], []
    for i, n in enumerate(lengths):
        c = -(-n // (2 * size))
        padded.append(2 * size * c)
        chunks += [(i, rank, c), (i, 2 * size - 1 - rank, c)]
    return chunks, padded


def layout(lengths: list[int], response_lengths: list[int], size: int, rank: int) -> CPLayout:
    """The CP layout of one micro-batch of samples (``lengths`` tokens, the last
    ``response_lengths`` of them the response) for CP rank ``rank`` of ``size``."""
    per_rank = [_rank_tokens(lengths, size, r)[0] for r in range(size)]
    chunks = per_rank[rank]
    local_tokens = sum(c for _, _, c in chunks)
    # where (sample, position) lives in the gathered keys: rank ρ holds chunks ρ and 2·CP−1−ρ
    sample_start, start = [], 0
    for i in range(len(lengths)):
        sample_start.append(start)
        start += 2 * per_rank[rank][2 * i][2]  # 2 chunks of c tokens per sample, on every rank
    positions, sample_of = [], []
    for i, j, c in chunks:
        positions.append(torch.arange(j * c, (j + 1) * c))
        sample_of.append(torch.full((c,), i))
    kv_parts, q_lengths, k_lengths = [], [], []
    for i, j, c in chunks:
        p = torch.arange((j + 1) * c)
        chunk = p // c
        owner = torch.minimum(chunk, 2 * size - 1 - chunk)
        slot = (chunk != owner).long()  # the second chunk a rank holds of the sample
        kv_parts.append(owner * local_tokens + sample_start[i] + slot * c + p % c)
        q_lengths.append(c)
        k_lengths.append((j + 1) * c)
    cu = lambda ls: torch.cumsum(torch.tensor([0] + ls), 0).to(torch.int32)
    # response rows: position p of sample i predicts token p + 1; the K response tokens in sample order
    first = [n - r - 1 for n, r in zip(lengths, response_lengths)]
    offsets = torch.cumsum(torch.tensor([0] + list(response_lengths)), 0)
    rows_per_rank, owner_row = [], {}
    for r, rank_chunks in enumerate(per_rank):
        count = 0
        for i, j, c in rank_chunks:
            for p in range(max(j * c, first[i]), min((j + 1) * c, lengths[i] - 1)):
                owner_row[int(offsets[i]) + p - first[i]] = (r, count)
                count += 1
        rows_per_rank.append(count)
    width = max(rows_per_rank + [1])
    gather_index = torch.tensor([owner_row[k][0] * width + owner_row[k][1] for k in range(int(offsets[-1]))], dtype=torch.long)
    return CPLayout(rank, torch.cat(positions), torch.cat(sample_of), chunks, torch.cat(kv_parts), cu(q_lengths),
                    cu(k_lengths), max(q_lengths), max(k_lengths), rows_per_rank, gather_index)


def padded_lengths(lengths: list[int], size: int) -> list[int]:
    return _rank_tokens(lengths, size, 0)[1]


class _AllGather(torch.autograd.Function):
    """Concatenate ``x`` of every CP rank along dim 0; the backward sums the gradients of this
    rank's slice over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        group, size = ctx.group, dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        if grad.is_cuda:  # NCCL
            out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad.chunk(size)[dist.get_rank(group)].contiguous(), None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: CPLayout, scale: float,
              flash_dtype: torch.dtype | None) -> torch.Tensor:
    """``query [T, h, d]``, ``key/value [T, g, d]`` of this rank's tokens → ``[T, 1, h·d]``."""
    group = cp_group()
    keys = _AllGather.apply(key, group).index_select(0, cp.kv_index)
    values = _AllGather.apply(value, group).index_select(0, cp.kv_index)
    if flash_dtype is not None:
        from slime.backends.training.varlen_attention import varlen_attention_forward

        as_heads_first = lambda t: t.to(flash_dtype).transpose(0, 1).unsqueeze(0)  # [T, h, d] -> [1, h, T, d]
        out, _ = varlen_attention_forward(None, as_heads_first(query), as_heads_first(keys), as_heads_first(values), None,
                                          scaling=scale, cu_seq_lens_q=cp.cu_q, cu_seq_lens_k=cp.cu_k,
                                          max_length_q=cp.max_q, max_length_k=cp.max_k)
        return out[0].reshape(out.shape[1], 1, -1)
    outputs, q_start, k_start = [], 0, 0
    groups = query.shape[1] // key.shape[1]
    for _, j, c in cp.chunks:
        q = query[q_start: q_start + c].transpose(0, 1).float()  # [h, c, d]
        k = keys[k_start: k_start + (j + 1) * c].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        v = values[k_start: k_start + (j + 1) * c].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [h, c, (j+1)·c]
        allowed = torch.arange((j + 1) * c)[None, :] <= (j * c + torch.arange(c))[:, None]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)  # [h, c, d]
        outputs.append(out.transpose(0, 1).reshape(c, 1, -1))
        q_start, k_start = q_start + c, k_start + (j + 1) * c
    return torch.cat(outputs)


class _GatherRows(torch.autograd.Function):
    """The K response-row values of every CP rank in sample order; the backward keeps this rank's
    rows of the gradient (every CP rank computes the same loss from the gathered values)."""

    @staticmethod
    def forward(ctx, local, gather_index, rows_per_rank, rank, group):
        width = max(rows_per_rank + [1])
        ctx.rows, ctx.width, ctx.rank, ctx.size = local.shape[0], width, rank, len(rows_per_rank)
        ctx.save_for_backward(gather_index)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(len(rows_per_rank))]
        dist.all_gather(parts, padded, group=group)
        return torch.cat(parts).index_select(0, gather_index)

    @staticmethod
    def backward(ctx, grad):
        (gather_index,) = ctx.saved_tensors
        full = grad.new_zeros((ctx.width * ctx.size, *grad.shape[1:]))
        full.index_add_(0, gather_index, grad)
        own = full[ctx.rank * ctx.width: ctx.rank * ctx.width + ctx.rows]
        return own, None, None, None, None


def gather_rows(local: torch.Tensor, cp: CPLayout) -> torch.Tensor:
    """``[K_local, …]`` values at this rank's response rows → ``[K, …]`` of the whole micro-batch."""
    return _GatherRows.apply(local, cp.gather_index, cp.rows_per_rank, cp.rank, cp_group())
