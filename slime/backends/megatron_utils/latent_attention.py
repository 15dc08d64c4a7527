"""Core attention for Megatron-Core's multi-latent attention (DeepSeek-V3) on the local layer spec.

Megatron-Core's MLA hands its core attention keys and values of different widths (``k_channels`` =
nope + rope, ``v_channels``), which only Transformer Engine's attention takes: the local
``DotProductAttention`` refuses them, so without TE an MLA model could not be built at all.
:class:`LatentCoreAttention` is that core attention in plain PyTorch — causal softmax attention per
head, fp32 scores, MLA's own softmax scale (YaRN's mscale² / √d)::

    q [s, b, h, dk], k [s, b, h, dk], v [s, b, h, dv] -> softmax(q·kᵀ · scale + causal) · v  [s, b, h·dv]

Micro-batches reach it right-padded (``[n, L_max]``; MLA models do not take the packed layout),
where the causal mask alone is exact: a real token never looks at the padding after it.
"""

from __future__ import annotations

import torch

__all__ = ["LatentCoreAttention"]


class LatentCoreAttention(torch.nn.Module):
    """Drop-in core attention of ``MLASelfAttention`` (Megatron's constructor and forward signatures)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, k_channels: int | None = None,
                 v_channels: int | None = None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__()
        if config.context_parallel_size > 1:
            raise NotImplementedError("multi-latent attention with --context-parallel-size > 1 needs Transformer Engine")
        self.config = config
        self.layer_number = layer_number
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.k_channels ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.hidden_size_per_attention_head_v = self.v_channels

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("LatentCoreAttention takes right-padded micro-batches, not packed rows")
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        sq, sk = scores.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.training and self.dropout:
            probs = torch.nn.functional.dropout(probs, p=self.dropout)
        out = torch.matmul(probs, v)  # [b, h, s, dv]
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)
